# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""ZB-H1 runs as the sequential model, in flat memory, with its backward split.

The exactness matrix of the other schedules (fp32 at rtol 1e-5, S in
{2, 4, 8}, M in {S, 2S, 8S}); a (data 2, stage 4) mesh with token weights;
NaN in every bubble; ``rng`` and ``has_aux``. In the compiled program: one
collective-permute per direction in the loop, no all-gather over the stage
axis, the same program for M = 4 and M = 64, temp memory flat in M, and B's
branch without the weight gradient, W's without the recomputed forward.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum.pipeline import _step
from tests.helpers import hlo
from tests.helpers.lanes import sweep
from tests.pipeline import models as md
from tests.pipeline import test_exact as te
from tests.pipeline import test_hlo as th


@pytest.mark.parametrize(
    "stages,m",
    sweep([(s, m) for s in (2, 4, 8) for m in (s, 2 * s, 8 * s)], fast=[(4, 8)]),
)
def test_exact(stages, m):
    te.check_exact("zb_h1", stages, m, 1)


@pytest.mark.slow
@pytest.mark.parametrize("stages,m", [(2, 1), (4, 3), (8, 5)])
def test_exact_fewer_microbatches_than_stages(stages, m):
    te.check_exact("zb_h1", stages, m, 1)


@pytest.mark.slow
def test_bf16_stages():
    fns = (te.first_bf16, te.stage_bf16, te.loss_f32)
    params, batch = md.make(4, rows=32)
    want = jax.jit(
        jax.value_and_grad(
            lambda p, b: md.sequential(p, b, *fns[1:2], first_fn=fns[0], loss_fn=fns[2])
        )
    )(params, batch)
    got = te.pipelined(te.stage_mesh(4), params, batch, 8, schedule="zb_h1", fns=fns)
    assert jax.tree.map(lambda g: g.dtype, got) == jax.tree.map(lambda g: g.dtype, want)
    md.assert_close(got, want, rtol=2e-2)


@pytest.mark.parametrize("weighted", sweep([True, False], fast=[True]))
def test_data_mesh(weighted):
    """(data 2, stage 4), the rows sharded over ``data``, with token weights."""
    te.check_data_mesh("zb_h1", weighted)


@pytest.mark.slow
def test_token_weights():
    params, batch = md.make(4, rows=32, ragged=True)
    want = jax.jit(jax.value_and_grad(md.sequential))(params, batch)
    got = te.pipelined(
        te.stage_mesh(4), params, batch, 8, schedule="zb_h1", weight_fn=md.weight_fn
    )
    md.assert_close(got, want, rtol=1e-5)


def test_nan_in_bubbles(monkeypatch):
    """Every idle slot sends NaN and every buffer starts as NaN."""
    monkeypatch.setattr(_step, "BUBBLE_FILL", float("nan"))
    params, batch = md.make(4, rows=16)
    want = jax.jit(jax.value_and_grad(md.sequential))(params, batch)
    got = te.pipelined(te.stage_mesh(4), params, batch, 4, schedule="zb_h1")
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(got))
    md.assert_close(got, want, rtol=1e-5)


@pytest.mark.slow
def test_sharded_batch_explicit():
    """Rows placed over ``data`` on the mesh: the same numbers."""
    mesh = te.stage_mesh(4, data=2)
    params, batch = md.make(4, rows=32)
    want = jax.jit(jax.value_and_grad(md.sequential))(params, batch)
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    got = te.pipelined(mesh, params, batch, 16, schedule="zb_h1", data_axes="data")
    md.assert_close(got, want, rtol=1e-5)


def test_collectives():
    th.check_collectives("zb_h1")


def dot_shapes(comps, names):
    """The result shapes of the dots in computations ``names``."""
    found = []
    for name in names:
        for line in comps[name]:
            if " dot(" in line:
                found.append(re.search(r"= (\w+\[[\d,]*\])", line).group(1))
    return sorted(found)


def test_backward_split_in_hlo():
    """The loop's switch has a branch per op: B has no stage weight gradient
    (no ``[width, width]`` dot) but the head's and the embedding's; W is the
    stage's weight gradient alone and recomputes no forward (B runs the stage
    and the head forward again before its input gradient)."""
    width = 16
    low, _ = th.lowered("zb_h1", 8, rows=4, width=width)
    comps, _ = hlo.computations(low.compile().as_text())
    branches = th.adding_branches(comps)
    assert len(branches) == 3, branches  # (whole backward), B, W
    b, w = (dot_shapes(comps, hlo.reachable(comps, [x])) for x in branches[1:])
    weight = f"f32[{width},{width}]"
    assert weight not in b, b
    assert weight in w, w
    # The head's weight gradient at B, with its forward; W is the stage's
    # weight gradient alone.
    assert f"f32[{width},2]" in b and f"f32[{width},2]" not in w, (b, w)
    assert w == [weight], w
    # The head's forward ([rows, 2]) runs again at B, never at W.
    assert "f32[4,2]" in b and "f32[4,2]" not in w, (b, w)


@pytest.mark.slow
def test_program_size_flat_in_m():
    small, _ = th.lowered("zb_h1", 4)
    large, _ = th.lowered("zb_h1", 64)
    a = th.instructions(small.compile().as_text())
    b = th.instructions(large.compile().as_text())
    assert abs(b - a) <= 0.1 * a, (a, b)


@pytest.mark.slow
def test_memory_flat_in_m():
    small, large = th.temp_bytes("zb_h1", 8), th.temp_bytes("zb_h1", 64)
    assert large <= 1.1 * small, (small, large)
