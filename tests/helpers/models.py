# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Small models and data shared by the tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


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
