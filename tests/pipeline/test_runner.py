# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The table runner (`_loop`), read from the compiled program and the numbers.

ZB-H1's B and W each cost what their name says (the FLOPs of the stage's
input gradient and weight gradient, from residuals F kept), no pending slot
holds a parameter (its memory flat in M: test_zb). The accumulator
dtype narrows the gradient sums, never the parameters the model runs at,
and may be a pytree prefix of the parameters, as in `microbatch`.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import pipeline as pl
from tests.helpers import hlo
from tests.helpers.lanes import sweep
from tests.pipeline import models as md
from tests.pipeline import test_exact as te
from tests.pipeline import test_hlo as th

WIDTH, ROWS = 16, 4
SCHEDULES = [
    ("gpipe", 1),
    ("circular", 2),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("zb_h1", 1),
]
_DEF = re.compile(r"%([\w.\-]+) = \w+\[([\d,]*)\]")
_DOT = re.compile(r"= \w+\[([\d,]*)\]\S* dot\(%([\w.\-]+)")
_LHS = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def dot_flops(comps: dict, names) -> int:
    """2 · (result elements) · (contracted size) summed over the dots."""
    total = 0
    for name in names:
        shapes = {
            d.group(1): _dims(d.group(2))
            for line in comps[name]
            if (d := _DEF.search(line))
        }
        for line in comps[name]:
            found = _DOT.search(line)
            if not found:
                continue
            lhs = shapes[found.group(2)]
            contract = _dims(_LHS.search(line).group(1))
            total += (
                2
                * int(np.prod(_dims(found.group(1))))
                * int(np.prod([lhs[i] for i in contract]))
            )
    return total


def _stage_only(comps: dict, names) -> bool:
    """No dot of the embedding (D_IN = 3) or the head (D_OUT = 2)."""
    for name in names:
        for line in comps[name]:
            if " dot(" in line and re.search(
                rf"\[(?:[\d,]*,)?({md.D_IN}|{md.D_OUT})(?:,[\d,]*)?\]", line
            ):
                return False
    return True


def _variants(comps: dict, branch: str) -> list[str]:
    """A top-level op branch's role variants (itself without an inner switch)."""
    for line in comps[branch]:
        if " conditional(" in line:
            return hlo.callees(line)
    return [branch]


def reference_flops(width: int, rows: int) -> tuple[int, int]:
    """The stage's input-gradient and weight-gradient FLOPs, each compiled
    alone from the residuals of ``jax.vjp`` (no forward)."""
    sp = {"w": jnp.ones((width, width)), "b": jnp.ones((width,))}
    x, ct = jnp.ones((rows, width)), jnp.ones((rows, width))
    _, vjp = jax.vjp(md.stage_fn, sp, x)
    out = []
    for part in (1, 0):
        text = jax.jit(lambda v, c, part=part: v(c)[part]).lower(vjp, ct)
        comps, _ = hlo.computations(text.compile().as_text())
        out.append(dot_flops(comps, comps))
    return out[0], out[1]


def test_zb_b_and_w_flops_are_the_stage_gradients():
    """B: the input gradient only (no second stage forward); W: the weight
    gradient only. Each within 1.1× of the stage's own, compiled alone."""
    low, _ = th.lowered("zb_h1", 8, rows=ROWS, width=WIDTH)
    comps, _ = hlo.computations(low.compile().as_text())
    branches = th.adding_branches(comps)
    assert len(branches) == 3, branches  # (whole backward), B, W
    want_b, want_w = reference_flops(WIDTH, ROWS)
    for branch, want in ((branches[1], want_b), (branches[2], want_w)):
        middle = [
            v
            for v in _variants(comps, branch)
            if _stage_only(comps, hlo.reachable(comps, [v]))
        ]
        assert middle, branch
        for v in middle:
            got = dot_flops(comps, hlo.reachable(comps, [v]))
            assert want / 1.1 <= got <= 1.1 * want, (branch, got, want)


def _carry_shapes(text: str) -> list[tuple[int, ...]]:
    comps, _ = hlo.computations(text)
    shapes = []
    for lines in comps.values():
        for line in lines:
            if " while(" in line:
                head = line.split(" while(")[0]
                shapes += [
                    tuple(_dims(d)) for d in re.findall(r"f32\[([\d,]*)\]", head)
                ]
    return shapes


def two_weight_stage(sp, h):
    return h + jnp.tanh(h @ sp["w1"]) @ sp["w2"]


