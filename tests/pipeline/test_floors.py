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
