# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The privacy tests' model and its float64 reference, by hand in NumPy.

A linear model with a squared error: example ``e``'s loss, as a batch of one,
is ``0.5 * (x_e . w + b - y_e)^2``, its gradient ``(r_e x_e, r_e)`` with
``r_e`` the residual, clipped to norm C over both leaves.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def loss(params, x, y):
    r = x @ params["w"] + params["b"] - y
    return 0.5 * jnp.mean(r**2)


def data(rows=16, dim=3, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, dim)).astype(np.float32) * scale
    y = rng.normal(size=(rows,)).astype(np.float32)
    params = {
        "w": rng.normal(size=(dim,)).astype(np.float32),
        "b": np.float32(0.5),
    }
    return params, x, y


def per_example(params, x, y):
    """float64 per-example gradients, ``(w: (rows, dim), b: (rows,))``, and
    losses."""
    w = np.asarray(params["w"], np.float64)
    b = np.float64(params["b"])
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    r = x @ w + b - y
    return r[:, None] * x, r, 0.5 * r**2


def clipped_sum(params, x, y, c, mask=None):
    """float64: the sum of clipped per-example gradients, and the mean loss."""
    gw, gb, losses = per_example(params, x, y)
    norm = np.sqrt(np.sum(gw**2, axis=1) + gb**2)
    scale = np.minimum(1.0, c / np.maximum(norm, 1e-300))
    keep = np.ones(len(gb), bool) if mask is None else np.asarray(mask)
    scale = np.where(keep, scale, 0.0)
    grads = {"w": np.sum(gw * scale[:, None], axis=0), "b": np.sum(gb * scale)}
    value = np.sum(np.where(keep, losses, 0.0)) / max(keep.sum(), 1)
    return value, grads