def test_zb_pending_slots_hold_no_parameter():
    """W puts the stage's weights back itself: no pending slot keeps a copy
    (on main, with a stage of two weights, each of the S slots held a
    [width, width] copy of the second, which sat behind a cond)."""
    params, batch = md.make(4, rows=32, width=WIDTH)
    fp, _, lp = params
    k = jax.random.split(jax.random.key(1), 2)
    sp = {
        w: jax.random.normal(key, (4, WIDTH, WIDTH)) / 4
        for w, key in zip(("w1", "w2"), k, strict=True)
    }
    mesh = te.stage_mesh(4)
    with jax.set_mesh(mesh):
        sp = jax.device_put(sp, NamedSharding(mesh, P("stage")))
        vg = pl.value_and_grad(md.first_fn, two_weight_stage, md.loss_fn, 8,
                               schedule="zb_h1")  # fmt: skip
        text = jax.jit(vg).lower((fp, sp, lp), batch).compile().as_text()
    shapes = _carry_shapes(text)
    stacks = [s for s in shapes if len(s) == 3 and s[1:] == (WIDTH, WIDTH)]
    # No stack of weights: at most an (R = 1, width, width) gradient sum.
    assert all(s[0] == 1 for s in stacks), shapes


@pytest.mark.parametrize(
    "schedule,repeats", sweep(SCHEDULES, fast=[("1f1b", 1), ("zb_h1", 1)])
)
def test_narrow_accumulator_keeps_the_parameters(schedule, repeats):
    """bf16 gradient sums with f32 parameters: the model runs at the exact
    parameters (the loss is the f32 loss; on main it was the loss at the
    parameters rounded to bf16), the sums are bf16-accurate."""
    params, batch = md.make(4 * repeats, rows=16)
    want = jax.jit(jax.value_and_grad(md.sequential))(params, batch)
    got = te.pipelined(
        te.stage_mesh(4),
        params,
        batch,
        4,
        schedule=schedule,
        repeats=repeats,
        accumulator_dtype=jnp.bfloat16,
    )
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert jax.tree.map(lambda g: g.dtype, got[1]) == jax.tree.map(
        lambda g: g.dtype, want[1]
    )
    assert md.max_rel_error(got[1], want[1]) < 2e-2


@pytest.mark.parametrize(
    "schedule,repeats", sweep(SCHEDULES, fast=[("gpipe", 1), ("zb_h1", 1)])
)
def test_per_leaf_accumulator_dtype(schedule, repeats):
    """A pytree prefix of the parameters, as `microbatch` takes it: bf16
    sums for the embedding, f32 (promote) for the rest."""
    params, batch = md.make(4 * repeats, rows=16)
    want = jax.jit(jax.value_and_grad(md.sequential))(params, batch)
    kw = {"schedule": schedule, "repeats": repeats}
    prefix = (jnp.bfloat16, "promote", {"w": None})
    got = te.pipelined(
        te.stage_mesh(4), params, batch, 4, accumulator_dtype=prefix, **kw
    )
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    md.assert_close(got[1][1:], want[1][1:], rtol=1e-5)  # f32 sums: exact
    assert md.max_rel_error(got[1][0], want[1][0]) < 2e-2
    with pytest.raises(ValueError, match="`accumulator_dtype` is not a prefix"):
        te.pipelined(te.stage_mesh(4), params, batch, 4,
                     accumulator_dtype=({"v": None}, None, None), **kw)  # fmt: skip


@pytest.mark.parametrize(("schedule", "repeats"), SCHEDULES)
def test_one_stage_device_equals_the_sequential_model(schedule, repeats):
    # S = 1 (one accelerator): the one stage is also the last, whose forward
    # is its backward's, so no variant of the forward op exists; the runner
    # gave `lax.switch` an empty branch list ("Empty branch sequence").
    mesh = jax.make_mesh((1,), ("stage",), devices=jax.devices()[:1])
    params, batch = md.make(repeats, rows=ROWS * 4, width=WIDTH)
    with jax.set_mesh(mesh):
        fp, sp, lp = params
        params = (fp, jax.device_put(sp, NamedSharding(mesh, P("stage"))), lp)
        vg = pl.value_and_grad(
            md.first_fn, md.stage_fn, md.loss_fn, 4,
            schedule=schedule, repeats=repeats,
        )  # fmt: skip
        loss, grads = jax.jit(vg)(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(md.sequential)(
        jax.device_get(params), batch
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for ours, theirs in zip(
        jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True
    ):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
