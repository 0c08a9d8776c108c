# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`pipeline.value_and_grad` equals the sequential model's ``jax.value_and_grad``.

fp32 at rtol 1e-5 over S in {2, 4, 8}, M in {S, 2S, 8S} and each schedule
(the full matrix is slow; the fast lane runs S = 4, M = 8); on a (data 2,
stage 4) mesh; with token weights; with bf16 stage compute; with ``rng``
and ``has_aux``; with NaN in every bubble slot; and inside `accumulate`.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import pipeline as pl
from optax_accum.pipeline import _step
from tests.pipeline import models as md

FAST = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("circular", 4, 8, 2)]
MATRIX = [
    (sch, s, m, r)
    for s in (2, 4, 8)
    for m in (s, 2 * s, 8 * s)
    for sch, r in (("gpipe", 1), ("1f1b", 1), ("circular", 1), ("circular", 2))
    if (sch, s, m, r) not in FAST
]


def stage_mesh(stages, data=1):
    if data == 1:
        return jax.make_mesh((stages,), ("stage",), devices=jax.devices()[:stages])
    devices = jax.devices()[: data * stages]
    return jax.make_mesh((data, stages), ("data", "stage"), devices=devices)


def pipelined(mesh, params, batch, m, **kw):
    fns = kw.pop("fns", (md.first_fn, md.stage_fn, md.loss_fn))
    rng = kw.pop("rng", None)
    with jax.set_mesh(mesh):
        vg = pl.value_and_grad(*fns, m, **kw)
        return jax.jit(vg)(params, batch, rng)


@functools.cache
def reference(num_stages, rows):
    """The sequential model's value and gradients (shared across schedules)."""
    params, batch = md.make(num_stages, rows=rows)
    return params, batch, jax.jit(jax.value_and_grad(md.sequential))(params, batch)


def check_exact(schedule, stages, m, repeats):
    params, batch, want = reference(stages * repeats, 2 * m)
    got = pipelined(
        stage_mesh(stages), params, batch, m, schedule=schedule, repeats=repeats
    )
    md.assert_close(got, want, rtol=1e-5)


@pytest.mark.parametrize("schedule,stages,m,repeats", FAST)
def test_exact(schedule, stages, m, repeats):
    check_exact(schedule, stages, m, repeats)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,stages,m,repeats", MATRIX)
def test_exact_matrix(schedule, stages, m, repeats):
    check_exact(schedule, stages, m, repeats)


def check_data_mesh(schedule, weighted):
    """A (data 2, stage 4) mesh, the batch's rows sharded over ``data``."""
    mesh = stage_mesh(4, data=2)
    repeats = 2 if schedule == "circular" else 1
    params, batch = md.make(4 * repeats, rows=32, ragged=weighted)
    want = jax.jit(jax.value_and_grad(md.sequential))(params, batch)
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    kw = {"weight_fn": md.weight_fn} if weighted else {}
    kw["data_axes"] = "data"
    got = pipelined(mesh, params, batch, 8, schedule=schedule, repeats=repeats, **kw)
    md.assert_close(got, want, rtol=1e-5)


def test_data_mesh_weighted():
    check_data_mesh("1f1b", weighted=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,weighted",
    [
        c
        for c in itertools.product(("gpipe", "circular", "1f1b"), (False, True))
        if c != ("1f1b", True)
    ],
)
def test_data_mesh(schedule, weighted):
    check_data_mesh(schedule, weighted)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b"])  # GPipe's: test_data_mesh
def test_token_weights(schedule):
    """Unequal token counts per micro-batch: the exact token mean."""
    params, batch = md.make(4, rows=32, ragged=True)
    want = jax.jit(jax.value_and_grad(md.sequential))(params, batch)
    got = pipelined(
        stage_mesh(4), params, batch, 8, schedule=schedule, weight_fn=md.weight_fn
    )
    md.assert_close(got, want, rtol=1e-5)
    # Without weights, each micro-batch weighs the same: another number.
    plain = pipelined(stage_mesh(4), params, batch, 8, schedule=schedule)
    assert abs(float(plain[0]) - float(want[0])) > 1e-3


def first_bf16(fp, batch):
    return md.first_fn(fp, batch).astype(jnp.bfloat16)


def stage_bf16(sp, h):
    sp = jax.tree.map(lambda v: v.astype(jnp.bfloat16), sp)
    return h + jnp.tanh(h @ sp["w"] + sp["b"])


def loss_f32(lp, h, batch):
    return md.loss_fn(lp, h.astype(jnp.float32), batch)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bf16_stages(schedule):
    fns = (first_bf16, stage_bf16, loss_f32)
    params, batch = md.make(4, rows=32)
    want = jax.jit(
        jax.value_and_grad(
            lambda p, b: md.sequential(p, b, *fns[1:2], first_fn=fns[0], loss_fn=fns[2])
        )
    )(params, batch)
    got = pipelined(stage_mesh(4), params, batch, 8, schedule=schedule, fns=fns)
    assert jax.tree.map(lambda g: g.dtype, got) == jax.tree.map(lambda g: g.dtype, want)
    md.assert_close(got, want, rtol=2e-2)


