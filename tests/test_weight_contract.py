# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""One weight contract for both faces, `accumulate` and `microbatch`.

Weight 0 contributes nothing; a NaN, infinite or negative weight rejects its
micro-batch and leaves the rest of the window as if it were absent; any finite
positive weight is honoured, however large; a constant that does not fit the
weight dtype raises (a Python or NumPy number, or an eager jax.Array), while
a traced bad weight cannot raise and rejects its micro-batch. Each case is
checked against a hand-computed value, on one device, per device under
``axis_name`` and in the device-local loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import optax_accum

VALUES = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
NAN = float("nan")


def _accumulate_mean(values, weights, every_k=4):
    """The update of SGD(1) on the boundary of one window of ``accumulate``."""
    tx = optax_accum.accumulate(optax.sgd(1.0), every_k)
    params = jnp.zeros(np.shape(values[0]))
    state = tx.init(params)
    step = jax.jit(lambda g, s, w: tx.update(g, s, params, weight=w))
    for g, w in zip(values, weights, strict=True):
        updates, state = step(jnp.asarray(g), state, jnp.float32(w))
    return -np.asarray(updates), state


def _microbatch_mean(values, weights):
    """`microbatch` over one micro-batch per value; its gradient is the value."""
    batch = {"v": jnp.asarray(values), "w": jnp.asarray(weights, jnp.float32)}

    def loss(p, b):
        return jnp.sum(p * b["v"])

    fun = optax_accum.microbatch(
        jax.value_and_grad(loss), len(values), weight_fn=lambda b: b["w"][0]
    )
    return np.asarray(jax.jit(fun)(jnp.float32(0.0), batch)[1])


@pytest.mark.parametrize(
    "weights, expected",
    [
        ([1.0, NAN, 1.0, 1.0], (1 + 3 + 4) / 3),
        ([1.0, -1.0, 1.0, 1.0], (1 + 3 + 4) / 3),
        ([1.0, float("inf"), 1.0, 1.0], (1 + 3 + 4) / 3),
        ([1.0, 0.0, 1.0, 1.0], (1 + 3 + 4) / 3),
        ([2.0, 0.0, 0.0, 1.0], (2 * 1 + 4) / 3),
    ],
)
def test_bad_weights_reject_only_their_micro_batch(weights, expected):
    # A rejected micro-batch does not count towards `accumulate`'s window.
    bad = sum(1 for w in weights if not (np.isfinite(w) and w >= 0))
    acc, state = _accumulate_mean(VALUES, weights, every_k=len(weights) - bad)
    np.testing.assert_allclose(acc, expected, rtol=1e-6)
    assert int(state.num_skipped) == bad and bool(state.updated)
    np.testing.assert_allclose(_microbatch_mean(VALUES, weights), expected, rtol=1e-6)


def test_huge_weights_are_honoured_not_overflowed():
    grads = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    acc, _ = _accumulate_mean(grads, [1e38, 3e38], every_k=2)
    np.testing.assert_allclose(acc, [2.5, 3.5], rtol=1e-6)
    mb = _microbatch_mean(np.array([1.0, 3.0], np.float32), [1e38, 3e38])
    np.testing.assert_allclose(mb, 2.5, rtol=1e-6)


BAD = "`weight` must be finite and >= 0"


@pytest.mark.parametrize(
    "weight, match",
    [
        (1e39, "`weight`"),
        (1e-40, "`weight`"),
        (-1.0, BAD),
        (float("nan"), BAD),
        (np.float32(np.inf), BAD),  # a NumPy scalar, as a Python float
    ],
)
def test_constant_weights_that_do_not_fit_float32_raise(weight, match):
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    params = jnp.zeros(2)
    state = tx.init(params)
    with pytest.raises(ValueError, match=match):
        tx.update(jnp.ones(2), state, params, weight=weight)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -1.0])
def test_bad_traced_weight_rejects_the_micro_batch(bad):
    # A traced bad weight cannot raise: it rejects its micro-batch, which
    # counts as skipped, emits nothing and leaves the window as if never seen.
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    update = jax.jit(tx.update)
    params = {"a": jnp.zeros([])}
    state = tx.init(params)
    u, state = update({"a": jnp.float32(1.0)}, state, params, weight=1.0)
    u, state = update({"a": jnp.float32(5.0)}, state, params, weight=bad)
    assert float(u["a"]) == 0.0 and not optax_accum.has_updated(state)
    u, state = update({"a": jnp.float32(3.0)}, state, params, weight=1.0)
    assert float(u["a"]) == -2.0  # the mean of 1 and 3
    assert int(state.num_skipped) == 1


