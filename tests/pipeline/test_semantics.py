# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The pipeline under the library's one semantics (issue 28, part 1).

Each test reproduces a finding of issue 28 that `main` got wrong: weights by
the `_weights` contract, compared with `microbatch_value_and_grad`; idle slots
that compute nothing, for stages with an infinite slope at 0; gradient sums
in the accumulator dtype; x64; gradients that feed `accumulate` and
``optax.MultiSteps``; a key per data shard; ``has_aux`` over data shards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import pipeline as pl
from optax_accum.pipeline import _step
from tests.helpers.lanes import sweep
from tests.pipeline import models as md

# Every schedule, each with its repeats: every property below is every one's.
SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("circular", 2),
    ("interleaved_1f1b", 2),
    ("zb_h1", 1),
]


def mesh_of(stages=4, data=1):
    devices = jax.devices()[: stages * data]
    if data == 1:
        return jax.make_mesh((stages,), ("stage",), devices=devices)
    return jax.make_mesh((data, stages), ("data", "stage"), devices=devices)


def run(mesh, params, batch, m, fns=None, rng=None, **kw):
    fns = fns or (md.first_fn, md.stage_fn, md.loss_fn)
    with jax.set_mesh(mesh):
        return jax.jit(pl.value_and_grad(*fns, m, **kw))(params, batch, rng)


def loop_face(params, batch, m, **kw):
    """The loss face on the sequential model: the one semantics."""
    vg = optax_accum.microbatch_value_and_grad(md.sequential, m, **kw)
    return jax.jit(vg)(params, batch)


def masked(rows, m, padding):
    """A ragged batch whose micro-batch ``padding`` has no valid token."""
    params, batch = md.make(4, rows=rows, ragged=True)
    mask = np.asarray(batch["mask"]).copy()
    mask[padding::m] = 0.0
    return params, {**batch, "mask": jnp.asarray(mask)}


def token_mean_loss(lp, h, batch):
    """The guide's token mean, ``sum(nll * mask) / sum(mask)``: 0/0 = NaN on
    a micro-batch of padding only."""
    err = jnp.sum((h @ lp["w"] - batch["y"]) ** 2, axis=-1)
    return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])


@pytest.mark.parametrize("schedule,repeats", sweep(SCHEDULES, fast=[("gpipe", 1)]))
def test_padding_microbatch_weighs_nothing(schedule, repeats):
    """Issue 28 (1): a padding-only micro-batch gave a NaN loss and NaN
    gradients; it weighs 0 and the result is the full batch's."""
    params = md.make(4 * repeats, rows=16)[0]
    _, batch = masked(16, 4, padding=1)
    seq = lambda p, b: md.sequential(p, b, loss_fn=token_mean_loss)
    want = jax.jit(jax.value_and_grad(seq))(params, batch)
    fns = (md.first_fn, md.stage_fn, token_mean_loss)
    got = run(mesh_of(), params, batch, 4, fns=fns, schedule=schedule,
              repeats=repeats, weight_fn=md.weight_fn)  # fmt: skip
    md.assert_close(got, want, rtol=1e-5)


REJECTED = [
    (bad, *sch) for bad in (-1.0, float("nan"), float("inf")) for sch in SCHEDULES
]


@pytest.mark.parametrize(
    "bad,schedule,repeats",
    sweep(REJECTED, fast=[(-1.0, "gpipe", 1), (-1.0, "1f1b", 1)]),
)
def test_rejected_weight_like_loop_face(bad, schedule, repeats):
    """Issue 28 (1): a weight of -1 (NaN, inf) rejects its micro-batch, as
    `microbatch_value_and_grad` does (main: 4.1295 against 3.0971, NaN)."""
    params, batch = md.make(4 * repeats, rows=16, ragged=True)

    def weight_fn(mb):
        w = md.weight_fn(mb)
        return jnp.where(mb["x"][0, 0] == batch["x"][2, 0], bad, w)

    want = loop_face(params, batch, 4, weight_fn=weight_fn)
    got = run(mesh_of(), params, batch, 4, schedule=schedule, repeats=repeats,
              weight_fn=weight_fn)  # fmt: skip
    md.assert_close(got, want, rtol=1e-5)


@pytest.mark.slow
def test_explicit_data_shard_without_tokens():
    """Issue 28 (1): on an Explicit (data 2, stage 2) mesh a data shard with
    no token in one micro-batch gave NaN."""
    mesh = mesh_of(stages=2, data=2)
    params, batch = md.make(2, rows=16, ragged=True)
    mask = np.asarray(batch["mask"]).copy()
    mask[1:8:4] = 0.0  # micro-batch 1's rows on data shard 0
    batch = {**batch, "mask": jnp.asarray(mask)}
    want = jax.jit(jax.value_and_grad(md.sequential))(params, batch)
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    got = run(mesh, params, batch, 4, weight_fn=md.weight_fn, data_axes="data")
    md.assert_close(got, want, rtol=1e-5)


