# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The compiled hold step stays lean: guards for the performance engineering.

The speed of `accumulate` comes from what its optimized HLO does not contain:
no copy of the accumulator, the inner state or the zero updates, and no inner
optimizer arithmetic outside the boundary branch. These checks read the
compiled HLO, which is deterministic, instead of timing anything.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_accum
from tests.helpers import hlo as _hlo
from tests.helpers.models import mlp_loss, mlp_params

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


@pytest.mark.parametrize("drop_in", [False, True])
def test_hold_path_has_no_large_copies(drop_in):
    if drop_in:
        tx = optax_accum.MultiSteps(optax.adam(1e-3), 4).gradient_transformation()
    else:
        tx = optax_accum.accumulate(optax.adam(1e-3), 4)
    comps, _ = _hlo.computations(_compiled(tx).as_text())
    assert _hlo.large_copies(comps) == []


def test_inner_optimizer_runs_only_in_the_boundary_branch():
    hlo = _compiled(optax_accum.accumulate(optax.adam(1e-3), 4)).as_text()
    comps, _ = _hlo.computations(hlo)
    branches = _hlo.reachable(comps, _hlo.branch_roots(comps))
    assert branches, "no conditional in the compiled step"
    # Adam's sqrt(nu) is the marker of the inner update.
    where = {c for c, lines in comps.items() for line in lines if " sqrt(" in line}
    assert where and where <= branches, where


def test_temp_memory_is_below_optax_multisteps():
    ours = _compiled(optax_accum.accumulate(optax.adam(1e-3), 4))
    theirs = _compiled(optax.MultiSteps(optax.adam(1e-3), 4).gradient_transformation())
    ours_temp = ours.memory_analysis().temp_size_in_bytes
    assert ours_temp <= theirs.memory_analysis().temp_size_in_bytes
