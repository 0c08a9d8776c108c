# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Clipping one example's gradient to an L2 norm over the whole pytree.

The one formula the privacy guarantee rests on, as ``jax_privacy``'s
``clip_pytree`` has it: non-finite entries become 0 (a NaN example then
contributes a bounded, finite gradient), and the norm is taken in at least
float32 (float64 where a leaf is) over every leaf together.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .. import _dtypes


def clip(grads: Any, l2_clip_norm: float) -> tuple[Any, jax.Array]:
    """``grads`` (one example's) scaled to L2 norm at most ``l2_clip_norm``.

    Returns the clipped gradients in their promoted dtypes (at least
    float32, `_dtypes`' ``"promote"``) and the norm before clipping.
    """

    def finite(g):
        g = g.astype(_dtypes.for_gradient(g.dtype, _dtypes.PROMOTE))
        return jnp.where(jnp.isfinite(g), g, jnp.zeros_like(g))

    grads = jax.tree.map(finite, grads)
    dtype = _dtypes.weight_dtype(grads)  # float32, or float64 where a leaf is
    leaves = jax.tree.leaves(grads)
    sq = [jnp.sum(jnp.real(g * jnp.conj(g)).astype(dtype)) for g in leaves]
    norm = jnp.sqrt(sum(sq, jnp.zeros([], dtype)))
    # min(1, C / norm), with norm 0 (and so C / 0 = inf) giving 1.
    scale = jnp.minimum(jnp.ones([], dtype), jnp.asarray(l2_clip_norm, dtype) / norm)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads), norm
