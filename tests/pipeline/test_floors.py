# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The benchmark's hand-written floors compute the sequential model's loss
and gradients (``jax.value_and_grad``), so a floor is a real floor."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from benchmarks import pipeline_floors as floors
from tests.pipeline import models as md

STAGES = 4


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < STAGES:
        pytest.skip(f"needs {STAGES} devices")
    return jax.make_mesh((STAGES,), ("stage",), devices=jax.devices()[:STAGES])


@pytest.mark.parametrize("name", ["gpipe", "one_f_one_b", "zb_h1", "pipeline_free"])
@pytest.mark.parametrize("m", [4, 8])
def test_floor_equals_value_and_grad(mesh, name, m):
    params, batch = md.make(STAGES, rows=2 * m, width=8)
    batch["mask"] = np.ones_like(batch["mask"])
    want = jax.value_and_grad(md.sequential)(params, batch)
    with jax.set_mesh(mesh):
        got = jax.jit(getattr(floors, name)(mesh, m))(params, batch)
    md.assert_close(got, want, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpipe", "one_f_one_b"])
def test_two_layer_stage_floor_equals_value_and_grad(mesh, name):
    """The benchmark's base for circular and interleaved 1F1B: 8 layers as 4
    two-layer stages (stage leaves lead with (S, 2))."""
    from benchmarks.bench_pipeline_floors import two_layers

    (fp, sp, lp), batch = md.make(2 * STAGES, rows=16, width=8)
    batch["mask"] = np.ones_like(batch["mask"])
    want_value, (wf, ws, wl) = jax.value_and_grad(md.sequential)((fp, sp, lp), batch)
    pair = jax.tree.map(lambda v: v.reshape(STAGES, 2, *v.shape[1:]), sp)
    with jax.set_mesh(mesh):
        got = jax.jit(getattr(floors, name)(mesh, 8, stage_fn=two_layers))(
            (fp, pair, lp), batch
        )
    ws = jax.tree.map(lambda v: v.reshape(STAGES, 2, *v.shape[1:]), ws)
    md.assert_close(got, (want_value, (wf, ws, wl)), rtol=1e-5)
