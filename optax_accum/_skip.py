# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Skipping micro-batches: the `SkipFn` protocol, its checks, ready-made ones.

They follow optax's ``ShouldSkipUpdateFunction`` convention: called as
``fn(grads, step, params)``, a skip function returns ``should_skip`` or
``(should_skip, skip_state)``.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax


class SkipFn(Protocol):
    """Decides whether a micro-batch's gradients are rejected.

    Called as ``skip_fn(grads, update_step, params)``. Returns a boolean scalar
    (``True`` rejects the micro-batch), or an optax-style tuple
    ``(should_skip, skip_state)`` whose second element is stored in the state.
    """

    def __call__(
        self, grads: optax.Updates, update_step: jax.Array, params: optax.Params | None
    ) -> jax.Array | tuple[jax.Array, Any]: ...


def check(skip_fn: Any, name: str) -> None:
    """Rejects a non-callable, or a skip-function factory passed uncalled."""
    if skip_fn is None:
        return
    if skip_fn is skip_large_updates:
        raise TypeError(
            f"`{name}` is the factory `skip_large_updates`, not a skip function: "
            "call it: skip_large_updates(max_norm)."
        )
    if not callable(skip_fn):
        raise TypeError(f"`{name}` must be callable or None, got {skip_fn!r}.")
    try:
        inspect.signature(skip_fn).bind(None, None, None)
    except TypeError:
        raise TypeError(
            f"`{name}` must take (grads, step, params), got {skip_fn!r} with "
            f"signature {inspect.signature(skip_fn)}."
        ) from None
    except ValueError:  # no signature (a builtin): trust it
        pass


def decider(skip_fn: SkipFn | None, name: str) -> Any:
    """``skip_fn`` with its result checked (in the caller's ``name`` for it)
    and normalised to ``(should_skip, skip_state)``; None stays None."""
    if skip_fn is None:
        return None

    def decide(grads: Any, update_step: jax.Array, params: Any):
        return decision(skip_fn(grads, update_step, params), name)

    return decide


def decision(result: Any, name: str) -> tuple[jax.Array, Any]:
    """Accepts ``flag`` or optax's ``(flag, skip_state)``; checks ``flag``."""
    if isinstance(result, tuple) and len(result) == 2:
        flag, skip_state = result
    else:
        flag, skip_state = result, ()
    dtype = getattr(flag, "dtype", None)
    if dtype is None or dtype != jnp.bool_ or np.ndim(flag) != 0:
        raise TypeError(
            f"`{name}` must return a boolean scalar (or a tuple of one and a "
            f"pytree), got {flag!r}."
        )
    return jnp.asarray(flag), skip_state


def skip_not_finite(
    grads: optax.Updates, step: jax.typing.ArrayLike, params: optax.Params | None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Rejects a micro-batch whose gradients contain a NaN or an infinity.

    Args:
      grads: the micro-batch's gradients.
      step: the update step (unused).
      params: the parameters (unused).

    Returns:
      ``(should_skip, {"should_skip": ..., "num_not_finite": ...})``.

    Examples:
      >>> import jax.numpy as jnp, optax_accum
      >>> grads = {"w": jnp.array([1.0, jnp.nan])}
      >>> skip, info = optax_accum.skip_not_finite(grads, 0, None)
      >>> bool(skip), int(info["num_not_finite"])
      (True, 1)
    """
    del step, params
    counts = [
        jnp.sum(~jnp.isfinite(g)).astype(jnp.int32) for g in jax.tree.leaves(grads)
    ]
    num = sum(counts, jnp.zeros([], jnp.int32))
    should_skip = num > 0
    return should_skip, {"should_skip": should_skip, "num_not_finite": num}


def skip_large_updates(max_norm: jax.typing.ArrayLike) -> Any:
    """Returns a ``skip_fn`` rejecting gradients whose global norm exceeds ``max_norm``.

    A NaN or infinite norm is rejected too.

    Args:
      max_norm: the largest accepted global L2 norm, > 0.

    Returns:
      A callable ``(grads, step, params) -> (should_skip, skip_state)`` with
      ``skip_state = {"should_skip": ..., "norm": ...}``.

    Raises:
      ValueError: if ``max_norm`` is not a positive scalar.

    Examples:
      >>> import jax.numpy as jnp, optax_accum
      >>> fn = optax_accum.skip_large_updates(1.0)
      >>> bool(fn({"w": jnp.array([3.0, 4.0])}, 0, None)[0])
      True
    """
    if np.ndim(max_norm) != 0 or not float(max_norm) > 0:
        raise ValueError(f"`max_norm` must be a positive scalar, got {max_norm!r}.")

    def skip_fn(grads, step, params):
        del step, params
        norm = optax.tree.norm(grads).astype(jnp.float32)
        should_skip = jnp.logical_not(norm <= max_norm)
        return should_skip, {"should_skip": should_skip, "norm": norm}

    return skip_fn
