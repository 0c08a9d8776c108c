# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`update_count`: the number of optimizer updates, read the same way from
every face's state.

Each face counts in its own place: `accumulate` (and `dp_accumulate`, and
`offload` inside either) in ``AccumulateState.update_step``, `MultiSteps` and
``optax.MultiSteps`` in ``gradient_step``, and a fused step (`microbatch`
then one optimizer update, ``nnx_train_step``, ``linen_train_step``) in the
Flax object's ``step``, which counts calls of ``update``. That last ``step``
counts micro-steps when the optimizer accumulates, so it cannot be the one
answer; this reader picks the right counter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ._accumulate import AccumulateState
from ._multisteps import MultiStepsState

_STATES = (AccumulateState, MultiStepsState, optax.MultiStepsState)


def update_count(state: Any) -> jax.Array:
    """The number of optimizer updates made so far, as an int32 scalar.

    One reader for every face. It looks through ``optax.chain``'s tuples,
    ``optax.inject_hyperparams``, Flax's variable wrappers and a linen
    ``TrainState``, and reads:

    - `accumulate`, `dp_accumulate` and `offload` inside either:
      ``AccumulateState.update_step``;
    - `MultiSteps`, and an ``optax.MultiSteps`` state (restored ones too):
      ``gradient_step``;
    - a fused step's ``nnx.Optimizer`` or linen ``TrainState`` (`microbatch`
      or ``nnx_train_step``/``linen_train_step``, one ``update`` per step),
      whose state holds no accumulation state: its ``step``.

    ``nnx.Optimizer.step`` and ``TrainState.step`` count calls of ``update``:
    micro-steps when the optimizer accumulates, so pass the object (or its
    ``opt_state``) here rather than reading ``step``.

    Args:
      state: an optimizer state, or an ``nnx.Optimizer`` or a linen
        ``TrainState`` (anything with ``opt_state`` and ``step``).

    Returns:
      An int32 scalar array; it works under ``jax.jit``.

    Raises:
      ValueError: if ``state`` holds no accumulation state (and is not an
        object with ``step`` and ``opt_state``), or holds several; the message
        names what it found.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> tx = optax.chain(optax_accum.accumulate(optax.adam(1e-3), 2))
      >>> params = {"w": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> for _ in range(5):
      ...     _, state = tx.update({"w": jnp.ones(2)}, state, params)
      >>> optax_accum.update_count(state)
      Array(2, dtype=int32)
    """
    holder = _opt_state_holder(state)
    tree = state.opt_state if holder else state
    found = _states_in(tree)
    if len(found) == 1 and not _states_in(_inner(found[0])):
        return _int32(_counter(found[0]))
    if not found and holder:
        return _int32(state.step)
    raise ValueError(_message(state, found))


def _opt_state_holder(state: Any) -> bool:
    """An ``nnx.Optimizer`` or a linen ``TrainState``: ``step`` and ``opt_state``."""
    return (
        not isinstance(state, tuple | list | dict)
        and hasattr(state, "opt_state")
        and hasattr(state, "step")
    )


# An accumulation state as ``nnx.state(optimizer)`` (what Orbax saves for nnx)
# holds it: a mapping of its fields, by their names. Fields that are ``()``
# are not there, so only the two counters identify it.
_FIELDS = {
    ("micro_step", "update_step"): "update_step",
    ("mini_step", "gradient_step"): "gradient_step",
}


def _is_state(x: Any) -> bool:
    if isinstance(x, _STATES):
        return True
    return isinstance(x, Mapping) and any(all(k in x for k in f) for f in _FIELDS)


def _states_in(tree: Any) -> list[Any]:
    return [x for x in jax.tree.leaves(tree, is_leaf=_is_state) if _is_state(x)]


def _counter(node: Any) -> Any:
    if isinstance(node, AccumulateState):
        return node.update_step
    if isinstance(node, _STATES):
        return node.gradient_step
    return next(node[c] for f, c in _FIELDS.items() if all(k in node for k in f))


def _inner(node: Any) -> Any:
    """The wrapped optimizer's state, where a nested accumulation would be."""
    for name in ("inner_state", "inner_opt_state"):
        if isinstance(node, Mapping):
            if name in node:
                return node[name]
        elif hasattr(node, name):
            return getattr(node, name)
    return ()


def _int32(x: Any) -> Any:
    # flax nnx wraps optimizer-state arrays (and ``Optimizer.step``) in
    # Variables.
    value = x.get_value() if hasattr(x, "get_value") else x
    if isinstance(value, jax.ShapeDtypeStruct):  # an abstract (restore) target
        return jax.ShapeDtypeStruct((), jnp.int32)
    return jnp.asarray(value).astype(jnp.int32)


def _message(state: Any, found: list[Any]) -> str:
    wanted = "AccumulateState, MultiStepsState or optax.MultiStepsState"
    if found:
        nested = [y for x in found for y in _states_in(_inner(x))]
        names = ", ".join(type(x).__name__ for x in found + nested)
        return (
            f"`state` must hold one accumulation state ({wanted}); found "
            f"{len(found) + len(nested)}: {names}"
            + (" (one inside another)" if nested else "")
            + ". Nested accumulation has no single update count: pass the "
            "state of the wrapper you mean."
        )
    nodes = _node_names(state)
    return (
        f"`state` holds no accumulation state ({wanted}); found "
        f"{type(state).__name__}" + (f" holding {nodes}" if nodes else "") + ". "
        "A fused step's optimizer state counts no updates: pass the "
        "`nnx.Optimizer` or the linen `TrainState`, whose `step` counts them."
    )


def _node_names(state: Any) -> str:
    """The NamedTuple states directly inside ``state`` (for the message)."""
    is_state = lambda x: isinstance(x, tuple) and hasattr(x, "_fields")
    names = []
    for node in jax.tree.leaves(state, is_leaf=is_state):
        if is_state(node) and type(node).__name__ not in names:
            names.append(type(node).__name__)
    return ", ".join(names[:6])
