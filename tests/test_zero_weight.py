# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Zero-weight (all-padding) micro-batches and windows contribute nothing.

A padding micro-batch's token-mean loss is 0 / 0 = NaN with weight 0: it must
not reach the window's mean, in `accumulate` or in `microbatch` (on one device
or in the device-local loop). A window of only such micro-batches does not
step the inner optimizer, on one device or on all of them.
"""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from tests.helpers.lanes import sweep

K = 4


def test_all_padding_window_does_not_step_the_inner_optimizer():
    tx = optax_accum.accumulate(optax.adam(0.1), 2)
    update = jax.jit(tx.update)
    params = {"a": jnp.zeros(2)}
    state = tx.init(params)
    for w in (1.0, 1.0):
        u, state = update({"a": jnp.ones(2)}, state, params, weight=w)
    inner_before = state.inner_state
    for w in (0.0, 0.0):
        u, state = update({"a": jnp.ones(2)}, state, params, weight=w)
    # Adam's momentum would still move the parameters on a zero gradient.
    np.testing.assert_array_equal(u["a"], 0.0)
    chex.assert_trees_all_equal(state.inner_state, inner_before)
    assert int(state.update_step) == 1 and not optax_accum.has_updated(state)
    assert int(state.micro_step) == 0  # the window closed


def test_all_padding_window_on_every_device_steps_nothing():
    n = 8
    tx = optax_accum.accumulate(optax.adam(0.1), 2, axis_name="d")
    params = {"a": jnp.zeros((n, 2))}
    state = jax.pmap(tx.init, axis_name="d")(params)
    update = jax.pmap(lambda g, s, p, w: tx.update(g, s, p, weight=w), axis_name="d")
    grads = {"a": jnp.ones((n, 2))}
    for w in (1.0, 1.0):
        u, state = update(grads, state, params, jnp.full(n, w))
    inner_before = state.inner_state
    for w in (0.0, 0.0):
        u, state = update(grads, state, params, jnp.full(n, w))
    np.testing.assert_array_equal(u["a"], 0.0)
    chex.assert_trees_all_equal(state.inner_state, inner_before)
    assert int(state.update_step[0]) == 1


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_zero_weight_nan_micro_batch_after_a_weighted_one(reduction):
    tx = optax_accum.accumulate(optax.sgd(1.0), 3, reduction=reduction)
    update = jax.jit(tx.update)
    params = {"a": jnp.zeros([])}
    state = tx.init(params)
    # An all-padding micro-batch: token mean 0/0 = NaN, weight 0.
    for g, w in [(2.0, 2.0), (jnp.nan, 0.0), (5.0, 1.0)]:
        u, state = update({"a": jnp.float32(g)}, state, params, weight=w)
    expected = (2 * 2 + 5) / 3 if reduction == "mean" else 2 * 2 + 5
    assert float(u["a"]) == pytest.approx(-expected)


@pytest.mark.parametrize(
    "skip_fn", [None, optax_accum.skip_not_finite, optax_accum.skip_large_updates(10)]
)
def test_zero_weight_nan_micro_batch_is_not_judged_by_skip_fn(skip_fn):
    # Weight 0 is no rejection: the padding micro-batch counts towards k, and
    # the window closes on the 4th call as without `skip_fn`.
    tx = optax_accum.accumulate(optax.sgd(1.0), 4, skip_fn=skip_fn)
    update = jax.jit(tx.update)
    params = {"a": jnp.zeros(2)}
    state = tx.init(params)
    for g, w in [(1.0, 3.0), (2.0, 1.0), (jnp.nan, 0.0), (4.0, 4.0)]:
        u, state = update({"a": jnp.full(2, g)}, state, params, weight=w)
    np.testing.assert_array_equal(u["a"], [-21 / 8, -21 / 8])  # -2.625
    assert optax_accum.has_updated(state) and int(state.num_skipped) == 0


def test_zero_weight_nan_device_is_not_judged_by_skip_fn_with_axis_name():
    n = 4
    tx = optax_accum.accumulate(
        optax.sgd(1.0), 2, axis_name="d", skip_fn=optax_accum.skip_not_finite
    )
    params = {"a": jnp.zeros((n, 2))}
    state = jax.pmap(tx.init, axis_name="d")(params)
    update = jax.pmap(lambda g, s, p, w: tx.update(g, s, p, weight=w), axis_name="d")
    g = np.ones((n, 2), np.float32)
    g[1] = np.nan  # device 1 holds only padding
    w = np.array([1.0, 0.0, 1.0, 1.0], np.float32)
    for _ in range(2):
        u, state = update({"a": jnp.asarray(g)}, state, params, jnp.asarray(w))
    np.testing.assert_array_equal(u["a"], -np.ones((n, 2)))
    np.testing.assert_array_equal(state.num_skipped, 0)


@pytest.mark.parametrize(
    ("position", "sharded"),
    sweep(itertools.product([0, 1, 3], [False, True]), fast=[(0, True), (3, False)]),
)
def test_microbatch_all_padding_micro_batch_contributes_nothing(position, sharded):
    def loss(w, batch):
        mask = batch["mask"]
        return jnp.sum(mask * (batch["x"] * w - 1.0) ** 2) / jnp.sum(mask)

    n = 64  # 16 rows per micro-batch: 2 per device when sharded over 8
    x = jnp.arange(1.0, n + 1.0) / n
    mask = jnp.ones(n).at[position::K].set(0.0)  # micro-batch `position`: padding
    batch = {"x": x, "mask": mask}
    ref_value, ref_grad = jax.value_and_grad(loss)(jnp.float32(0.5), batch)
    fun = optax_accum.microbatch(
        jax.value_and_grad(loss),
        K,
        weight_fn=lambda b: b["mask"].sum(),
        data_axes=None,
    )
    if sharded:  # the device-local loop: each device's part is all padding
        mesh = jax.make_mesh((8,), ("data",))
        batch = jax.device_put(batch, jax.NamedSharding(mesh, jax.P("data")))
        with jax.set_mesh(mesh):
            value, grad = jax.jit(fun)(jnp.float32(0.5), batch)
    else:
        value, grad = jax.jit(fun)(jnp.float32(0.5), batch)
    np.testing.assert_allclose([value, grad], [ref_value, ref_grad], rtol=1e-5)
