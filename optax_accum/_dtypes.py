# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The accumulator dtype policy, shared by both faces.

``"promote"`` (the default everywhere) never loses information: each
gradient accumulates in at least float32, of its own kind (bf16 and fp16 in
float32, float64 and complex as they are). The arithmetic of a window (the
weights, the running-mean coefficients, the differences) runs at least at the
accumulator's precision, never in a narrower type.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PROMOTE = "promote"


def canonical(dtype: Any) -> Any:
    """A canonical dtype, ``"promote"``, or None ('each gradient's dtype')."""
    if dtype is None or (isinstance(dtype, str) and dtype == PROMOTE):
        return dtype
    message = (
        "`accumulator_dtype` must be a floating dtype (or a complex one), "
        f'"{PROMOTE}" or None, got {dtype!r}.'
    )
    try:
        canonical_dtype = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(message) from e
    if not jnp.issubdtype(canonical_dtype, jnp.inexact):
        raise TypeError(message)
    return canonical_dtype


def for_gradient(grad_dtype: Any, policy: Any) -> Any:
    """The accumulator dtype for a gradient leaf under a canonical ``policy``.

    An explicit real dtype for a complex gradient would drop the imaginary
    part, so it raises.
    """
    grad_dtype = jnp.dtype(grad_dtype)
    if policy is None:
        return grad_dtype
    if isinstance(policy, str):
        return jnp.promote_types(grad_dtype, jnp.float32)
    if jnp.issubdtype(grad_dtype, jnp.complexfloating) and not jnp.issubdtype(
        policy, jnp.complexfloating
    ):
        raise TypeError(
            f"`accumulator_dtype`={policy} would drop the imaginary part of "
            f"{grad_dtype} gradients: pass a complex dtype, "
            f'"{PROMOTE}" (the default) or None.'
        )
    return policy


def compute(dtype: Any) -> Any:
    """The dtype the arithmetic on a ``dtype`` buffer runs in (>= float32):
    an fp16 accumulator is updated in float32 and stored back, so that a
    difference of two in-range values cannot overflow."""
    return jnp.promote_types(dtype, jnp.float32)


def is_narrow(dtype: Any) -> bool:
    """A floating buffer narrower than float32 (float16, bfloat16, ...): a
    window keeps a running mean there, whose error does not grow with k."""
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def real(dtype: Any) -> Any:
    """The real dtype of ``dtype``'s precision (complex128 -> float64)."""
    return jnp.finfo(dtype).dtype if jnp.issubdtype(dtype, jnp.inexact) else dtype


def weight_dtype(tree: Any) -> Any:
    """The dtype of a window's weights and coefficients: float32, or the real
    dtype of the widest floating leaf of ``tree`` (float64 under x64)."""
    dtype = jnp.dtype(jnp.float32)
    for x in jax.tree.leaves(tree):
        x_dtype = jnp.result_type(x)
        if jnp.issubdtype(x_dtype, jnp.inexact):
            dtype = jnp.promote_types(dtype, real(x_dtype))
    return dtype


def is_differentiable(dtype: Any) -> bool:
    """Floating or complex: leaves that have gradients to accumulate."""
    return jnp.issubdtype(dtype, jnp.inexact)


def is_float0(x: Any) -> bool:
    """A gradient of an integer input (``jax.grad(..., allow_int=True)``)."""
    return getattr(x, "dtype", None) == jax.dtypes.float0


def without_float0(tree: Any) -> Any:
    """``tree`` with its float0 leaves (integer inputs' gradients) as None:
    nothing to accumulate, and no buffer for them."""
    return jax.tree.map(lambda x: None if is_float0(x) else x, tree)


def _is_none(x: Any) -> bool:
    return x is None


def with_float0(tree: Any, like: Any) -> Any:
    """`without_float0` undone: ``like``'s float0 leaves back as float0 zeros.

    None leaves (Equinox's gradients of non-arrays) are kept on both sides, so
    the two leaf lists line up.
    """
    leaves = jax.tree.leaves(tree, is_leaf=_is_none)
    like_leaves, treedef = jax.tree.flatten(like, is_leaf=_is_none)
    return jax.tree.unflatten(
        treedef,
        [
            np.zeros(s.shape, jax.dtypes.float0) if is_float0(s) else x
            for s, x in zip(like_leaves, leaves, strict=True)
        ],
    )
