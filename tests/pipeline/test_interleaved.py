# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""``schedule="interleaved_1f1b"``: the sequential model's value and
gradients, memory flat in M, one loop of two collective-permutes.

fp32 at rtol 1e-5 over S in {2, 4, 8}, M in {S, 2S, 8S} and repeats in
{2, 3} (the fast lane runs S = 4, M = 8, r = 2); on a (data 2, stage 4)
mesh with token weights; with NaN in every bubble slot; with ``rng`` and
``has_aux``. Its runner knows only the table: it runs 1F1B's and GPipe's.
"""

from __future__ import annotations

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import pipeline as pl
from optax_accum.pipeline import _interleaved, _run, _step
from tests.helpers.lanes import sweep
from tests.pipeline import models as md
from tests.pipeline import test_hlo as hlo_checks
from tests.pipeline.test_exact import (
    pipelined,
    reference,
    stage_mesh,
)

SCHEDULE = "interleaved_1f1b"
MATRIX = [(s, m, r) for s in (2, 4, 8) for m in (s, 2 * s, 8 * s) for r in (2, 3)]


@pytest.mark.parametrize("stages,m,repeats", sweep(MATRIX, fast=[(4, 8, 2)]))
def test_exact(stages, m, repeats):
    params, batch, want = reference(stages * repeats, 2 * m)
    got = pipelined(
        stage_mesh(stages), params, batch, m, schedule=SCHEDULE, repeats=repeats
    )
    md.assert_close(got, want, rtol=1e-5)


@pytest.mark.parametrize("repeats", sweep([2, 3], fast=[2]))
def test_data_mesh_token_weights(repeats):
    """A (data 2, stage 4) mesh, rows sharded over ``data``, unequal token
    counts per micro-batch: the exact token mean."""
    mesh = stage_mesh(4, data=2)
    params, batch = md.make(4 * repeats, rows=32, ragged=True)
    want = jax.jit(jax.value_and_grad(md.sequential))(params, batch)
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    got = pipelined(
        mesh,
        params,
        batch,
        8,
        schedule=SCHEDULE,
        repeats=repeats,
        weight_fn=md.weight_fn,
        data_axes="data",
    )
    md.assert_close(got, want, rtol=1e-5)


def test_nan_in_bubbles(monkeypatch):
    """Every idle slot sends NaN and every buffer starts as NaN."""
    monkeypatch.setattr(_step, "BUBBLE_FILL", float("nan"))
    params, batch, want = reference(8, 8)
    got = pipelined(stage_mesh(4), params, batch, 4, schedule=SCHEDULE, repeats=2)
    md.assert_close(got, want, rtol=1e-5)


@pytest.mark.parametrize("schedule", sweep(["1f1b", "gpipe"], fast=["1f1b"]))
def test_runner_runs_any_table(schedule, monkeypatch):
    """The interleaved runner reads only the table: given 1F1B's (or GPipe's
    forward-then-mirrored one) it computes the same gradients."""
    monkeypatch.setattr(_run, "_1f1b", _interleaved)
    monkeypatch.setattr(_run, "_gpipe", _interleaved)
    params, batch, want = reference(4, 16)
    got = pipelined(stage_mesh(4), params, batch, 8, schedule=schedule)
    md.assert_close(got, want, rtol=1e-5)


def test_bad_options():
    fns = (md.first_fn, md.stage_fn, md.loss_fn)
    with pytest.raises(ValueError, match=r"`repeats` must be a positive int"):
        pl.value_and_grad(*fns, 4, schedule=SCHEDULE, repeats=0)
    params, batch = md.make(8, rows=12)
    vg = pl.value_and_grad(*fns, 6, schedule=SCHEDULE, repeats=2)
    with (
        jax.set_mesh(stage_mesh(4)),
        pytest.raises(ValueError, match=r"`num_microbatches`=6 must be a multiple"),
    ):
        jax.eval_shape(vg, params, batch)
    vg = pl.value_and_grad(*fns, 4, schedule=SCHEDULE, repeats=3)
    with (
        jax.set_mesh(stage_mesh(4)),
        pytest.raises(ValueError, match=r"`stage_params`.*leading axis of 12.*4·3"),
    ):
        jax.eval_shape(vg, params, md.make(8, rows=8)[1])


@pytest.mark.parametrize("check", sweep(["collectives", "size"], fast=["collectives"]))
def test_hlo(check):
    """Per loop body one collective-permute per direction, nothing else
    crossing devices in the loop; the program the same size for M = 4, 64."""
    if check == "collectives":
        hlo_checks.check_collectives(SCHEDULE)
    else:
        hlo_checks.test_program_size_flat_in_m(SCHEDULE)


@pytest.mark.slow
def test_memory_flat_in_m():
    small = hlo_checks.temp_bytes(SCHEDULE, 8)
    large = hlo_checks.temp_bytes(SCHEDULE, 64)
    assert large <= 1.1 * small, (small, large)
