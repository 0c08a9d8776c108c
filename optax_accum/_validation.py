# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Argument checks shared by the public factories.

Every check raises at construction or trace time with a message that names the
argument and the value, so bad input never turns into a silently wrong update.
"""

from __future__ import annotations

import inspect
import operator
import sys
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


PROMOTE = "promote"


def canonical_accumulator_dtype(dtype: Any) -> Any:
    """Returns a canonical dtype, ``"promote"``, or None ('the gradient's dtype')."""
    if dtype is None or (isinstance(dtype, str) and dtype == PROMOTE):
        return dtype
    message = (
        "`accumulator_dtype` must be a floating dtype (or a complex one), "
        f'"{PROMOTE}" or None, got {dtype!r}.'
    )
    try:
        canonical = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(message) from e
    if not jnp.issubdtype(canonical, jnp.inexact):
        raise TypeError(message)
    return canonical


def accumulator_dtype_for(grad_dtype: Any, spec: Any) -> Any:
    """The accumulator dtype for a gradient leaf, from a canonical ``spec``.

    ``"promote"`` never loses information: at least float32, of the gradient's
    own kind (complex stays complex, float64 stays float64). An explicit real
    dtype for a complex gradient would drop the imaginary part, so it raises.
    """
    grad_dtype = jnp.dtype(grad_dtype)
    if spec is None:
        return grad_dtype
    if isinstance(spec, str):
        return jnp.promote_types(grad_dtype, jnp.float32)
    if jnp.issubdtype(grad_dtype, jnp.complexfloating) and not jnp.issubdtype(
        spec, jnp.complexfloating
    ):
        raise TypeError(
            f"`accumulator_dtype`={spec} would drop the imaginary part of "
            f"{grad_dtype} gradients: pass a complex dtype, "
            f'"{PROMOTE}" (the default) or None.'
        )
    return spec


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer) and not isinstance(x, jax.Array)


def check_weight(weight: Any) -> jax.Array:
    """Returns the micro-batch weight as a float32 scalar.

    A Python or NumPy constant that is negative or not finite raises; a traced
    bad weight is rejected at run time by the engine (see `weight_ok`).
    """
    if weight is None:
        return jnp.ones([], jnp.float32)
    if isinstance(weight, str | bytes):
        raise TypeError(f"`weight` must be a real number, got {weight!r}.")
    if np.ndim(weight) != 0:
        raise ValueError(
            f"`weight` must be a scalar, got shape {np.shape(weight)}: {weight!r}."
        )
    try:
        dtype = jnp.result_type(weight)
    except (TypeError, ValueError):
        raise TypeError(f"`weight` must be a real number, got {weight!r}.") from None
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"`weight` must be a real number, got dtype {dtype}.")
    if _is_concrete(weight) and not (np.isfinite(weight) and weight >= 0):
        raise ValueError(f"`weight` must be finite and >= 0, got {weight!r}.")
    return jnp.asarray(weight, jnp.float32)


def weight_ok(w: jax.Array) -> jax.Array:
    """Whether a (traced) weight is usable: finite and >= 0."""
    return jnp.logical_and(jnp.isfinite(w), w >= 0)


def check_close_window(close_window: Any) -> jax.Array:
    """Returns ``close_window`` as a boolean scalar, or raises naming it."""
    if isinstance(close_window, str | bytes) or np.ndim(close_window) != 0:
        raise ValueError(
            "`close_window` must be a boolean scalar, got "
            f"shape {np.shape(close_window)}: {close_window!r}."
        )
    try:
        dtype = jnp.result_type(close_window)
    except (TypeError, ValueError):
        dtype = None
    if dtype != jnp.bool_:
        raise TypeError(
            f"`close_window` must be a boolean scalar, got {close_window!r}."
        )
    return jnp.asarray(close_window)


def check_skip_fn(skip_fn: Any, arg: str) -> None:
    """Rejects a non-callable, or a skip-function factory passed uncalled."""
    if skip_fn is None:
        return
    from ._skip import skip_large_updates

    if skip_fn is skip_large_updates:
        raise TypeError(
            f"`{arg}` is the factory `skip_large_updates`, not a skip function: "
            "call it: skip_large_updates(max_norm)."
        )
    if not callable(skip_fn):
        raise TypeError(f"`{arg}` must be callable or None, got {skip_fn!r}.")
    try:
        inspect.signature(skip_fn).bind(None, None, None)
    except TypeError:
        raise TypeError(
            f"`{arg}` must take (grads, step, params), got {skip_fn!r} with "
            f"signature {inspect.signature(skip_fn)}."
        ) from None
    except ValueError:  # no signature (a builtin): trust it
        pass


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


def _describe(x: Any) -> str:
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of length {len(x)}"
    shape = getattr(x, "shape", None)
    if shape is not None:
        return f"an array of shape {tuple(shape)}"
    return f"a {type(x).__name__}"


def check_fun_output(out: Any, has_aux: bool) -> None:
    """Checks ``microbatch``'s ``fun`` returned ``(value, grads)`` as declared."""
    expected = "((value, aux), grads)" if has_aux else "(value, grads)"
    hint = ""
    if not (isinstance(out, tuple | list) and len(out) == 2):
        if getattr(out, "shape", None) == ():
            hint = (
                " It returned a scalar: pass a value-and-grad function, e.g. "
                "jax.value_and_grad(loss), not the loss."
            )
        else:
            hint = (
                " Gradients alone? Pass jax.value_and_grad(loss), not jax.grad(loss)."
            )
        raise TypeError(f"`fun` must return {expected}, got {_describe(out)}.{hint}")
    first = out[0]
    first_is_pair = isinstance(first, tuple | list) and len(first) == 2
    if has_aux and not first_is_pair:
        raise TypeError(
            f"`fun` must return ((value, aux), grads) with `has_aux=True`, but "
            f"its first output is {_describe(first)}, not a (value, aux) pair: "
            "pass has_aux=False, or use jax.value_and_grad(loss, has_aux=True)."
        )
    if not has_aux and first_is_pair:
        raise TypeError(
            "`fun` must return (value, grads) with `has_aux=False`, but its value "
            f"is {_describe(first)}: if `fun` returns ((value, aux), grads), pass "
            "has_aux=True."
        )


def check_no_nnx_modules(args: Any) -> None:
    """Flax nnx modules cannot cross `microbatch`'s scan as arguments."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return
    is_module = lambda x: isinstance(x, nnx.Module)
    if any(is_module(x) for x in jax.tree.leaves(args, is_leaf=is_module)):
        raise TypeError(
            "`microbatch` got a flax.nnx Module as an argument; nnx modules are "
            "mutable objects, not arrays, and cannot be sliced per micro-batch "
            "inside `lax.scan`. Use optax_accum.flax.nnx_train_step(loss_fn, k), "
            "which splits the model into arrays (and threads its state), or pass "
            "nnx.split(model)'s arrays to a function that merges them."
        )