@pytest.mark.parametrize("bad", [-1.0, np.nan, 1e39, 1e-40])
def test_concrete_jax_array_bad_weight_raises_like_a_constant(bad):
    # Eagerly, a jax.Array's value is known: it raises as the Python value
    # does (jnp.float32(1e39) is inf). Under jit it is traced and rejected.
    with np.errstate(over="ignore"):
        bad = jnp.float32(bad)
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    params = {"a": jnp.zeros([])}
    state = tx.init(params)
    with pytest.raises(ValueError, match="`weight`"):
        tx.update({"a": jnp.float32(1.0)}, state, params, weight=bad)
    _, state = jax.jit(tx.update)({"a": jnp.float32(1.0)}, state, params, weight=bad)
    # A traced subnormal weight is flushed to 0: weight 0, not a rejection.
    assert int(state.num_skipped) == (0 if 0 < float(bad) < 1e-38 else 1)


def test_concrete_float64_weight_that_overflows_float32_raises():
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    params = {"a": jnp.zeros([])}
    with jax.enable_x64(True):
        state = tx.init(params)
        with pytest.raises(ValueError, match="overflows float32"):
            tx.update(params, state, params, weight=jnp.asarray(1e39, jnp.float64))


def test_largest_and_smallest_normal_weights_are_accepted():
    info = np.finfo(np.float32)
    acc, _ = _accumulate_mean(VALUES[:2], [float(info.max), float(info.max)], 2)
    np.testing.assert_allclose(acc, 1.5, rtol=1e-6)
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    state = tx.init(jnp.zeros(()))
    tx.update(jnp.ones(()), state, jnp.zeros(()), weight=float(info.smallest_normal))


def test_rejected_micro_batch_with_close_window_still_closes_it():
    tx = optax_accum.accumulate(optax.sgd(1.0), 4)
    params = jnp.zeros(())
    state = tx.init(params)
    for g in (1.0, 3.0):
        _, state = tx.update(jnp.float32(g), state, params)
    updates, state = jax.jit(tx.update)(  # traced: a bad weight is rejected
        jnp.float32(100.0), state, params, weight=jnp.float32(NAN), close_window=True
    )
    assert bool(state.updated) and int(state.num_skipped) == 1
    np.testing.assert_allclose(-updates, 2.0)  # the mean of what was accepted
    assert int(state.micro_step) == 0


def test_rejected_micro_batch_with_close_window_on_an_empty_window_does_nothing():
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    params = jnp.zeros(())
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(
        jnp.float32(5.0), state, params, weight=jnp.float32(-1), close_window=True
    )
    assert not bool(state.updated) and float(updates) == 0.0
    assert int(state.update_step) == 0


def _mesh(n):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def test_bad_weight_on_one_device_leaves_the_others_alone_with_axis_name():
    # Two devices, one micro-batch each per call, two calls per window.
    grads = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)  # [call, device]
    weights = np.array([[1.0, NAN], [2.0, 1.0]], np.float32)
    tx = optax_accum.accumulate(optax.sgd(1.0), 2, axis_name="d")
    params = jnp.zeros((2,))
    state = jax.pmap(tx.init, axis_name="d")(params)
    step = jax.pmap(
        lambda g, s, w: tx.update(g, s, jnp.zeros(()), weight=w), axis_name="d"
    )
    for call in range(2):
        updates, state = step(
            jnp.asarray(grads[call]), state, jnp.asarray(weights[call])
        )
    # Device 1's NaN weight drops only its own first micro-batch.
    expected = (1 * 1 + 2 * 3 + 1 * 4) / (1 + 2 + 1)
    np.testing.assert_allclose(-np.asarray(updates), [expected] * 2, rtol=1e-6)


def test_bad_weight_on_one_device_leaves_the_others_alone_device_local():
    mesh = _mesh(2)
    # Rows: device 0 holds rows 0-1, device 1 rows 2-3; k = 2 micro-batches
    # per device of one row each.
    v = jnp.asarray([1.0, 2.0, 3.0, 4.0])
    w = jnp.asarray([1.0, 2.0, NAN, 1.0])

    def loss(p, b):
        return jnp.sum(p * b["v"])

    fun = optax_accum.microbatch(
        jax.value_and_grad(loss), 2, weight_fn=lambda b: b["w"][0], data_axes="data"
    )
    with jax.set_mesh(mesh):
        batch = jax.device_put({"v": v, "w": w}, P("data"))
        _, g = jax.jit(fun)(jnp.float32(0.0), batch)
    expected = (1 * 1 + 2 * 2 + 1 * 4) / (1 + 2 + 1)
    np.testing.assert_allclose(float(g), expected, rtol=1e-6)
