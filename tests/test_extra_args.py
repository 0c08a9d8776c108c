# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Optimizer extra args (``value``, ``grad``, ``value_fn``) over a window.

The inner optimizer sees the window's ``value``: the micro-batch values
accumulated with the same weights and reduction as the gradients, and reduced
over devices with ``axis_name``. ``reduce_on_plateau`` and L-BFGS under
accumulation then take the large batch's steps. Passing ``value_fn`` (a loss
over one micro-batch's data, most likely) needs an explicit opt-in.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from tests.helpers.lanes import sweep
from tests.helpers.models import (
    linear_data,
    linear_loss,
    linear_params,
    mlp_loss,
    mlp_params,
    regression_data,
    train_in_micro_batches,
)

K = 4


def _plateau():
    return optax.chain(
        optax.sgd(0.9),
        optax.contrib.reduce_on_plateau(factor=0.5, patience=1, accumulation_size=1),
    )


def _large_batch(tx, steps, x, y, **update_kwargs):
    params = linear_params()
    state = tx.init(params)
    for _ in range(steps):
        value, grad = jax.value_and_grad(linear_loss)(params, x, y)
        u, state = tx.update(grad, state, params, value=value, **update_kwargs)
        params = optax.apply_updates(params, u)
    return params


def _value_as_update():
    """An inner optimizer whose update is ``value`` in every leaf."""

    def inner_update(updates, state, params=None, *, value, **extra):
        return jax.tree.map(lambda u: jnp.zeros_like(u) + value, updates), state

    return optax.GradientTransformationExtraArgs(
        lambda p: optax.EmptyState(), inner_update
    )


def test_extra_args_are_forwarded_to_the_inner_optimizer():
    seen = []

    def inner_update(updates, state, params=None, **extra_args):
        seen.append(sorted(extra_args))
        return jax.tree.map(lambda u: u * extra_args["value"], updates), state

    inner = optax.GradientTransformationExtraArgs(
        lambda p: optax.EmptyState(), inner_update
    )
    tx = optax_accum.accumulate(inner, 2)
    params = {"a": jnp.zeros([])}
    state = tx.init(params)
    _, state = tx.update(
        {"a": jnp.float32(1.0)}, state, params, value=jnp.float32(10.0)
    )
    u, state = tx.update(
        {"a": jnp.float32(3.0)}, state, params, value=jnp.float32(10.0)
    )
    assert float(u["a"]) == 20.0
    assert ["value"] in seen


@pytest.mark.parametrize(
    "face", sweep(["accumulate", "MultiSteps"], fast=["MultiSteps"])
)
def test_reduce_on_plateau_sees_the_windows_loss(face):
    x, y = linear_data()
    if face == "accumulate":
        tx = optax_accum.accumulate(_plateau(), K)
    else:
        tx = optax_accum.MultiSteps(_plateau(), K).gradient_transformation()
    params, _ = train_in_micro_batches(tx, 8, K, x, y)
    # Fed the last micro-batch's loss, the plateau logic ends 0.04 off.
    chex.assert_trees_all_close(params, _large_batch(_plateau(), 8, x, y), rtol=1e-5)


def test_value_is_accumulated_with_the_weights_and_reduction():
    params = {"a": jnp.zeros([])}
    for reduction, expected in [("mean", (1 * 2 + 3 * 6) / 4), ("sum", 2 + 18)]:
        tx = optax_accum.accumulate(_value_as_update(), 2, reduction=reduction)
        state = tx.init(params)
        assert state.value_accumulator.shape == ()
        _, state = tx.update(params, state, params, value=2.0, weight=1)
        u, state = tx.update(params, state, params, value=6.0, weight=3)
        assert float(u["a"]) == expected


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_value_is_reduced_over_devices_with_the_weights(reduction):
    n = 8
    tx = optax_accum.accumulate(
        _value_as_update(), 2, axis_name="d", reduction=reduction
    )
    params = {"a": jnp.zeros((n,))}
    state = jax.pmap(tx.init, axis_name="d")(params)
    update = jax.pmap(
        lambda g, s, p, v, w: tx.update(g, s, p, value=v, weight=w), axis_name="d"
    )
    rng = np.random.default_rng(0)
    values = rng.normal(size=(2, n)).astype(np.float32)
    weights = rng.uniform(0.5, 2, size=(2, n)).astype(np.float32)
    values[0, 3], weights[0, 3] = np.nan, 0.0  # an all-padding micro-batch
    for i in range(2):
        u, state = update(params, state, params, values[i], weights[i])
    total = np.nansum(values * weights)
    expected = total / weights.sum() if reduction == "mean" else total
    np.testing.assert_allclose(u["a"], expected, rtol=1e-5)


def test_optimizers_that_ignore_value_get_no_value_accumulator():
    params = linear_params()
    tx = optax_accum.accumulate(optax.adam(1e-3), 2)
    assert tx.init(params).value_accumulator == ()
    assert optax_accum.MultiSteps(optax.adam(1e-3), 2).init(params).acc_value == ()


