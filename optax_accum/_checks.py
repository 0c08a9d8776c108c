# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The argument checks every front-end shares.

Each raises at construction or trace time with a message that names the
argument and the value, so bad input never becomes a silently wrong update.
Checks that belong to one concept (weights, extra args, schedules, dtypes)
live next to that concept and build on these.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec


def is_constant(x: Any) -> bool:
    """Whether ``x`` is known at trace time (a Python or NumPy value)."""
    return not isinstance(x, jax.core.Tracer | jax.Array)


def is_concrete(x: Any) -> bool:
    """Whether ``x``'s value can be read now: a constant, or a ``jax.Array``
    that is not traced (an eager call) and is held by this process."""
    if is_constant(x):
        return True
    return not isinstance(x, jax.core.Tracer) and x.is_fully_addressable


def positive_int(value: Any, name: str) -> int:
    """``value`` as an int, or an error if it is not an integer >= 1."""
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


def one_of(value: Any, name: str, choices: Sequence[Any]) -> Any:
    """``value`` if it is one of ``choices``, else a ValueError naming them."""
    if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
        raise ValueError(f"`{name}` must be one of {tuple(choices)}, got {value!r}.")
    return value


def real_scalar(
    value: Any,
    name: str,
    *,
    what: str = "a real number",
    string_error: type[Exception] = TypeError,
    shape_error: type[Exception] = ValueError,
    bool_ok: bool = True,
) -> Any:
    """``value`` if it is a real (integer or floating) scalar, else an error.

    ``what`` describes the argument in the messages; the error types for a
    string and for a non-scalar differ between arguments (a string weight is
    the wrong type, a string loss the wrong shape), so the caller picks them.
    """
    if isinstance(value, str | bytes):
        raise string_error(f"`{name}` must be {what}, got {value!r}.")
    if not bool_ok and isinstance(value, bool | np.bool_):
        raise TypeError(f"`{name}` must be {what}, got {value!r}.")
    if np.ndim(value) != 0:
        raise shape_error(
            f"`{name}` must be a scalar, got shape {np.shape(value)}: {value!r}."
        )
    try:
        dtype = jnp.result_type(value)
    except (TypeError, ValueError):
        raise TypeError(f"`{name}` must be {what}, got {value!r}.") from None
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"`{name}` must be {what}, got dtype {dtype}: {value!r}.")
    return value


def finite_nonnegative(value: Any, name: str, *, arrays: bool = False) -> None:
    """Raises for a constant ``value`` that is negative or not finite.

    With ``arrays``, a concrete ``jax.Array`` counts as a constant too.
    """
    known = is_concrete(value) if arrays else is_constant(value)
    if known and not (math.isfinite(float(value)) and value >= 0):
        raise ValueError(f"`{name}` must be finite and >= 0, got {value!r}.")


def needs_whole_gradients(data_axes: Any, options: dict[str, Any]) -> None:
    """Refuses options that read each micro-batch's whole gradient with
    ``data_axes``, which leaves it as unreduced partial sums, one per device,
    until the window's end. ``options`` maps each option's name to its value
    (None: not set); the error names the first that is set, and `data_axes`.
    """
    if not data_axes:
        return
    for name, value in options.items():
        if value is not None:
            raise ValueError(
                f"`{name}` reads each micro-batch's whole gradient, which "
                "`data_axes` leaves as unreduced partial sums on each device "
                "until the window's end: pass one or the other, not both (got "
                f"data_axes={data_axes!r}, {name}={value!r}). Without "
                f"`data_axes`, jax.grad reduces each gradient and `{name}` "
                "works."
            )


def bool_scalar(value: Any, name: str) -> jax.Array:
    """``value`` as a boolean scalar array, or an error naming it."""
    if isinstance(value, str | bytes) or np.ndim(value) != 0:
        raise ValueError(
            f"`{name}` must be a boolean scalar, got shape {np.shape(value)}: "
            f"{value!r}."
        )
    try:
        dtype = jnp.result_type(value)
    except (TypeError, ValueError):
        dtype = None
    if dtype != jnp.bool_:
        raise TypeError(f"`{name}` must be a boolean scalar, got {value!r}.")
    return jnp.asarray(value)


def callable_or_none(value: Any, name: str) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"`{name}` must be callable or None, got {value!r}.")


def argnums(value: Any, name: str) -> tuple[int, ...]:
    """Positional argument indices: an int or a tuple of distinct ints >= 0."""
    items = (value,) if isinstance(value, int) else value
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(
            f"`{name}` must be an int or a tuple of ints, got {value!r}."
        ) from None
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise TypeError(f"`{name}` must be an int or a tuple of ints, got {value!r}.")
    if any(i < 0 for i in items):
        raise ValueError(f"`{name}` must be non-negative, got {value!r}.")
    if len(set(items)) != len(items):
        raise ValueError(f"`{name}` has repeated entries: {value!r}.")
    return items


def axis_names(value: Any, name: str) -> tuple[str, ...] | None:
    """Mesh axis names from a name or a tuple of names; None stays None."""
    if value is None:
        return None
    axes = (value,) if isinstance(value, str) else value
    # A set has no order (the devices' order would change between runs), and
    # a PartitionSpec's entries are per dimension, not axes.
    unordered = isinstance(value, (set, frozenset, dict, PartitionSpec))
    try:
        axes = () if unordered else tuple(axes)
    except TypeError:
        axes = ()
    if not axes or not all(isinstance(a, str) and a for a in axes):
        raise TypeError(
            f"`{name}` must be None, a mesh axis name or a tuple of them, "
            f"got {value!r}."
        )
    return axes


def optimizer(value: Any, name: str) -> None:
    """An optax optimizer (has ``init`` and ``update``), not its factory."""
    if hasattr(value, "init") and hasattr(value, "update"):
        return
    factory = getattr(value, "__name__", None)
    if callable(value) and factory:
        if _is_schedule(value):
            shown = factory if factory.isidentifier() else "schedule"
            raise TypeError(
                f"`{name}` is a schedule (`{factory}` returns a number for a step "
                "count), not an optimizer: a learning-rate schedule belongs inside "
                f"the optimizer, e.g. `optax.adamw(learning_rate={shown})`, where "
                "its count counts updates, not micro-steps."
            )
        raise TypeError(
            f"`{name}` is the function `{factory}`, not an optimizer: call it, "
            f"e.g. `{factory}(learning_rate)`, and pass what it returns."
        )
    raise TypeError(
        f"`{name}` must be an optax GradientTransformation (with `init` and "
        f"`update`), got {value!r}."
    )


def _is_schedule(fn: Any) -> bool:
    """Whether ``fn(0)`` is a real number (an optax schedule of the count), as
    opposed to an optimizer's factory, which returns a transformation."""
    try:
        out = fn(0)
    except Exception:  # not a function of one count
        return False
    dtype = getattr(out, "dtype", None)
    if dtype is None:
        return isinstance(out, int | float) and not isinstance(out, bool)
    return getattr(out, "shape", None) == () and jnp.issubdtype(dtype, jnp.number)


def real_scalar_loss(value: Any, of: str = "") -> None:
    """Refuses a loss that `jax.grad` could not differentiate: not a real
    floating scalar. ``of`` says what it is the loss of (" for one example")."""
    dtype = getattr(value, "dtype", None)
    if (
        jnp.shape(value) != ()
        or dtype is None
        or not jnp.issubdtype(dtype, jnp.floating)
    ):
        raise TypeError(
            f"the loss must return a real floating scalar{of} (as jax.grad "
            f"requires), got shape {jnp.shape(value)} and dtype {dtype}."
        )
