# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The compiled hold step stays lean: guards for the performance engineering.

The speed of `accumulate` comes from what its optimized HLO does not contain:
no copy of the accumulator, the inner state or the zero updates, and no inner
optimizer arithmetic outside the boundary branch. These checks read the
compiled HLO, which is deterministic, instead of timing anything.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import mlp_loss, mlp_params

import optax_accum

SIZES = (256, 256, 256, 256, 256)  # repeated shapes: XLA merges their zeros


def _compiled(tx):
    params = mlp_params(0, SIZES)
    x, y = jnp.ones((4, SIZES[0])), jnp.ones((4, SIZES[-1]))

    def step(params, state, x, y):
        grads = jax.grad(mlp_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    jitted = jax.jit(step, donate_argnums=(0, 1))
    return jitted.lower(params, tx.init(params), x, y).compile()


def _computations(hlo: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            name = "ENTRY" if m.group(1) else m.group(2)
            comps[name] = []
        elif name and line.startswith("  "):
            comps[name].append(line.strip())
    return comps


def _branches(comps: dict[str, list[str]]) -> set[str]:
    roots = set()
    for lines in comps.values():
        for line in lines:
            m = re.search(r"branch_computations=\{([^}]*)\}", line)
            if m:
                roots |= set(re.findall(r"%([\w.\-]+)", m.group(1)))
    reach, todo = set(), list(roots)
    while todo:
        c = todo.pop()
        if c in reach or c not in comps:
            continue
        reach.add(c)
        for line in comps[c]:
            todo += re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line)
    return reach


def _big_copies(hlo: str) -> list[str]:
    """Copies of arrays with at least 1,000 elements, anywhere in the module."""
    out = []
    for lines in _computations(hlo).values():
        for line in lines:
            m = re.search(r"= \w+\[([\d,]*)\]\S* copy\(", line)
            if m:
                dims = [int(d) for d in m.group(1).split(",") if d]
                if math.prod(dims) >= 1000:
                    out.append(line)
    return out


@pytest.mark.parametrize("drop_in", [False, True])
def test_hold_path_has_no_large_copies(drop_in):
    if drop_in:
        tx = optax_accum.MultiSteps(optax.adam(1e-3), 4).gradient_transformation()
    else:
        tx = optax_accum.accumulate(optax.adam(1e-3), 4)
    hlo = _compiled(tx).as_text()
    assert _big_copies(hlo) == []


def test_inner_optimizer_runs_only_in_the_boundary_branch():
    hlo = _compiled(optax_accum.accumulate(optax.adam(1e-3), 4)).as_text()
    comps = _computations(hlo)
    branches = _branches(comps)
    assert branches, "no conditional in the compiled step"
    # Adam's sqrt(nu) is the marker of the inner update.
    where = {c for c, lines in comps.items() for line in lines if " sqrt(" in line}
    assert where and where <= branches, where


def test_temp_memory_is_below_optax_multisteps():
    ours = _compiled(optax_accum.accumulate(optax.adam(1e-3), 4))
    theirs = _compiled(optax.MultiSteps(optax.adam(1e-3), 4).gradient_transformation())
    ours_temp = ours.memory_analysis().temp_size_in_bytes
    assert ours_temp <= theirs.memory_analysis().temp_size_in_bytes