@pytest.mark.slow
def test_line_search_optimizer_lbfgs():
    # L-BFGS needs value, grad and value_fn: value and grad are the window's.
    k = 2
    x, y = regression_data(16, seed=3)
    params = mlp_params(3)
    loss = lambda p: mlp_loss(p, x, y)
    ref = optax.lbfgs()
    # value_fn is the full-batch loss here, so the line search is exact.
    tx = optax_accum.accumulate(optax.lbfgs(), k, allow_value_fn=True)
    # value_fn is a callable, not an array: it is closed over, not traced.
    ref_update = jax.jit(functools.partial(ref.update, value_fn=loss))
    update = jax.jit(functools.partial(tx.update, value_fn=loss))
    grad_fn = jax.jit(jax.grad(mlp_loss))
    ref_params, ref_state, state = params, ref.init(params), tx.init(params)
    for _ in range(3):
        value, grad = jax.value_and_grad(loss)(ref_params)
        u, ref_state = ref_update(grad, ref_state, ref_params, value=value, grad=grad)
        ref_params = optax.apply_updates(ref_params, u)
        value, grad = jax.value_and_grad(loss)(params)
        for i in range(k):
            g = grad_fn(params, x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])
            u, state = update(g, state, params, value=value, grad=grad)
        params = optax.apply_updates(params, u)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-4, atol=1e-6)


def _large_batch_lbfgs(steps, x, y, value_fn):
    tx = optax.lbfgs()
    params = linear_params()
    state = tx.init(params)
    for _ in range(steps):
        value, grad = jax.value_and_grad(linear_loss)(params, x, y)
        u, state = tx.update(
            grad, state, params, value=value, grad=grad, value_fn=value_fn
        )
        params = optax.apply_updates(params, u)
    return params


@pytest.mark.slow
@pytest.mark.parametrize(
    "face", sweep(["accumulate", "MultiSteps"], fast=["accumulate"])
)
def test_lbfgs_gets_the_windows_value_and_grad(face):
    # Each micro-batch's value and grad are passed, with a value_fn for the
    # whole window's data (opted in): the step is the large batch's L-BFGS step.
    x, y = linear_data(1)
    value_fn = lambda p: linear_loss(p, x, y)
    if face == "accumulate":
        tx = optax_accum.accumulate(optax.lbfgs(), K, allow_value_fn=True)
    else:
        ms = optax_accum.MultiSteps(optax.lbfgs(), K, allow_value_fn=True)
        tx = ms.gradient_transformation()
    update = jax.jit(functools.partial(tx.update, value_fn=value_fn))
    params = linear_params()
    state = tx.init(params)
    for _ in range(3):
        for i in range(K):
            value, grad = jax.value_and_grad(linear_loss)(params, x[i::K], y[i::K])
            u, state = update(grad, state, params, value=value, grad=grad)
        params = optax.apply_updates(params, u)
    ref = _large_batch_lbfgs(3, x, y, value_fn)
    chex.assert_trees_all_close(params, ref, rtol=1e-5, atol=1e-6)


def test_value_fn_needs_an_explicit_opt_in():
    x, y = linear_data()
    params = linear_params()
    value_fn = lambda p: linear_loss(p, x[::K], y[::K])  # one micro-batch's loss
    v, g = jax.value_and_grad(linear_loss)(params, x[::K], y[::K])
    for tx, owner in [
        (optax_accum.accumulate(optax.lbfgs(), K), "accumulate"),
        (optax_accum.MultiSteps(optax.lbfgs(), K), "MultiSteps"),
    ]:
        with pytest.raises(ValueError, match=f"`value_fn` was passed to {owner}"):
            tx.update(g, tx.init(params), params, value=v, grad=g, value_fn=value_fn)


@pytest.mark.slow
def test_value_fn_is_accepted_when_the_window_is_one_micro_batch():
    params = {"w": jnp.array([1.0, -2.0])}
    loss = lambda p: jnp.sum((p["w"] - 3.0) ** 2)

    def steps(tx, n=3):
        @jax.jit
        def step(p, state):
            value, grad = jax.value_and_grad(loss)(p)
            u, state = tx.update(grad, state, p, value=value, grad=grad, value_fn=loss)
            return optax.apply_updates(p, u), state

        p, state = params, tx.init(params)
        for _ in range(n):
            p, state = step(p, state)
        return p

    ref = steps(optax.lbfgs())
    for tx in (
        optax_accum.accumulate(optax.lbfgs(), 1),
        optax_accum.MultiSteps(optax.lbfgs(), 1),
    ):
        chex.assert_trees_all_close(steps(tx), ref, rtol=1e-6)
    tx = optax_accum.accumulate(optax.lbfgs(), 2)
    value, grad = jax.value_and_grad(loss)(params)
    with pytest.raises(ValueError, match="`value_fn` was passed"):
        tx.update(grad, tx.init(params), params, value=value, grad=grad, value_fn=loss)
