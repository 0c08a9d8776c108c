# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""How to check an accumulated run against the large batch (issue 33, §4).

An attention key bias ``bk`` adds ``q . bk`` to every logit of a query, which
softmax ignores: its exact gradient is 0, and autodiff returns float32
rounding noise. Adam divides that noise by its own root mean square, so it
takes an lr-sized step in a direction the rounding picks, and k micro-batches
(any summation order) redraw it: ``bk`` fails ``rtol=1e-5`` against the large
batch, for `accumulate`, ``optax.MultiSteps`` and a hand-written loop alike.
The checks that hold: the gradients, the updates of SGD, and Adam's
parameters with a tolerance scaled to the learning rate.
(``benchmarks/adam_zero_gradient.py`` prints the gaps.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

K, B, T, D, LR, STEPS = 4, 16, 4, 8, 1e-3, 3


def _params():
    keys = jax.random.split(jax.random.key(0), 3)
    return {
        "wq": jax.random.normal(keys[0], (D, D)) / D**0.5,
        "wk": jax.random.normal(keys[1], (D, D)) / D**0.5,
        "bk": jnp.zeros(D),
        "wo": jax.random.normal(keys[2], (D, 1)) / D**0.5,
    }


def _loss(p, x, y):
    q, k = x @ p["wq"], x @ p["wk"] + p["bk"]
    att = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / D**0.5, axis=-1)
    out = jnp.einsum("bts,bsd->btd", att, x) @ p["wo"]
    return jnp.mean((out[..., 0] - y) ** 2)


def _data():
    kx, ky = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (B, T, D)), jax.random.normal(ky, (B, T))


def _train(inner, accumulated: bool):
    tx = optax_accum.accumulate(inner, K) if accumulated else inner
    params = _params()
    state = tx.init(params)
    grad, update = jax.jit(jax.grad(_loss)), jax.jit(tx.update)
    x, y = _data()
    for _ in range(STEPS):
        parts = [(x[i::K], y[i::K]) for i in range(K)] if accumulated else [(x, y)]
        for xb, yb in parts:
            u, state = update(grad(params, xb, yb), state, params)
        params = optax.apply_updates(params, u)
    return params


def test_the_key_bias_has_an_exact_gradient_of_zero():
    x, y = _data()
    g = jax.grad(_loss)(_params(), x, y)
    assert float(jnp.max(jnp.abs(g["bk"]))) < 1e-6 * float(jnp.max(jnp.abs(g["wq"])))


def test_check_the_gradients():
    # 1. The accumulated gradient is the large batch's, leaf by leaf, to
    # float32 rounding of the largest gradient (an absolute tolerance: the
    # zero gradient's noise has no relative size).
    x, y = _data()
    g = jax.jit(jax.grad(_loss))
    parts = [g(_params(), x[i::K], y[i::K]) for i in range(K)]
    mean = jax.tree.map(lambda *a: sum(a) / K, *parts)
    full = g(_params(), x, y)
    scale = max(float(jnp.max(jnp.abs(v))) for v in jax.tree.leaves(full))
    for name in full:
        np.testing.assert_allclose(mean[name], full[name], rtol=1e-5, atol=1e-6 * scale)


def test_check_the_updates_with_sgd():
    # 2. SGD's step is lr * gradient: the noise stays noise-sized, so every
    # leaf, bk included, agrees with rtol 1e-5 (and a tiny atol).
    got, ref = _train(optax.sgd(LR), True), _train(optax.sgd(LR), False)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-9)


def test_check_adam_with_a_tolerance_scaled_to_the_learning_rate():
    # 3. Adam normalises the noise into a step of up to ~lr: bk may differ by
    # O(lr) per update, so its tolerance is the learning rate times the
    # updates; the leaves with a real gradient agree as tightly as SGD's.
    got, ref = _train(optax.adam(LR), True), _train(optax.adam(LR), False)
    np.testing.assert_allclose(got["bk"], ref["bk"], rtol=0, atol=LR * STEPS)
    for name in ("wq", "wk", "wo"):
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-7)
    # What rtol 1e-5 would have said of bk: its gap is lr-sized, not rounding.
    gap = float(jnp.max(jnp.abs(got["bk"] - ref["bk"])))
    assert gap > 1e-6, "bk's rounding noise agreed: the trap did not show"