def sqrt_stage(sp, h):
    return h + jnp.sqrt(jnp.abs(h @ sp["w"]))


def log_stage(sp, h):
    return jnp.log(jnp.abs(h) + jnp.abs(h @ sp["w"])) * 0.1 + h


def l2_stage(sp, h):
    y = h + jnp.tanh(h @ sp["w"])
    return y / jnp.linalg.norm(y, axis=-1, keepdims=True)


BUBBLE_CASES = [
    (f, *sch) for f in (sqrt_stage, log_stage, l2_stage) for sch in SCHEDULES
]


@pytest.mark.parametrize(
    "stage_fn,schedule,repeats",
    sweep(BUBBLE_CASES, fast=[(sqrt_stage, "gpipe", 1), (l2_stage, "circular", 2)]),
)
def test_bubbles_compute_nothing(stage_fn, schedule, repeats, monkeypatch):
    """Issue 28 (2): stages with an infinite slope at 0 gave NaN gradients
    under GPipe and circular; with NaN in every bubble too."""
    monkeypatch.setattr(_step, "BUBBLE_FILL", float("nan"))
    params, batch = md.make(4 * repeats, rows=16)
    fns = (md.first_fn, stage_fn, md.loss_fn)
    want = jax.jit(
        jax.value_and_grad(lambda p, b: md.sequential(p, b, stage_fn=stage_fn))
    )(params, batch)
    got = run(mesh_of(), params, batch, 4, fns=fns, schedule=schedule,
              repeats=repeats)  # fmt: skip
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(got))
    md.assert_close(got, want, rtol=1e-4)


@pytest.mark.parametrize("schedule,repeats", sweep(SCHEDULES, fast=[("1f1b", 1)]))
def test_bf16_gradients_sum_in_float32(schedule, repeats):
    """Issue 28 (3): bf16 parameters at M = 1024: main summed in bf16
    (relative gradient error 0.13 for GPipe, 0.14 for 1F1B); summed in
    float32 it is 0.0037, the error of bf16 compute, as the loss face's."""
    m = 1024
    # The same 4-stage model for every schedule (2 devices with 2 repeats):
    # 8 bf16 stages alone have an error of 0.016.
    params, batch = md.make(4, rows=m)
    bf = jax.tree.map(lambda v: v.astype(jnp.bfloat16), params)
    want = jax.jit(jax.value_and_grad(md.sequential))(params, batch)[1]
    mesh = mesh_of(stages=4 // repeats)
    got = run(mesh, bf, batch, m, schedule=schedule, repeats=repeats)
    assert jax.tree.map(lambda g: g.dtype, got[1]) == jax.tree.map(
        lambda g: g.dtype, bf
    )
    assert got[0].dtype == jnp.float32  # the loss in its own dtype
    assert md.max_rel_error(got[1], want) < 0.01
    face = loop_face(bf, batch, m)[1]
    assert md.max_rel_error(got[1], face) < 0.01


@pytest.mark.parametrize("schedule,repeats", sweep(SCHEDULES, fast=[("1f1b", 1)]))
def test_x64(schedule, repeats):
    """Issue 28 (4): under x64 every schedule crashed; the loss is float64."""
    with jax.enable_x64(True):
        params, batch = md.make(4 * repeats, rows=16)
        params, batch = jax.tree.map(lambda v: v.astype(jnp.float64), (params, batch))
        want = jax.jit(jax.value_and_grad(md.sequential))(params, batch)
        got = run(mesh_of(), params, batch, 4, schedule=schedule, repeats=repeats)
        assert got[0].dtype == jnp.float64
        md.assert_close(got, want, rtol=1e-12)


@pytest.mark.parametrize("schedule,repeats", sweep(SCHEDULES, fast=[("1f1b", 1)]))
def test_feeds_accumulate_and_multisteps(schedule, repeats):
    """Issue 28 (5): unplaced parameters' gradients came back P('stage') and
    `accumulate`, `MultiSteps` and ``optax.MultiSteps`` refused them."""
    params, batch = md.make(4 * repeats, rows=16)
    mesh = mesh_of()
    vg = pl.value_and_grad(md.first_fn, md.stage_fn, md.loss_fn, 4,
                           schedule=schedule, repeats=repeats)  # fmt: skip
    for tx in (
        optax_accum.accumulate(optax.adamw(1e-3), 2),
        optax_accum.MultiSteps(optax.adamw(1e-3), 2),
        optax.MultiSteps(optax.adamw(1e-3), 2),
    ):
        with jax.set_mesh(mesh):

            @jax.jit
            def step(params, state, batch, tx=tx):
                _, grads = vg(params, batch)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state, grads

            state = tx.init(params)
            _, state, grads = step(params, state, batch)
            _ = grads[1]["w"][0]
        for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=True):
            assert g.sharding.spec == P() or g.sharding.is_fully_replicated, p


