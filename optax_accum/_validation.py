# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Argument checks shared by the public factories.

Every check raises at construction or trace time with a message that names the
argument and the value, so bad input never turns into a silently wrong update.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

REDUCTIONS = ("mean", "sum")


def check_reduction(reduction: Any) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"`reduction` must be one of {REDUCTIONS}, got {reduction!r}.")


def check_positive_int(value: Any, name: str) -> int:
    """Returns ``value`` as an int, or raises if it is not an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        try:
            is_int_array = jnp.issubdtype(np.asarray(value).dtype, np.integer)
        except (TypeError, ValueError):  # a non-numeric object
            is_int_array = False
        if not (is_int_array and np.ndim(value) == 0):
            raise TypeError(f"`{name}` must be an integer, got {value!r}.")
    value = operator.index(np.asarray(value).item())
    if value < 1:
        raise ValueError(f"`{name}` must be >= 1, got {value}.")
    return value


def check_every_k(
    every_k: Any, *, from_schedule: bool = False, arg: str = "every_k"
) -> None:
    """Checks ``every_k`` (an int or callable) or the value a schedule returned.

    ``arg`` is the argument's name in the caller's signature.
    """
    if not from_schedule:
        if callable(every_k):
            return
        check_positive_int(every_k, arg)
        return
    name = f"{arg}(step)"
    dtype = getattr(every_k, "dtype", None)
    if dtype is None:
        if isinstance(every_k, bool) or not isinstance(every_k, int | np.integer):
            raise TypeError(f"`{name}` must return an integer, got {every_k!r}.")
    elif not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"`{name}` must return an integer, got dtype {dtype}.")
    if np.ndim(every_k) != 0:
        raise ValueError(
            f"`{name}` must return a scalar, got shape {np.shape(every_k)}."
        )
    if not isinstance(every_k, jax.core.Tracer):
        check_positive_int(every_k, name)


def canonical_accumulator_dtype(dtype: Any) -> Any:
    """Returns a canonical floating dtype, or None for 'same as the gradient'."""
    if dtype is None:
        return None
    try:
        canonical = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(
            f"`accumulator_dtype` must be a floating dtype or None, got {dtype!r}."
        ) from e
    if not jnp.issubdtype(canonical, jnp.floating):
        raise TypeError(
            f"`accumulator_dtype` must be a floating dtype or None, got {dtype!r}."
        )
    return canonical


def check_weight(weight: Any) -> jax.Array:
    """Returns the micro-batch weight as a float32 scalar."""
    if weight is None:
        return jnp.ones([], jnp.float32)
    if np.ndim(weight) != 0:
        raise ValueError(
            f"`weight` must be a scalar, got shape {np.shape(weight)}: {weight!r}."
        )
    dtype = jnp.result_type(weight)
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"`weight` must be a real number, got dtype {dtype}.")
    return jnp.asarray(weight, jnp.float32)


def normalize_skip_result(result: Any, arg: str = "skip_fn") -> tuple[jax.Array, Any]:
    """Accepts ``flag`` or optax's ``(flag, skip_state)``; checks ``flag``."""
    if isinstance(result, tuple) and len(result) == 2:
        flag, skip_state = result
    else:
        flag, skip_state = result, ()
    dtype = getattr(flag, "dtype", None)
    if dtype is None or dtype != jnp.bool_ or np.ndim(flag) != 0:
        raise TypeError(
            f"`{arg}` must return a boolean scalar (or a tuple of one and a "
            f"pytree), got {flag!r}."
        )
    return jnp.asarray(flag), skip_state
