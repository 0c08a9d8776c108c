# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Reading states from outside: `has_updated` and `find_state`.

A state of ours usually sits inside something else: ``optax.chain``'s tuple,
``nnx.Optimizer.opt_state`` (whose arrays Flax wraps in variables), a
``TrainState``. These readers look through all of that.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from ._accumulate import AccumulateState
from ._multisteps import MultiStepsState


def find_state(state: Any, state_type: type | tuple[type, ...]) -> Any:
    """Returns the one node of type ``state_type`` inside ``state``.

    Use it to hand an inner optimizer's state to functions that expect it,
    such as ``optax.contrib.schedule_free_eval_params``, when the optimizer is
    wrapped in `accumulate` (its state is ``AccumulateState.inner_state``) or
    chained.

    Args:
      state: any optimizer state (a pytree), e.g. `accumulate`'s.
      state_type: the NamedTuple class to look for, or a tuple of classes.

    Returns:
      The node, as stored (arrays wrapped by Flax stay wrapped).

    Raises:
      ValueError: if ``state`` holds no node of that type, or several.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> from optax.contrib import ScheduleFreeState, schedule_free_eval_params
      >>> tx = optax_accum.accumulate(optax.contrib.schedule_free_sgd(0.1), 2)
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> sf_state = optax_accum.find_state(state, ScheduleFreeState)
      >>> schedule_free_eval_params(sf_state, params)["w"]
      Array([1., 1.], dtype=float32)
    """
    is_node = lambda x: isinstance(x, state_type)
    found = [x for x in jax.tree.leaves(state, is_leaf=is_node) if is_node(x)]
    if len(found) != 1:
        names = (
            state_type.__name__
            if isinstance(state_type, type)
            else " or ".join(t.__name__ for t in state_type)
        )
        raise ValueError(
            f"`state` must hold exactly one {names}, found {len(found)} in "
            f"{type(state).__name__}."
        )
    return found[0]


def has_updated(state: Any) -> jax.Array:
    """Whether the call that produced ``state`` emitted an update.

    Args:
      state: an `AccumulateState` or a `MultiStepsState` (ours or optax's), or
        any optimizer state that holds exactly one, e.g.
        ``optax.chain(accumulate(...), ...)``'s tuple or a Flax
        ``nnx.Optimizer``'s ``opt_state``.

    Returns:
      A boolean scalar.

    Raises:
      ValueError: if ``state`` holds none of these states, or several.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> tx = optax.chain(optax_accum.accumulate(optax.sgd(1.0), 1))
      >>> params = {"w": jnp.zeros(2)}
      >>> _, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
      >>> bool(optax_accum.has_updated(state))
      True
    """
    types = (AccumulateState, MultiStepsState, optax.MultiStepsState)
    try:
        found = find_state(state, types)
    except ValueError as e:
        raise ValueError(
            str(e).replace(
                " or ".join(t.__name__ for t in types),
                "AccumulateState or MultiStepsState",
            )
        ) from None
    if isinstance(found, AccumulateState):
        return jnp.asarray(found.updated)
    # optax's definition: right after an update the window is empty.
    mini_step, gradient_step = map(jnp.asarray, (found.mini_step, found.gradient_step))
    return jnp.logical_and(mini_step == 0, gradient_step > 0)