@pytest.mark.parametrize(
    "schedule",
    [
        "1f1b",
        pytest.param("gpipe", marks=pytest.mark.slow),
        pytest.param("circular", marks=pytest.mark.slow),
    ],
)
def test_nan_in_bubbles(schedule, monkeypatch):
    """Every idle slot sends NaN and every buffer starts as NaN."""
    monkeypatch.setattr(_step, "BUBBLE_FILL", float("nan"))
    params, batch = md.make(4, rows=16)
    want = jax.jit(jax.value_and_grad(md.sequential))(params, batch)
    got = pipelined(stage_mesh(4), params, batch, 4, schedule=schedule)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(got))
    md.assert_close(got, want, rtol=1e-5)


def dropout_stage(sp, h, key):
    keep = jax.random.bernoulli(key, 0.75, h.shape)
    return h + jnp.where(keep, jnp.tanh(h @ sp["w"] + sp["b"]) / 0.75, 0.0)


def noisy_loss(lp, h, batch, key):
    loss = md.loss_fn(lp, h, batch)
    return loss * (1.0 + 0.1 * jax.random.uniform(key)), {"loss": loss}


def per_microbatch_reference(params, batch, key, m):
    """The mean over micro-batches (rows i, i+m, ...) with the folded keys."""
    fp, sp, lp = params
    stages = sp["w"].shape[0]
    losses, auxs = [], []
    for i in range(m):
        mb = jax.tree.map(lambda v, i=i: v[i::m], batch)
        h = md.first_fn(fp, mb)
        for j in range(stages):
            h = dropout_stage(md.stage(sp, j), h, pl_fold(key, i, j))
        loss, aux = noisy_loss(lp, h, mb, pl_fold(key, i, stages))
        losses.append(loss)
        auxs.append(aux)
    return sum(losses) / m, jax.tree.map(lambda *a: jnp.stack(a), *auxs)


def pl_fold(key, m, j):
    return jax.random.fold_in(jax.random.fold_in(key, m), j)


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,repeats",
    [("1f1b", 1), ("gpipe", 1), ("zb_h1", 1), ("interleaved_1f1b", 2)],
)
def test_rng_and_aux(schedule, repeats):
    """Stage ``j = r·S + s`` of micro-batch ``m`` draws ``fold(key, m, j)``."""
    params, batch = md.make(4 * repeats, rows=16)
    key = jax.random.key(7)
    ref = jax.jit(
        jax.value_and_grad(per_microbatch_reference, has_aux=True), static_argnums=3
    )
    want = ref(params, batch, key, 4)
    fns = (md.first_fn, dropout_stage, noisy_loss)
    got = pipelined(
        stage_mesh(4),
        params,
        batch,
        4,
        schedule=schedule,
        repeats=repeats,
        fns=fns,
        has_aux=True,
        rng=key,
    )
    md.assert_close(got, want, rtol=1e-5)
    assert got[0][1]["loss"].shape == (4,)


@pytest.mark.slow
def test_inside_accumulate():
    """k calls fed to `accumulate` equal one call with k·M micro-batches."""
    k, m = 3, 4
    params, batch = md.make(4, rows=2 * k * m)
    mesh = stage_mesh(4)
    tx = optax_accum.accumulate(optax.sgd(0.1), k)
    state = tx.init(params)
    with jax.set_mesh(mesh):
        vg = jax.jit(
            pl.value_and_grad(md.first_fn, md.stage_fn, md.loss_fn, m, schedule="1f1b")
        )
        big = jax.jit(
            pl.value_and_grad(
                md.first_fn, md.stage_fn, md.loss_fn, k * m, schedule="1f1b"
            )
        )
        _, g_big = big(params, batch)
        for i in range(k):
            rows = slice(i * 2 * m, (i + 1) * 2 * m)
            part = jax.tree.map(lambda v, rows=rows: v[rows], batch)
            _, g = vg(params, part)
            updates, state = tx.update(g, state, params)
    want, _ = optax.sgd(0.1).update(g_big, optax.sgd(0.1).init(params), params)
    md.assert_close(updates, want, rtol=1e-5)
    assert bool(optax_accum.has_updated(state))


@pytest.mark.slow
def test_sharded_parameters():
    """Parameters sharded over ``data`` (FSDP) and the stages over ``stage``:
    gathered before the loop, gradients sharded like them after it."""
    mesh = stage_mesh(4, data=2)
    params, batch = md.make(4, rows=32)
    want = jax.jit(jax.value_and_grad(md.sequential))(params, batch)
    fp, sp, lp = params
    with jax.set_mesh(mesh):
        fp = jax.device_put(fp, NamedSharding(mesh, P(None, "data")))
        sp = {
            "w": jax.device_put(sp["w"], NamedSharding(mesh, P("stage", None, "data"))),
            "b": jax.device_put(sp["b"], NamedSharding(mesh, P("stage"))),
        }
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    got = pipelined(mesh, (fp, sp, lp), batch, 8, schedule="1f1b", data_axes="data")
    md.assert_close(got, want, rtol=1e-5)
    assert got[1][1]["w"].sharding.spec == P("stage", None, "data")
    assert got[1][0]["w"].sharding.spec == P(None, "data")
