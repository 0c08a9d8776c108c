# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Arithmetic on deferred (unreduced) partial sums.

A parameter typed ``reduced`` over a mesh axis gets a gradient ``unreduced``
over it: each device keeps its partial sum, and one ``reshard`` sums them. On
such values only sums and products with scalars typed ``reduced`` are allowed.
This module owns `defer_reduction`, which marks the parameters, the running
mean and the weighted sum on partial sums, and `finish`, the one deferred
reduction per update.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec as P

from . import _dtypes
from ._sharding import deferrable, explicit_axes, explicit_spec, unreduced


def for_partial(scalar: jax.Array, like: Any) -> jax.Array:
    """``scalar`` typed to multiply ``like``: reduced where ``like`` is unreduced."""
    axes = unreduced(like)
    if not axes:
        return scalar
    return jax.sharding.reshard(scalar, P(reduced=axes))


def lerp(a: jax.Array, g: jax.Array, coef: jax.Array) -> jax.Array:
    """``a + coef * (g - a)``: the running-mean step, also on partial sums.

    Computed at least in float32 (`_dtypes.compute`): in an fp16 buffer,
    ``g - a`` of two in-range values can overflow.
    """
    if not unreduced(a):
        wide = _dtypes.compute(a.dtype)
        a_w, g_w = a.astype(wide), g.astype(wide)
        return (a_w + coef.astype(wide) * (g_w - a_w)).astype(a.dtype)
    # Unreduced values admit only sums and products with reduced scalars.
    one_minus = for_partial((1 - coef).astype(a.dtype), a)
    return a * one_minus + g * for_partial(coef.astype(a.dtype), a)


def add_scaled(a: jax.Array, g: jax.Array, w: jax.Array) -> jax.Array:
    """``a + w * g`` for a scalar ``w`` (at least in float32), also on partial
    sums."""
    if not unreduced(a):
        wide = _dtypes.compute(a.dtype)
        return (a.astype(wide) + w.astype(wide) * g.astype(wide)).astype(a.dtype)
    return a + g * for_partial(w.astype(g.dtype), g)


def scale(g: jax.Array, w: jax.Array) -> jax.Array:
    """``w * g`` for a scalar ``w`` (at least in float32), also on partial sums."""
    if not unreduced(g):
        wide = _dtypes.compute(g.dtype)
        return w.astype(wide) * g.astype(wide)
    return g * for_partial(w.astype(g.dtype), g)


def finish(x: jax.Array) -> jax.Array:
    """Sums ``x``'s partial sums: the one deferred reduction (an all-reduce,
    or a reduce-scatter into the parameter's sharding)."""
    axes = unreduced(x)
    if not axes:
        return x
    spec = explicit_spec(x)
    return jax.sharding.reshard(x, spec.update(unreduced=frozenset()))


def defer_reduction(params: optax.Params, data_axes: Any) -> optax.Params:
    """Marks parameters so that their gradients stay unreduced over ``data_axes``.

    In a global-view ``jax.jit`` step on an Explicit mesh, ``jax.grad``
    all-reduces each gradient over the mesh axes that shard the batch. Call
    ``jax.grad(loss)(defer_reduction(params, "data"), batch)`` instead and the
    gradients come back *unreduced* over ``"data"`` (each device keeps its
    partial sum): `accumulate` with ``data_axes="data"`` adds them up locally
    and reduces once, in the boundary step. Leaves sharded over an axis (FSDP)
    keep that axis: their reduce-scatter is part of FSDP and stays per call.

    Args:
      params: the parameters, sharded on an Explicit mesh.
      data_axes: the mesh axis (or axes) that shard the batch.

    Returns:
      ``params`` with each floating leaf typed ``reduced`` over those of
      ``data_axes`` that do not shard it; the values are unchanged.

    Raises:
      ValueError: if ``data_axes`` names no axis of an Explicit mesh.

    Examples:
      >>> import jax, jax.numpy as jnp, optax_accum
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> with jax.set_mesh(mesh):
      ...     w = jax.device_put(jnp.ones(3), P())
      ...     x = jax.device_put(jnp.ones((4, 3)), P("data"))
      ...     g = jax.jit(lambda w, x: jax.grad(lambda w: jnp.mean(x @ w))(
      ...         optax_accum.defer_reduction(w, "data")))(w, x)
      >>> jax.typeof(g).sharding.spec.unreduced
      frozenset({'data'})
    """
    names = explicit_axes(data_axes)

    def mark(x):
        extra = deferrable(x, names)
        if not extra:
            return x
        spec = explicit_spec(x)
        return jax.sharding.reshard(x, spec.update(reduced=spec.reduced | extra))

    return jax.tree.map(mark, params)