@pytest.mark.slow
@pytest.mark.parametrize("schedule,repeats", SCHEDULES)
def test_placed_stage_parameters_keep_their_sharding(schedule, repeats):
    mesh = mesh_of()
    params, batch = md.make(4 * repeats, rows=16)
    with jax.set_mesh(mesh):
        sp = jax.device_put(params[1], NamedSharding(mesh, P("stage")))
    got = run(mesh, (params[0], sp, params[2]), batch, 4, schedule=schedule,
              repeats=repeats)  # fmt: skip
    assert got[1][1]["w"].sharding.is_equivalent_to(sp["w"].sharding, 3)


def shard_reference(params, batch, key, m, data):
    """Data shard ``d`` holds rows ``d·B/D ...``; its micro-batch ``i`` at
    stage ``j`` draws with ``fold_in(fold_in(fold_in(key, i), d), j)`` (the
    key `microbatch` gives micro-batch ``i`` on device ``d``, folded with the
    stage); loss and aux are the mean over shards and micro-batches."""
    from tests.pipeline import test_exact as tx

    fp, sp, lp = params
    stages = sp["w"].shape[0]
    rows = batch["x"].shape[0] // data
    fold = lambda i, d, j: jax.random.fold_in(
        jax.random.fold_in(jax.random.fold_in(key, i), d), j
    )
    losses, auxs = [], []
    for d in range(data):
        part = jax.tree.map(lambda v, d=d: v[d * rows : (d + 1) * rows], batch)
        for i in range(m):
            mb = jax.tree.map(lambda v, i=i: v[i::m], part)
            h = md.first_fn(fp, mb)
            for j in range(stages):
                h = tx.dropout_stage(md.stage(sp, j), h, fold(i, d, j))
            loss, aux = tx.noisy_loss(lp, h, mb, fold(i, d, stages))
            losses.append(loss)
            auxs.append(aux)
    n = data * m
    per_mb = [jax.tree.map(lambda *a: sum(a) / data, *auxs[i::m]) for i in range(m)]
    return sum(losses) / n, jax.tree.map(lambda *a: jnp.stack(a), *per_mb)


@pytest.mark.parametrize("schedule,repeats", sweep(SCHEDULES, fast=[("1f1b", 1)]))
def test_rng_per_data_shard_and_aux(schedule, repeats):
    """Issue 28 (7): every data shard drew the same key, and ``has_aux`` with
    data shards was refused. Shard ``d`` now folds its index in; aux
    statistics average over the shards, as `microbatch`'s ``aux_rows``."""
    from tests.pipeline import test_exact as tx

    mesh = mesh_of(data=2)
    params, batch = md.make(4 * repeats, rows=32)
    key = jax.random.key(3)
    ref = jax.jit(
        jax.value_and_grad(shard_reference, has_aux=True), static_argnums=(3, 4)
    )
    want = ref(params, batch, key, 4, 2)
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    fns = (md.first_fn, tx.dropout_stage, tx.noisy_loss)
    got = run(mesh, params, batch, 4, fns=fns, rng=key, schedule=schedule,
              repeats=repeats, has_aux=True, data_axes="data")  # fmt: skip
    md.assert_close(got, want, rtol=1e-5)


def rows_loss(lp, h, batch):
    err = jnp.sum((h @ lp["w"] - batch["y"]) ** 2, axis=-1)
    return jnp.mean(err), {"err": err, "big": jnp.any(err > 1e9), "n": jnp.int32(1)}


@pytest.mark.parametrize("schedule,repeats", sweep(SCHEDULES, fast=[("gpipe", 1)]))
def test_aux_rows_over_data_shards(schedule, repeats):
    """Row-wise aux leaves are gathered over data shards (declared with
    ``aux_rows``); bool stays bool; undeclared row-length leaves raise."""
    mesh = mesh_of(data=2)
    params, batch = md.make(4 * repeats, rows=32)
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    fns = (md.first_fn, md.stage_fn, rows_loss)
    rows = {"err": True, "big": False, "n": False}
    kw = {"schedule": schedule, "repeats": repeats}
    (_, aux), _ = run(mesh, params, sharded, 4, fns=fns, has_aux=True,
                      data_axes="data", aux_rows=rows, **kw)  # fmt: skip
    assert aux["err"].shape == (4, 8) and aux["big"].dtype == jnp.bool_
    assert aux["n"].dtype == jnp.int32 and int(aux["n"][0]) == 2
    (_, plain), _ = run(mesh_of(), params, batch, 4, fns=fns, has_aux=True, **kw)
    np.testing.assert_allclose(aux["err"], plain["err"], rtol=1e-5)
    assert plain["big"].dtype == jnp.bool_
    with pytest.raises(ValueError, match="`aux_rows`"):
        run(mesh, params, sharded, 4, fns=fns, has_aux=True, data_axes="data", **kw)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,repeats", SCHEDULES)
