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

This module owns those rules, the check that finds out at ``init`` whether
the optimizer reads ``value`` at all (only then does the state get the slot),
and the split of the extra args into arrays (operands of the boundary's
``lax.cond``) and the rest (closed over).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from . import _checks


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


class WindowArgs(NamedTuple):
    """One call's extra args, read for the window.

    Attributes:
      value: the micro-batch's ``value``, when the window accumulates one.
      pass_grad: whether ``inner`` gets ``grad=`` (the window's gradient).
      dynamic: the other extra args that are array pytrees (cond operands).
      static: the rest (Python values), closed over.
    """

    value: jax.Array | None
    pass_grad: bool
    dynamic: dict[str, Any]
    static: dict[str, Any]


def read(
    extra_args: dict[str, Any], *, value_slot: bool, allow_value_fn: bool, owner: str
) -> WindowArgs:
    """Checks and splits one call's extra args; ``value_slot``: whether the
    state accumulates ``value``."""
    extra_args = dict(extra_args)
    if "value_fn" in extra_args and not allow_value_fn:
        raise ValueError(
            f"`value_fn` was passed to {owner}'s update. A line search calls it "
            "at trial points; if it computes one micro-batch's loss, the search "
            "is not the large-batch step (the accumulated `value` and `grad` "
            "describe the whole window). If your `value_fn` computes the loss of "
            f"the whole window (all micro-batches), build {owner} with "
            "`allow_value_fn=True`."
        )
    value = None
    if value_slot and "value" in extra_args:
        value = extra_args.pop("value")
        _checks.real_scalar(
            value,
            "value",
            what="a real number (the loss passed to update)",
            string_error=ValueError,
        )
        value = jnp.asarray(value)
    pass_grad = extra_args.pop("grad", None) is not None
    dynamic, static = {}, {}
    for key, arg in extra_args.items():
        leaves = jax.tree.leaves(arg)
        if leaves and all(isinstance(x, jax.Array) for x in leaves):
            dynamic[key] = arg
        else:
            static[key] = arg
    return WindowArgs(value, pass_grad, dynamic, static)


def for_inner(args: WindowArgs, dynamic: dict, grad: Any, value: Any) -> dict:
    """The keyword arguments ``inner.update`` gets for the window: the
    window's ``grad`` and ``value`` where the call passed them."""
    kwargs = {**args.static, **dynamic}
    if args.pass_grad:
        kwargs["grad"] = grad
    if args.value is not None:
        kwargs["value"] = value.astype(args.value.dtype)
    return kwargs
