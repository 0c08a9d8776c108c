# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The GPU's form of the boundary branch gives the answers the ``lax.cond`` gives.

On CUDA and ROCm `_compiler.boundary_cond` is a loop of at most one trip
(XLA:GPU would turn the conditional into selects; tests/compilers/ holds the
compiled programs). Which form runs is a compiler's choice, not a meaning:
here both run on the CPU, bit for bit alike, through both faces, a
per-device window, ``vmap`` (a batched predicate) and an integer input.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum import _compiler
from tests.helpers.models import mlp_loss, mlp_params, regression_data


def _as_loop(pred, boundary, hold, *operands, carried):
    return _compiler._at_most_once(pred, boundary, hold, operands, carried)


def _both(monkeypatch, run):
    """``run()`` with the conditional, then with the loop."""
    as_cond = jax.tree.map(np.asarray, run())
    monkeypatch.setattr(_compiler, "boundary_cond", _as_loop)
    jax.clear_caches()
    as_loop = jax.tree.map(np.asarray, run())
    return as_cond, as_loop


def _train(tx, steps=7, weights=(1.0, 2.0, 0.0, 3.0, 1.0, 1.0, 0.5)):
    params = mlp_params(0)
    x, y = regression_data(4 * steps)
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y, **weight):
        grads = jax.grad(mlp_loss)(params, x, y)
        updates, state = tx.update(grads, state, params, **weight)
        return optax.apply_updates(params, updates), state

    for i in range(steps):
        rows = slice(4 * i, 4 * i + 4)
        w = {} if weights[i] is None else {"weight": weights[i]}
        params, state = step(params, state, x[rows], y[rows], **w)
    return params, state


@pytest.mark.parametrize("face", ["accumulate", "drop_in"])
def test_the_loop_gives_the_conds_answers(monkeypatch, face):
    def run():
        inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
        if face == "accumulate":
            return _train(optax_accum.accumulate(inner, 3))
        tx = optax_accum.MultiSteps(inner, 3).gradient_transformation()
        return _train(tx, weights=(None,) * 7)

    as_cond, as_loop = _both(monkeypatch, run)
    jax.tree.map(np.testing.assert_array_equal, as_cond, as_loop)


def test_the_loop_under_vmap(monkeypatch):
    """Two runs whose windows close on different micro-steps: the predicate
    is batched, and each run takes the branch it would alone."""
    tx = optax_accum.accumulate(optax.adam(1e-2), 2)

    def one(params, state, x, y, close):
        grads = jax.grad(mlp_loss)(params, x, y)
        updates, state = tx.update(grads, state, params, close_window=close)
        return optax.apply_updates(params, updates), state

    def run():
        params = jax.tree.map(lambda a: jnp.stack([a, a]), mlp_params(0))
        state = jax.vmap(tx.init)(params)
        x, y = regression_data(8)
        xs, ys = x.reshape(2, 4, -1), y.reshape(2, 4, -1)
        step = jax.jit(jax.vmap(one))
        for close in ([True, False], [False, False], [False, True]):
            params, state = step(params, state, xs, ys, jnp.asarray(close))
        return params, state

    as_cond, as_loop = _both(monkeypatch, run)
    # Batched, both forms compute both branches and select; XLA fuses the two
    # programs differently, which moves a few results by one ulp.
    close = functools.partial(np.testing.assert_allclose, rtol=2e-7, atol=0)
    jax.tree.map(close, as_cond, as_loop)


def test_the_loop_per_device(monkeypatch):
    n = 4
    tx = optax_accum.accumulate(optax.adam(1e-2), 2, axis_name="d")

    def step(params, state, x, y):
        grads = jax.grad(mlp_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def run():
        devices = jax.devices()[:n]
        params = jax.tree.map(lambda a: jnp.stack([a] * n), mlp_params(0))
        state = jax.pmap(tx.init, axis_name="d", devices=devices)(params)
        pstep = jax.pmap(step, axis_name="d", devices=devices)
        x, y = regression_data(3 * n * 2, seed=1)
        for i in range(3):
            rows = slice(2 * n * i, 2 * n * (i + 1))
            xb, yb = x[rows].reshape(n, 2, -1), y[rows].reshape(n, 2, -1)
            params, state = pstep(params, state, xb, yb)
        return params, state

    as_cond, as_loop = _both(monkeypatch, run)
    jax.tree.map(np.testing.assert_array_equal, as_cond, as_loop)


def test_the_loop_passes_an_integer_inputs_gradient_through(monkeypatch):
    inner = optax.masked(optax.sgd(0.5), {"w": True, "n": False})
    tx = optax_accum.accumulate(inner, 2)

    def loss(params, x):
        return jnp.sum(params["w"] * x) * params["n"]

    def run():
        params = {"w": jnp.ones(3), "n": jnp.int32(3)}
        state = tx.init(params)
        grad = jax.jit(jax.grad(loss, allow_int=True))
        update = jax.jit(tx.update)
        for x in (1.0, 3.0):
            updates, state = update(grad(params, jnp.full(3, x)), state, params)
        assert updates["n"].dtype == jax.dtypes.float0
        return updates["w"], state.accumulator["w"]

    as_cond, as_loop = _both(monkeypatch, run)
    jax.tree.map(np.testing.assert_array_equal, as_cond, as_loop)
    np.testing.assert_array_equal(as_loop[0], -np.full(3, 3.0))  # 0.5 * 3 * 2


def test_differentiating_an_update_takes_the_conditional():
    """A loop cannot be transposed: under ``jax.grad`` of an update the branch
    is the ``lax.cond`` on every platform, the loop only where the update is
    not differentiated."""
    tx = optax_accum.accumulate(optax.adam(0.1), 2)
    params = jnp.ones(3)
    state = tx.init(params)

    def loss(params):
        _, mid = tx.update(params * 2, state, params)
        updates, _ = tx.update(params * 3, mid, params)
        return jnp.sum(optax.apply_updates(params, updates))

    grad = jax.grad(loss)
    np.testing.assert_array_equal(jax.jit(grad)(params), grad(params))
    for fn, loop in ((grad, False), (loss, True)):
        text = jax.jit(fn).trace(params).lower(lowering_platforms=("cuda",)).as_text()
        assert ("stablehlo.while" in text) == loop