def test_reduction_sum_and_accumulator_dtype(schedule, repeats):
    params, batch = md.make(4 * repeats, rows=16)
    kw = {"schedule": schedule, "repeats": repeats}
    want = loop_face(params, batch, 4, reduction="sum")
    got = run(mesh_of(), params, batch, 4, reduction="sum", **kw)
    md.assert_close(got, want, rtol=1e-5)
    wsum = loop_face(params, batch, 4, reduction="sum", weight_fn=md.weight_fn)
    got = run(mesh_of(), params, batch, 4, reduction="sum", weight_fn=md.weight_fn,
              **kw)  # fmt: skip
    md.assert_close(got, wsum, rtol=1e-5)
    got = run(mesh_of(), params, batch, 4, accumulator_dtype=None, **kw)
    md.assert_close(got, loop_face(params, batch, 4), rtol=1e-5)
    with pytest.raises(TypeError, match="`accumulator_dtype`"):
        pl.value_and_grad(md.first_fn, md.stage_fn, md.loss_fn, 4,
                          accumulator_dtype=jnp.int32)  # fmt: skip
    with pytest.raises(ValueError, match="`reduction`"):
        pl.value_and_grad(md.first_fn, md.stage_fn, md.loss_fn, 4, reduction="max")


def test_data_axes_declared_not_guessed():
    """Issue 27: the data axes are declared, never guessed: a batch sharded
    over an undeclared axis is refused with the fix."""
    mesh = mesh_of(data=2)
    params, batch = md.make(4, rows=32)
    want = jax.jit(jax.value_and_grad(md.sequential))(params, batch)
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    md.assert_close(run(mesh, params, batch, 4, data_axes="data"), want, rtol=1e-5)
    with pytest.raises(ValueError, match=r"pass `data_axes=\('data',\)`"):
        run(mesh, params, batch, 4)
    with pytest.raises(ValueError, match=r"`data_axes`=.*not axes"):
        run(mesh, params, batch, 4, data_axes="batch")


def aux_token_mean_loss(lp, h, batch):
    return token_mean_loss(lp, h, batch), {"tokens": jnp.sum(batch["mask"])}


@pytest.mark.parametrize("schedule,repeats", sweep(SCHEDULES, fast=[("1f1b", 1)]))
def test_padding_microbatch_still_gives_its_aux(schedule, repeats, monkeypatch):
    """With ``has_aux`` a weight-0 micro-batch's slots run on frozen inputs:
    its aux comes back (as on the other faces), and nothing of it reaches the
    loss or a gradient, with NaN in the bubbles and a stage whose slope is
    infinite at 0."""
    monkeypatch.setattr(_step, "BUBBLE_FILL", float("nan"))
    params = md.make(4 * repeats, rows=16)[0]
    _, batch = masked(16, 4, padding=1)
    seq = lambda p, b: md.sequential(p, b, stage_fn=sqrt_stage, loss_fn=token_mean_loss)
    want = jax.jit(jax.value_and_grad(seq))(params, batch)
    fns = (md.first_fn, sqrt_stage, aux_token_mean_loss)
    (value, aux), grads = run(mesh_of(), params, batch, 4, fns=fns,
                              schedule=schedule, repeats=repeats, has_aux=True,
                              weight_fn=md.weight_fn)  # fmt: skip
    md.assert_close((value, grads), want, rtol=1e-4)
    counts = [float(jnp.sum(batch["mask"][i::4])) for i in range(4)]
    np.testing.assert_allclose(aux["tokens"], counts)
    assert counts[1] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("schedule,repeats", SCHEDULES)
def test_bf16_sums_on_a_mesh_with_other_axes(schedule, repeats):
    """bf16 gradient sums (``accumulator_dtype=None``) on a mesh with an axis
    besides the stage axis: XLA's CPU compiler aborted the process on main
    ("Invalid binary instruction opcode copy") in the partly manual loop."""
    mesh = mesh_of(data=2)
    params, batch = md.make(4 * repeats, rows=16)
    bf = jax.tree.map(lambda v: v.astype(jnp.bfloat16), params)
    want = jax.jit(jax.value_and_grad(md.sequential))(params, batch)
    got = run(mesh, bf, batch, 4, accumulator_dtype=None, schedule=schedule,
              repeats=repeats)  # fmt: skip
    assert got[1][1]["w"].dtype == jnp.bfloat16
    assert md.max_rel_error(got[1], want[1]) < 0.05
