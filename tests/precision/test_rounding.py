# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Low and high precision at the edges, for both faces.

fp16 buffers must not overflow on a mean that fits; float64 and complex128
windows must be float64-accurate; the default accumulator keeps low-precision
gradients in float32 in both faces.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from tests.helpers.lanes import sweep


def _accumulate(grads, weights, **kwargs):
    tx = optax_accum.accumulate(optax.sgd(1.0), len(grads), **kwargs)
    params = jnp.zeros_like(grads[0])
    state = tx.init(params)
    step = jax.jit(lambda g, s, w: tx.update(g, s, params, weight=w))
    for g, w in zip(grads, weights, strict=True):
        updates, state = step(g, state, w)
    return -updates


def _microbatch(values, weights=None, **kwargs):
    """The mean gradient of ``sum(p * v)`` over micro-batches of one row."""

    def loss(p, b):
        return jnp.sum(p * b["v"][0]).astype(jnp.float32)

    batch = {"v": values}
    weight_fn = None
    if weights is not None:
        batch["w"] = jnp.asarray(weights, jnp.float32)
        weight_fn = lambda b: b["w"][0]
    fun = optax_accum.microbatch(
        jax.value_and_grad(loss), len(values), weight_fn=weight_fn, **kwargs
    )
    params = jnp.zeros(values.shape[1:], values.dtype)
    return jax.jit(fun)(params, batch)[1]


def test_fp16_weighted_mean_of_large_opposite_gradients_is_finite():
    # (40000 * 1 - 40000 * 3) / 4 = -20000 fits float16; g - a = -80000 does not.
    grads = jnp.array([[40000.0], [-40000.0]], jnp.float16)
    out = _accumulate(grads, [1.0, 3.0], accumulator_dtype=jnp.float16)
    assert out.dtype == jnp.float16
    np.testing.assert_allclose(np.float32(out[0]), -20000.0, rtol=1e-3)
    out = _microbatch(grads, [1.0, 3.0], accumulator_dtype=jnp.float16)
    np.testing.assert_allclose(np.float32(out[0]), -20000.0, rtol=1e-3)


def test_fp16_mean_of_many_micro_batches_does_not_overflow():
    # 1024 gradients of about 100 sum to 1e5 > 65504, though their mean fits.
    values = jnp.asarray(
        100 + np.random.default_rng(0).normal(size=(1024, 2)), jnp.float16
    )
    ref = np.asarray(values, np.float64).mean(0)
    out = _microbatch(values, accumulator_dtype=jnp.float16)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2e-3)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("k", "dtype"),
    sweep(
        itertools.product([3, 7], [jnp.float64, jnp.complex128]),
        fast=[(7, jnp.complex128)],
    ),
)
def test_float64_windows_are_float64_accurate(k, dtype):
    rng = np.random.default_rng(k)
    with jax.enable_x64(True):
        for _ in range(5):
            raw = rng.normal(size=(k, 5)) + (
                1j * rng.normal(size=(k, 5)) if dtype == jnp.complex128 else 0
            )
            grads = jnp.asarray(raw, dtype)
            ref = raw.mean(0)
            out = _accumulate(list(grads), [None] * k)
            assert out.dtype == dtype
            np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-13, atol=1e-15)
            weights = rng.integers(1, 100, size=k).astype(np.float64)
            out = _accumulate(list(grads), list(weights))
            ref_w = (weights[:, None] * raw).sum(0) / weights.sum()
            np.testing.assert_allclose(np.asarray(out), ref_w, rtol=1e-13, atol=1e-15)
            if dtype == jnp.float64:
                out = _microbatch(grads, weights)
                np.testing.assert_allclose(np.asarray(out), ref_w, rtol=1e-13)


@pytest.mark.parametrize("k", sweep([128, 1024], fast=[1024]))
def test_default_accumulator_keeps_bf16_gradients_in_float32(k):
    values = np.random.default_rng(1).normal(size=(k, 64)).astype(np.float32) + 1
    bf16 = jnp.asarray(values, jnp.bfloat16)
    ref = np.asarray(bf16, np.float64).mean(0)
    default = np.asarray(_microbatch(bf16), np.float64)
    low = np.asarray(_microbatch(bf16, accumulator_dtype=None), np.float64)
    err = lambda x: np.max(np.abs(x - ref) / np.abs(ref))
    # bf16 rounding of the result alone is 2**-9 = 0.002.
    assert err(default) < 0.005 < err(low)
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    assert tx.init(jnp.zeros(3, jnp.bfloat16)).accumulator.dtype == jnp.float32
    fun = optax_accum.microbatch(lambda p, x: (jnp.sum(x), p), 2)
    assert fun(jnp.zeros(3, jnp.bfloat16), jnp.zeros(4))[1].dtype == jnp.bfloat16
