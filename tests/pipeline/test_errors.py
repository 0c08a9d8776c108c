# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Bad input to `pipeline.value_and_grad`: an error that names the argument."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from optax_accum import pipeline as pl
from tests.helpers.lanes import sweep
from tests.pipeline import models as md
from tests.pipeline.test_semantics import SCHEDULES


def trace(mesh, params, batch, m=4, fns=None, **kw):
    fns = fns or (md.first_fn, md.stage_fn, md.loss_fn)
    vg = pl.value_and_grad(*fns, m, **kw)
    if mesh is None:
        return jax.eval_shape(vg, params, batch)
    with jax.set_mesh(mesh):
        return jax.eval_shape(vg, params, batch)


def mesh_of(names=("stage",), shape=(4,)):
    return jax.make_mesh(shape, names, devices=jax.devices()[: math.prod(shape)])


def test_mesh_without_stage_axis():
    params, batch = md.make(4, rows=8)
    with pytest.raises(ValueError, match=r"`stage_axis`='stage' is not.*'data'"):
        trace(mesh_of(("data",)), params, batch)
    with pytest.raises(ValueError, match="`stage_axis`"):
        trace(None, params, batch)
    with pytest.raises(ValueError, match="`stage_axis`='pipe'"):
        trace(mesh_of(), params, batch, stage_axis="pipe")


def test_stage_dimension_not_s_times_repeats():
    params, batch = md.make(3, rows=8)
    with pytest.raises(ValueError, match=r"`stage_params`.*leading axis of 4.*4·1"):
        trace(mesh_of(), params, batch)
    params, batch = md.make(4, rows=8)
    with pytest.raises(ValueError, match=r"`stage_params`.*leading axis of 8.*4·2"):
        trace(mesh_of(), params, batch, schedule="circular", repeats=2)


def test_stage_changes_h():
    params, batch = md.make(4, rows=8)

    def narrowing(sp, h):
        return md.stage_fn(sp, h)[:, :4]

    def casting(sp, h):
        return md.stage_fn(sp, h).astype(jnp.bfloat16)

    for bad in (narrowing, casting):
        with pytest.raises(ValueError, match="`stage_fn` must return `h`"):
            trace(mesh_of(), params, batch, fns=(md.first_fn, bad, md.loss_fn))


def test_microbatches_not_divisible():
    params, batch = md.make(4, rows=10)
    with pytest.raises(ValueError, match=r"batch size 10.*`num_microbatches`=4"):
        trace(mesh_of(), params, batch)
    params, batch = md.make(4, rows=12)
    with pytest.raises(ValueError, match=r"`num_microbatches`=6 must be a multiple"):
        trace(mesh_of(), params, batch, m=6, schedule="circular")
    params, batch = md.make(8, rows=12)
    with pytest.raises(ValueError, match=r"`num_microbatches`=6 must be a multiple"):
        trace(mesh_of(), params, batch, m=6, schedule="interleaved_1f1b", repeats=2)


def test_bad_options_at_construction():
    fns = (md.first_fn, md.stage_fn, md.loss_fn)
    with pytest.raises(ValueError, match=r"`repeats`=2 needs `schedule='circular'`"):
        pl.value_and_grad(*fns, 4, repeats=2)
    with pytest.raises(ValueError, match=r"`repeats`=2 needs.*'1f1b'"):
        pl.value_and_grad(*fns, 4, schedule="1f1b", repeats=2)
    with pytest.raises(ValueError, match=r"`repeats`=2 needs.*'zb_h1'"):
        pl.value_and_grad(*fns, 4, schedule="zb_h1", repeats=2)
    with pytest.raises(ValueError, match="`schedule` must be one of"):
        pl.value_and_grad(*fns, 4, schedule="zb")
    with pytest.raises(ValueError, match="`num_microbatches` must be a positive int"):
        pl.value_and_grad(*fns, 0)
    with pytest.raises(TypeError, match="`stage_fn` must be callable"):
        pl.value_and_grad(md.first_fn, None, md.loss_fn, 4)
    with pytest.raises(ValueError, match="`num_stages`"):
        pl.schedule_table("gpipe", 0, 4)


def test_params_not_a_triple():
    params, batch = md.make(4, rows=8)
    with pytest.raises(TypeError, match="`params` must be"):
        trace(mesh_of(), params[:2], batch)


def test_microbatches_not_divisible_by_data_shards():
    """Issue 28 (6): the numbers, and no stray quote."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = mesh_of(("data", "stage"), (2, 4))
    params, batch = md.make(4, rows=12)
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    with pytest.raises(
        ValueError,
        match=r"batch size 12 .*`num_microbatches`=4 times the 2 data shards "
        r"of \('data',\) \(= 8\)",
    ):
        trace(mesh, params, batch, data_axes="data")


CHECKED = sweep(SCHEDULES, fast=[("gpipe", 1)])


@pytest.mark.parametrize("schedule,repeats", CHECKED)
def test_loss_and_weight_must_be_scalars(schedule, repeats):
    """Issue 28 (6): these failed inside JAX instead of naming the argument."""
    params, batch = md.make(4 * repeats, rows=8)
    kw = {"schedule": schedule, "repeats": repeats}

    def rows_loss(lp, h, b):
        return jnp.sum((h @ lp["w"] - b["y"]) ** 2, axis=-1)

    with pytest.raises(ValueError, match="`loss_fn` must return a scalar"):
        trace(mesh_of(), params, batch, fns=(md.first_fn, md.stage_fn, rows_loss), **kw)

    def int_loss(lp, h, b):
        return jnp.int32(1)

    with pytest.raises(TypeError, match="`loss_fn` must return a floating"):
        trace(mesh_of(), params, batch, fns=(md.first_fn, md.stage_fn, int_loss), **kw)
    with pytest.raises(ValueError, match="`weight_fn` must return a scalar"):
        trace(mesh_of(), params, batch, weight_fn=lambda mb: mb["mask"], **kw)


@pytest.mark.parametrize("schedule,repeats", CHECKED)
def test_integer_parameter_leaf(schedule, repeats):
    params, batch = md.make(4 * repeats, rows=8)
    kw = {"schedule": schedule, "repeats": repeats}
    fp, sp, lp = params
    with pytest.raises(TypeError, match=r"`params`\[2\]\['steps'\] is int32"):
        trace(mesh_of(), (fp, sp, {**lp, "steps": jnp.int32(0)}), batch, **kw)


@pytest.mark.parametrize("schedule,repeats", CHECKED)
def test_rng_with_two_argument_stage_fn(schedule, repeats):
    params, batch = md.make(4 * repeats, rows=8)
    vg = pl.value_and_grad(md.first_fn, md.stage_fn, md.loss_fn, 4,
                           schedule=schedule, repeats=repeats)  # fmt: skip
    with (
        jax.set_mesh(mesh_of()),
        pytest.raises(TypeError, match=r"with `rng`, `stage_fn` is called"),
    ):
        jax.eval_shape(vg, params, batch, jax.random.key(0))
