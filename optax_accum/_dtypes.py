# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The accumulator dtype policy, shared by both faces.

``"promote"`` (the default everywhere) never loses information: each
gradient accumulates in at least float32, of its own kind (bf16 and fp16 in
float32, float64 and complex as they are). The arithmetic of a window (the
weights, the running-mean coefficients, the differences) runs at least at the
accumulator's precision, never in a narrower type.

A policy may also be a pytree prefix of the gradients (`PerLeaf`), one policy
per subtree: `resolve` turns it into one accumulator dtype per leaf, the one
place where a prefix meets the gradient tree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PROMOTE = "promote"


@dataclasses.dataclass(frozen=True)
class PerLeaf:
    """A checked pytree prefix of policies: its structure (policies as
    leaves, None included) and each subtree's canonical policy. Hashable, as
    the frozen options that hold it are."""

    treedef: Any
    policies: tuple

    def prefix(self) -> Any:
        return jax.tree.unflatten(self.treedef, self.policies)


def _is_policy(x: Any) -> bool:
    """A policy for a whole subtree, not a container of policies."""
    return x is None or isinstance(x, str) or jax.tree_util.all_leaves([x])


def canonical(dtype: Any) -> Any:
    """A canonical dtype, ``"promote"``, None ('each gradient's dtype'), or
    a `PerLeaf` prefix of them."""
    if _is_policy(dtype):
        return _canonical_one(dtype, "")
    flat, treedef = jax.tree_util.tree_flatten_with_path(dtype, is_leaf=_is_policy)
    policies = tuple(_canonical_one(p, jax.tree_util.keystr(k)) for k, p in flat)
    return PerLeaf(treedef, policies)


def _canonical_one(dtype: Any, path: str) -> Any:
    if dtype is None or (isinstance(dtype, str) and dtype == PROMOTE):
        return dtype
    where = f" at {path}" if path else ""
    message = (
        f"`accumulator_dtype`{where} must be a floating dtype (or a complex "
        f'one), "{PROMOTE}" or None, got {dtype!r}.'
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


def resolve(policy: Any, tree: Any) -> Any:
    """The accumulator dtype of each leaf of ``tree`` (arrays or shapes; None
    leaves stay None) under a canonical ``policy``, scalar or `PerLeaf`.

    Raises:
      ValueError: a `PerLeaf` prefix that is not a prefix of ``tree``, naming
        the path where they part.
    """
    if not isinstance(policy, PerLeaf):
        return _resolve_subtree(policy, tree)
    return _resolve_at(policy.prefix(), tree, ())


def _resolve_subtree(policy: Any, tree: Any) -> Any:
    return jax.tree.map(lambda x: for_gradient(jnp.result_type(x), policy), tree)


def _one_level(tree: Any) -> tuple[list, Any]:
    """``tree``'s children with their keys, and its node (children as leaves)."""
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)


def _resolve_at(prefix: Any, tree: Any, path: tuple) -> Any:
    if _is_policy(prefix):
        return _resolve_subtree(prefix, tree)
    # Matched by keys, not node types: a dict prefix serves an nnx.State or a
    # FrozenDict of the same keys.
    p_flat, p_node = _one_level(prefix)
    t_flat, t_node = _one_level(tree)
    p_keys, t_keys = [k for k, _ in p_flat], [k for k, _ in t_flat]
    if p_keys != t_keys:
        where = jax.tree_util.keystr(path) or "the root"
        raise ValueError(
            f"`accumulator_dtype` is not a prefix of the gradients at {where}: "
            f"it has {p_node}, the gradients have {t_node}. Pass a dtype per "
            "subtree of the gradients (the parameters'), or one dtype for all."
        )
    resolved = [
        _resolve_at(p, t, path + k)
        for (k, p), (_, t) in zip(p_flat, t_flat, strict=True)
    ]
    return t_node.unflatten(resolved)


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
