# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Clipping one example's gradient to an L2 norm over the whole pytree.

The one formula the privacy guarantee rests on, as ``jax_privacy``'s
``clip_pytree`` has it: non-finite entries become 0 (a NaN example then
contributes a bounded, finite gradient), and the norm is taken in at least
float32 (float64 where a leaf is) over every leaf together. Inside
``shard_map``, a leaf split over a model axis (tensor parallelism) adds its
shards' squares over that axis: the norm is the whole gradient's, never a
shard's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import _dtypes


def clip(
    grads: Any, l2_clip_norm: float, data_axes: tuple = ()
) -> tuple[Any, jax.Array]:
    """``grads`` (one example's) scaled to L2 norm at most ``l2_clip_norm``.

    ``data_axes``: inside ``shard_map``, the manual axes the examples are
    split over. A leaf that varies over any other manual axis is a shard of
    the example's gradient (issue 39, finding 3): its squares are summed over
    those axes, so every device clips by the whole norm.

    Returns the clipped gradients in their promoted dtypes (at least
    float32, `_dtypes`' ``"promote"``) and the norm before clipping.
    """

    def finite(g):
        g = g.astype(_dtypes.for_gradient(g.dtype, _dtypes.PROMOTE))
        return jnp.where(jnp.isfinite(g), g, jnp.zeros_like(g))

    grads = jax.tree.map(finite, grads)
    dtype = _dtypes.weight_dtype(grads)  # float32, or float64 where a leaf is
    leaves = jax.tree.leaves(grads)
    sq = [
        _over_shards(jnp.sum(jnp.real(g * jnp.conj(g)).astype(dtype)), g, data_axes)
        for g in leaves
    ]
    norm = jnp.sqrt(sum(sq, jnp.zeros([], dtype)))
    # min(1, C / norm), with norm 0 (and so C / 0 = inf) giving 1.
    scale = jnp.minimum(jnp.ones([], dtype), jnp.asarray(l2_clip_norm, dtype) / norm)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads), norm


def _over_shards(sq: jax.Array, g: jax.Array, data_axes: tuple) -> jax.Array:
    """``sq``, a leaf's sum of squares, summed over the manual axes that split
    the leaf itself (not the examples)."""
    vary = getattr(getattr(jax.typeof(g), "mat", None), "varying", None) or ()
    shards = tuple(a for a in vary if a not in data_axes)
    return lax.psum(sq, shards) if shards else sq
