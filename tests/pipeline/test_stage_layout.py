# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""``stage_layout="repeats_by_stage"``: stage parameters stacked (repeats, S).

Stage ``r·S + s`` at ``[r, s]``, placed ``P(None, "stage")``: every device
holds the stages it runs (the HLO test of no all-gather over the stage axis is
`test_hlo.test_repeats_by_stage_layout_gathers_nothing_over_stage`). The
result is the sequential model's, with the gradients in the same layout and
placement, on Explicit and Auto meshes; a leaf of another shape, and an
unknown layout, are refused by name.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import pipeline as pl
from tests.pipeline import models as md

STAGES, REPEATS, M = 4, 2, 8


def by_stage(sp):
    """``(S·R, ...)`` stacked stages as ``(R, S, ...)``: [r, s] is stage r·S+s."""
    return jax.tree.map(lambda v: v.reshape(REPEATS, STAGES, *v.shape[1:]), sp)


def mesh_of(axis_type):
    return jax.make_mesh(
        (STAGES,), ("stage",), devices=jax.devices()[:STAGES], axis_types=(axis_type,)
    )


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("schedule", ["circular", "interleaved_1f1b"])
def test_equals_the_sequential_model_in_the_same_layout(schedule, axis_type):
    params, batch = md.make(STAGES * REPEATS, rows=2 * M, ragged=True)
    want_value, (wf, ws, wl) = jax.jit(jax.value_and_grad(md.sequential))(params, batch)
    fp, sp, lp = params
    mesh = mesh_of(axis_type)
    spec = NamedSharding(mesh, P(None, "stage"))
    with jax.set_mesh(mesh):
        sp = jax.device_put(by_stage(sp), spec)
        vg = pl.value_and_grad(
            md.first_fn, md.stage_fn, md.loss_fn, M,
            schedule=schedule, repeats=REPEATS, weight_fn=md.weight_fn,
            stage_layout="repeats_by_stage",
        )  # fmt: skip
        value, (gf, gs, gl) = jax.jit(vg, out_shardings=(None, (None, spec, None)))(
            (fp, sp, lp), batch
        )
    md.assert_close((value, (gf, gs, gl)), (want_value, (wf, by_stage(ws), wl)), 1e-5)
    for g in jax.tree.leaves(gs):
        assert g.sharding.spec == P(None, "stage"), g.sharding


def test_one_repeat_is_a_leading_axis_of_one():
    """``repeats=1`` (GPipe, 1F1B, ZB-H1) takes ``(1, S, ...)`` as well."""
    params, batch = md.make(STAGES, rows=2 * M)
    want = jax.jit(jax.value_and_grad(md.sequential))(params, batch)
    fp, sp, lp = params
    sp = jax.tree.map(lambda v: v[None], sp)
    with jax.set_mesh(mesh_of(AxisType.Explicit)):
        vg = pl.value_and_grad(
            md.first_fn, md.stage_fn, md.loss_fn, M, schedule="zb_h1",
            stage_layout="repeats_by_stage",
        )  # fmt: skip
        value, (gf, gs, gl) = jax.jit(vg)((fp, sp, lp), batch)
    gs = jax.tree.map(lambda v: v[0], gs)
    md.assert_close((value, (gf, gs, gl)), want, 1e-5)


def test_stacked_leaves_are_refused_naming_the_layout():
    params, batch = md.make(STAGES * REPEATS, rows=2 * M)
    with jax.set_mesh(mesh_of(AxisType.Explicit)):
        vg = pl.value_and_grad(
            md.first_fn, md.stage_fn, md.loss_fn, M, schedule="circular",
            repeats=REPEATS, stage_layout="repeats_by_stage",
        )  # fmt: skip
        with pytest.raises(
            ValueError, match=r"stage_layout='repeats_by_stage'.*\(2, 4\)"
        ):
            vg(params, batch)


def test_unknown_layout_is_refused_at_construction():
    with pytest.raises(ValueError, match="`stage_layout`"):
        pl.value_and_grad(
            md.first_fn, md.stage_fn, md.loss_fn, M, stage_layout="interleaved"
        )
    params, batch = md.make(STAGES, rows=2 * M)
    with pytest.raises(ValueError, match="`stage_layout`"):
        pl.measure_costs(
            md.first_fn, md.stage_fn, md.loss_fn, params, batch, stage_layout="x"
        )


def test_measure_costs_reads_stage_zero_in_either_layout():
    params, batch = md.make(STAGES * REPEATS, rows=2 * M, width=64)
    fp, sp, lp = params
    stacked = pl.measure_costs(md.first_fn, md.stage_fn, md.loss_fn, params, batch, M)
    by = pl.measure_costs(
        md.first_fn, md.stage_fn, md.loss_fn, (fp, by_stage(sp), lp), batch, M,
        stage_layout="repeats_by_stage",
    )  # fmt: skip
    np.testing.assert_allclose(tuple(by), tuple(stacked), rtol=1e-6)
