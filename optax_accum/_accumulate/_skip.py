# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Skipping micro-batches: the `SkipFn` protocol, its checks, ready-made ones.

They follow optax's ``ShouldSkipUpdateFunction`` convention: called as
``fn(grads, step, params)``, a skip function returns ``should_skip`` or
``(should_skip, skip_state)``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import _dtypes

if TYPE_CHECKING:
    from .._devices import Devices


class SkipFn(Protocol):
    """Decides whether a micro-batch's gradients are rejected.

    Called as ``skip_fn(grads, update_step, params)``. Returns a boolean scalar
    (``True`` rejects the micro-batch), or an optax-style tuple
    ``(should_skip, skip_state)`` whose second element is stored in the state.
    """

    # Positional-only, as the engine calls it: a skip function may name its
    # parameters as it likes (optax's name the second one ``step``).
    def __call__(
        self,
        grads: optax.Updates,
        update_step: jax.Array,
        params: optax.Params | None,
        /,
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


@dataclasses.dataclass(frozen=True)
class Decider:
    """A checked skip function, as the engine calls it; see `__call__`."""

    fn: SkipFn
    name: str  # the caller's name for it, in errors

    def __call__(
        self,
        grads: Any,
        update_step: jax.Array,
        params: Any,
        weight: jax.Array,
        devices: Devices,
    ) -> tuple[jax.Array, Any]:
        """``(should_skip, skip_state)`` for a micro-batch of (admitted)
        ``weight``, normalised and checked.

        Weight 0 contributes nothing and is no rejection, so it is not
        judged: a padding micro-batch's NaN gradient does not shift the
        window. `skip_large_updates` judges the micro-batch's whole gradient,
        over every device (`Devices.whole`); any other skip function judges
        what it is given, each device's own gradient under an axis name.
        """
        if isinstance(self.fn, _LargeUpdates):
            grads, weight = devices.whole(grads, weight)
        result = self.fn(grads, update_step, params)
        should_skip, skip_state = decision(result, self.name)
        return should_skip & (weight > 0), skip_state


def decider(skip_fn: SkipFn | None, name: str) -> Decider | None:
    """``skip_fn`` with its result checked (in the caller's ``name`` for it)
    and normalised to ``(should_skip, skip_state)``; None stays None."""
    return None if skip_fn is None else Decider(skip_fn, name)


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

    The norm judged is the micro-batch's gradient's in every mode: with
    ``accumulate(..., axis_name=...)``, the norm of the weighted mean of the
    devices' gradients, ``|sum_d w_d g_d / sum_d w_d|`` (a device of weight 0
    left out), as the global view's ``jax.grad`` of the whole micro-batch
    gives it, not each device's own norm. That costs one all-reduce of the
    gradients per micro-step under ``axis_name``; the devices then agree by
    construction. A NaN or infinite norm is rejected too; a micro-batch of
    weight 0 is never rejected. ``float0`` leaves (integer parameters) count
    as zero.

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
    return _LargeUpdates(max_norm)


@dataclasses.dataclass(frozen=True)
class _LargeUpdates:
    """`skip_large_updates`' skip function (the engine knows it by its type:
    it judges the whole micro-batch's gradient)."""

    max_norm: Any

    def __repr__(self) -> str:
        return f"skip_large_updates({self.max_norm!r})"

    def __call__(self, grads: Any, step: Any, params: Any):
        del step, params
        leaves = [g for g in jax.tree.leaves(grads) if not _dtypes.is_float0(g)]
        norm = optax.tree.norm(leaves).astype(jnp.float32)
        should_skip = jnp.logical_not(norm <= self.max_norm)
        return should_skip, {"should_skip": should_skip, "norm": norm}
