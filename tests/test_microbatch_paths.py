# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`microbatch` gives one answer on every path (issue 20).

k = 1 and k > 1, the global view and the device-local mode, fp16 and bf16
buffers, float0 leaves, the value-and-grad face and the loss face: the same
inputs give the documented answer, computed here by hand or by the full
batch's `jax.value_and_grad`. Each test names the defect it guards.
"""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from tests.helpers.lanes import sweep


def _loss(w, x):
    return jnp.mean((x * w) ** 2)


def _vg_clipped(w, x):
    """A value-and-grad function that post-processes its gradients."""
    v, g = jax.value_and_grad(lambda w: _loss(w, x) + 0.5 * jnp.sum(w**2))(w)
    return v, jnp.clip(g, -1.0, 1.0)


def _close(a, b, rtol=1e-6):
    chex.assert_trees_all_close(a, b, rtol=rtol, atol=1e-6)


# --- Section 1: `fun`'s gradients are `fun`'s --------------------------------


@pytest.mark.parametrize("k", sweep([1, 2, 4], fast=[2]))
def test_value_and_grad_funs_own_gradients_are_weighted_after_it(k):
    x = jnp.arange(8.0)
    ws = lambda x: x[0] + 1.0
    fun = optax_accum.microbatch(_vg_clipped, k, weight_fn=ws)
    value, grad = fun(jnp.float32(1.0), x)
    views = np.asarray(x).reshape(8 // k, k).T  # micro-batch i: rows i, i+k
    outs = [_vg_clipped(jnp.float32(1.0), jnp.asarray(v)) for v in views]
    weights = np.array([v[0] + 1.0 for v in views])
    expected_g = (
        sum(w * float(g) for w, (_, g) in zip(weights, outs, strict=True))
        / weights.sum()
    )
    expected_v = (
        sum(w * float(v) for w, (v, _) in zip(weights, outs, strict=True))
        / weights.sum()
    )
    # Before: 43.0, the unclipped gradient of the weighted value.
    np.testing.assert_allclose(float(grad), expected_g, rtol=1e-6)
    np.testing.assert_allclose(float(value), expected_v, rtol=1e-6)
    assert float(grad) == 1.0


def _token_loss(w, x, m):
    return jnp.sum(((x * w) ** 2) * m) / jnp.maximum(jnp.sum(m), 1.0)


def _tokens(x, m):
    del x
    return jnp.sum(m)


def _token_batch():
    x = jnp.linspace(-2.0, 3.0, 24).reshape(12, 2)
    m = (jnp.arange(24).reshape(12, 2) % 3 != 0).astype(jnp.float32)
    return x, m


@pytest.mark.parametrize(
    ("k", "reduction"),
    sweep(itertools.product([1, 3, 4], ["mean", "sum"]), fast=[(3, "sum")]),
)
def test_loss_face_equals_value_and_grad_face_and_the_full_batch(k, reduction):
    x, m = _token_batch()
    w = jnp.array([0.5, -1.5])
    kw = dict(batch_argnums=(1, 2), weight_fn=_tokens, reduction=reduction)
    face = optax_accum.microbatch_value_and_grad(_token_loss, k, **kw)
    vg = optax_accum.microbatch(jax.value_and_grad(_token_loss), k, **kw)
    _close(face(w, x, m), vg(w, x, m), rtol=1e-5)
    if reduction == "mean":  # the token mean over the whole batch
        _close(face(w, x, m), jax.value_and_grad(_token_loss)(w, x, m), rtol=1e-5)


def test_loss_face_follows_value_and_grad_argnums_and_has_aux():
    def loss(a, x, b):
        return jnp.mean(x * a) + jnp.sum(b**2), {"n": jnp.sum(x)}

    x = jnp.arange(8.0)
    a, b = jnp.float32(2.0), jnp.ones(3)
    face = optax_accum.microbatch_value_and_grad(loss, 2, argnums=(0, 2), has_aux=True)
    (value, aux), grads = face(a, x, b)
    (ref_value, _), ref_grads = jax.value_and_grad(loss, (0, 2), has_aux=True)(a, x, b)
    assert isinstance(grads, tuple) and len(grads) == 2
    _close((value, grads), (ref_value, ref_grads))
    assert aux["n"].shape == (2,)


def test_loss_face_refuses_bad_input():
    with pytest.raises(ValueError, match="`argnums`"):
        optax_accum.microbatch_value_and_grad(_loss, 2, argnums=1)
    face = optax_accum.microbatch_value_and_grad(lambda w, x: x * w, 2)
    with pytest.raises(TypeError, match="real floating scalar"):
        face(jnp.float32(1.0), jnp.arange(4.0))
    face = optax_accum.microbatch_value_and_grad(lambda n, x: jnp.sum(x) * 1.0, 2)
    with pytest.raises(TypeError, match="floating"):
        face(jnp.int32(1), jnp.arange(4.0))


def test_weighting_after_fun_rounds_once_in_the_buffer():
    # bf16 gradients, token weights, k = 1024, float32 buffer: the value-and-grad
    # face casts to the buffer first, then weighs, so its error stays at the
    # unweighted path's (one rounding of the output, 2**-8 relative).
    k = 1024
    rng = np.random.default_rng(0)
    c = rng.uniform(0.5, 1.5, (k, 4)).astype(np.float32)
    tokens = rng.integers(1, 9, (k,)).astype(np.float32)

    def vg(w, c, t):
        del t
        return jnp.float32(0.0), (c[0] * w).astype(jnp.bfloat16)

    w = jnp.ones(4, jnp.bfloat16)
    cb = jnp.asarray(c).astype(jnp.bfloat16)
    exact = (np.asarray(cb, np.float64) * tokens[:, None]).sum(0) / tokens.sum()
    fun = optax_accum.microbatch(
        vg, k, batch_argnums=(1, 2), weight_fn=lambda c, t: t[0]
    )
    _, g = fun(w, cb, jnp.asarray(tokens))
    err = np.max(np.abs(np.asarray(g, np.float64) - exact) / exact)
    assert err <= 2.0**-8, err


# --- Defect 1: k = 1 applies the weights --------------------------------------


@pytest.mark.parametrize(
    ("weight", "reduction", "expected"),
    sweep(
        [
            (3.0, "sum", 3.0),
            (3.0, "mean", 1.0),
            (0.0, "mean", 0.0),
            (np.nan, "mean", 0.0),
        ],
        fast=[(3.0, "sum", 3.0), (0.0, "mean", 0.0)],
    ),
)
def test_k1_applies_the_weight_as_k2_does(weight, reduction, expected):
    x = jnp.arange(2.0)  # value 0.5, grad 1.0
    vg = jax.value_and_grad(_loss)
    for k, xs in ((1, x), (2, jnp.repeat(x, 2))):
        fun = optax_accum.microbatch(
            vg, k, reduction=reduction, weight_fn=lambda x: jnp.float32(weight)
        )
        value, grad = fun(jnp.float32(1.0), xs)
        scale = expected * (k if reduction == "sum" else 1)
        np.testing.assert_allclose(float(grad), scale, rtol=1e-6)
        np.testing.assert_allclose(float(value), 0.5 * scale, rtol=1e-6)


# --- Defect 8: an unweighted sum with `data_axes` ----------------------------


@pytest.mark.parametrize(
    ("k", "reduction"),
    sweep(itertools.product([1, 2], ["sum", "mean"]), fast=[(2, "sum")]),
)
def test_data_axes_sum_equals_the_global_view(k, reduction):
    mesh = jax.make_mesh((2,), ("data",))
    vg = jax.value_and_grad(_loss)
    x = jnp.arange(8.0)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        local = optax_accum.microbatch(vg, k, reduction=reduction, data_axes="data")
        glob = optax_accum.microbatch(vg, k, reduction=reduction)
        got, want = local(jnp.float32(1.0), xs), glob(jnp.float32(1.0), xs)
    _close(got, want)
    if reduction == "sum":  # sum over micro-batches of their means
        views = np.asarray(x).reshape(8 // k, k).T
        expected = sum(float(jax.grad(_loss)(1.0, jnp.asarray(v))) for v in views)
        np.testing.assert_allclose(float(got[1]), expected, rtol=1e-6)


# --- Defect 4: which aux leaves are rows is declared, not guessed ------------


def _aux_loss(w, x):
    # `feature` is a per-feature mean with as many entries as rows per device.
    v = jnp.mean((x * w) ** 2)
    return v, {"rows": x[:, 0] * w, "feature": jnp.mean(x, axis=0)}


@pytest.mark.slow
def test_device_local_aux_rows_are_declared_not_guessed():
    mesh = jax.make_mesh((2,), ("data",))
    vg = jax.value_and_grad(_aux_loss, has_aux=True)
    x = jnp.arange(16.0).reshape(8, 2)  # k=2: 4 rows a micro-batch, 2 per device
    glob = optax_accum.microbatch(vg, 2, has_aux=True)
    (_, ref), _ = glob(jnp.float32(1.0), x)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        undeclared = optax_accum.microbatch(vg, 2, has_aux=True, data_axes="data")
        with pytest.raises(ValueError, match=r"aux.*\['feature'\].*aux_rows"):
            undeclared(jnp.float32(1.0), xs)
        fun = optax_accum.microbatch(
            vg,
            2,
            has_aux=True,
            data_axes="data",
            aux_rows={"rows": True, "feature": False},
        )
        (_, aux), _ = fun(jnp.float32(1.0), xs)
    assert aux["feature"].shape == (2, 2)  # before: (2, 4), gathered
    _close(aux, ref)


def test_aux_rows_needs_has_aux_and_data_axes():
    vg = jax.value_and_grad(_aux_loss, has_aux=True)
    with pytest.raises(ValueError, match="`aux_rows`"):
        optax_accum.microbatch(vg, 2, has_aux=True, aux_rows=True)
    with pytest.raises(TypeError, match="`aux_rows`"):
        optax_accum.microbatch(vg, 2, has_aux=True, data_axes="d", aux_rows="yes")


# --- Defect 5: float0 gradients -------------------------------------------------


@pytest.mark.parametrize("k", sweep([1, 2, 4], fast=[2]))
def test_integer_parameters_pass_through_as_float0(k):
    def loss(p, x):
        return jnp.mean((x * p["w"]) ** 2) + 0.0 * p["n"]

    vg = jax.value_and_grad(loss, allow_int=True)
    p = {"w": jnp.float32(1.0), "n": jnp.int32(3)}
    x = jnp.arange(8.0)
    value, grads = jax.jit(optax_accum.microbatch(vg, k))(p, x)
    ref_value, ref_grads = vg(p, x)
    assert grads["n"].dtype == jax.dtypes.float0
    _close((value, grads["w"]), (ref_value, ref_grads["w"]))


def test_none_gradient_leaves_beside_float0_come_back():
    # Issue 27: Equinox's gradients hold None for non-arrays; putting the
    # float0 leaves back once zipped two uneven leaf lists and raised.
    def vg(p, x):
        loss = lambda p: jnp.mean((x * p["w"]) ** 2) + 0.0 * p["n"]
        value, grads = jax.value_and_grad(loss, allow_int=True)(p)
        return value, {**grads, "fn": None}

    p = {"w": jnp.float32(1.0), "n": jnp.int32(3)}
    x = jnp.arange(8.0)
    value, grads = jax.jit(optax_accum.microbatch(vg, 2))(p, x)
    ref_value, ref_grads = vg(p, x)
    assert grads["fn"] is None and grads["n"].dtype == jax.dtypes.float0
    _close((value, grads["w"]), (ref_value, ref_grads["w"]))


# --- Defect 12: the noise scale needs two micro-batches ----------------------


def test_noise_scale_at_k1_on_one_device_is_refused():
    with pytest.raises(ValueError, match=r"`noise_scale_decay`.*`num_microbatches`"):
        optax_accum.microbatch(jax.value_and_grad(_loss), 1, noise_scale_decay=0.9)
    optax_accum.microbatch(  # several devices supply the small batches
        jax.value_and_grad(_loss), 1, noise_scale_decay=0.9, axis_name="d"
    )


# --- Defect 14: one buffer dtype, one accuracy -------------------------------


@pytest.mark.parametrize("k", sweep([2, 64, 1024], fast=[1024]))
def test_bf16_buffer_keeps_a_running_mean_as_accumulate_does(k):
    # A bf16 buffer (accumulator_dtype=None, bf16 gradients): a plain sum lost
    # half the mean at k = 1024 (1 + 512 is 512 in bf16); the running mean,
    # as `accumulate` keeps it, stays within a few ulps on both faces.
    rng = np.random.default_rng(1)
    c = jnp.asarray(rng.uniform(0.5, 1.5, (k, 3)), jnp.bfloat16)

    def vg(w, c):
        return jnp.float32(0.0), c[0] * w

    w = jnp.ones(3, jnp.bfloat16)
    _, g = optax_accum.microbatch(vg, k, accumulator_dtype=None)(w, c)
    exact = np.asarray(c, np.float64).mean(0)
    tx = optax_accum.accumulate(optax.sgd(1.0), k, accumulator_dtype=None)
    state = tx.init(w)
    update = jax.jit(tx.update)  # k eager calls would take a minute
    for i in range(k):
        u, state = update(c[i] * w, state, w)
    ulp = 2.0**-7  # bf16's spacing in [1, 2)
    err_fused = np.max(np.abs(np.asarray(g, np.float64) - exact))
    err_acc = np.max(np.abs(-np.asarray(u, np.float64) - exact))
    assert err_fused <= 25 * ulp and err_acc <= 25 * ulp, (err_fused, err_acc)
    assert g.dtype == jnp.bfloat16


# --- Issue 23: a skipped fp16 step is not observed by the noise scale ------


def test_overflowed_step_is_not_observed_by_the_noise_scale():
    jmp = pytest.importorskip("jmp")

    def loss(w, x):
        return jnp.mean((x * w) ** 2)

    grad_fn = optax_accum.scaled_value_and_grad(loss)
    w = jnp.float16(1.0)
    x = jnp.linspace(0.5, 2.0, 16).astype(jnp.float16)

    def step(scale, tracker):
        ls = jmp.DynamicLossScale(jnp.float32(scale))
        fun = optax_accum.microbatch(
            lambda w, x: grad_fn(ls, w, x), 4, noise_scale_decay=0.5
        )
        return fun(w, x, noise_scale=tracker)

    out, tracker = step(2.0**4, None)
    assert bool(out.finite) and int(tracker.windows) == 1
    out, after = step(2.0**30, tracker)  # overflows in fp16: a skipped step
    assert not bool(out.finite)
    # Before: the NaN gradients entered the EMA and b_simple read 0.0 for good.
    assert int(after.windows) == 1
    chex.assert_trees_all_equal(
        optax_accum.noise_scale(after), optax_accum.noise_scale(tracker)
    )
    assert np.isfinite(float(optax_accum.noise_scale(after).b_simple))
