# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""What the inner optimizer's extra arguments mean over a window.

An optimizer's ``update`` may take ``value`` (the loss: ``reduce_on_plateau``,
``polyak_sgd``, line searches), ``grad`` and ``value_fn`` (line searches such
as ``optax.lbfgs``). Over a window they must describe the large batch, not the
window's last micro-batch:

- ``value`` is accumulated like the gradients (same weights, same reduction),
  in a small slot of the state, and the window's value reaches the optimizer;
- ``grad`` is replaced by the accumulated gradient;
- ``value_fn`` evaluates trial points of a line search. The engine cannot know
  what data it closes over, so passing one raises unless the caller opts in,
  vouching that it computes the whole window's loss.

This module owns those rules, and the check that finds out at ``init`` whether
the optimizer reads ``value`` at all (only then does the state get the slot).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal


def _used_inputs(jaxpr: Any) -> set:
    """Variables read anywhere in ``jaxpr`` (outputs included, sub-jaxprs opaque)."""
    used = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    for eqn in jaxpr.eqns:
        used.update(v for v in eqn.invars if not isinstance(v, Literal))
    return used


def reads_value(tx: Any, params: Any, state: Any) -> bool:
    """Whether ``tx.update(..., value=v)`` depends on ``v``, by tracing it once.

    Any failure to trace with ``value`` alone (a line search also wants
    ``grad`` and ``value_fn``) counts as reading it. An operand passed to a
    nested call counts as read: the check errs on the side of a slot.
    """

    def update(grads, state, params, value):
        return tx.update(grads, state, params, value=value)

    try:
        closed = jax.make_jaxpr(update)(params, state, params, jnp.float32(0))
    except Exception:
        return True
    return closed.jaxpr.invars[-1] in _used_inputs(closed.jaxpr)


def value_dtype(params: Any) -> Any:
    """The value slot's dtype: float32, or float64 where parameters are."""
    dtype = jnp.dtype(jnp.float32)
    for x in jax.tree.leaves(params):
        x_dtype = jnp.result_type(x)
        if jnp.issubdtype(x_dtype, jnp.inexact):
            dtype = jnp.promote_types(dtype, jnp.finfo(x_dtype).dtype)
    return dtype


def check_value(value: Any) -> jax.Array:
    """``value`` as a real scalar array, or an error naming it."""
    if isinstance(value, str | bytes) or np.ndim(value) != 0:
        raise ValueError(
            "`value` (the loss passed to update) must be a scalar, got "
            f"shape {np.shape(value)}: {value!r}."
        )
    try:
        dtype = jnp.result_type(value)
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or not (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    ):
        raise TypeError(f"`value` must be a real number, got {value!r}.")
    return jnp.asarray(value)


def check_value_fn(extra_args: dict, allow: bool, owner: str) -> None:
    """Raises for a ``value_fn`` unless the caller opted in with ``allow``."""
    if "value_fn" in extra_args and not allow:
        raise ValueError(
            f"`value_fn` was passed to {owner}'s update. A line search calls it "
            "at trial points; if it computes one micro-batch's loss, the search "
            "is not the large-batch step (the accumulated `value` and `grad` "
            "describe the whole window). If your `value_fn` computes the loss of "
            f"the whole window (all micro-batches), build {owner} with "
            "`allow_value_fn=True`."
        )
