# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Small models and data shared by the tests."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax


def mlp_params(key: int = 0, sizes=(6, 8, 3), dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(key), len(sizes) - 1)
    return [
        {
            "w": (jax.random.normal(k, (m, n)) / np.sqrt(m)).astype(dtype),
            "b": jnp.zeros(n, dtype),
        }
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp_loss(params, x, y):
    h = x
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jnp.tanh(h)
    return jnp.mean((h - y) ** 2)


def regression_data(n: int, seed: int = 0, d_in: int = 6, d_out: int = 3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d_in)).astype(np.float32)
    y = rng.normal(size=(n, d_out)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


# A linear model on 3 features with skewed targets (normal plus 5 chi-square),
# trained in micro-batches by the extra-args and state-reader tests.


def linear_params():
    return {"w": jnp.ones(3), "b": jnp.zeros([])}


def linear_loss(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def linear_data(seed: int = 0, n: int = 32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(n,)) * 3 + 5 * rng.normal(size=(n,)) ** 2)
    return x, y.astype(jnp.float32)


def train_in_micro_batches(tx, steps: int, k: int, x, y, **update_kwargs):
    """``steps`` updates of ``tx``, each fed k micro-batches (rows i, i+k, ...).

    The update gets each micro-batch's loss as ``value``; returns the final
    parameters and state.
    """
    update = jax.jit(functools.partial(tx.update, **update_kwargs))
    params, state = linear_params(), tx.init(linear_params())
    for _ in range(steps):
        for i in range(k):
            value, grad = jax.value_and_grad(linear_loss)(params, x[i::k], y[i::k])
            u, state = update(grad, state, params, value=value)
        params = optax.apply_updates(params, u)
    return params, state
