# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Reading states from outside: `find_state`, `has_updated`, `noise_scale`.

A state of ours usually sits inside something else: ``optax.chain``'s tuple,
``nnx.Optimizer.opt_state`` (whose arrays Flax wraps in variables), a
``TrainState``. These readers look through all of that.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from .. import _checks
from .._noise_scale import NoiseScale, NoiseScaleState, b_simple, debiased
from ._accumulate import AccumulateState
from ._multisteps import MultiStepsState, emitted


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
      A boolean scalar: False after a micro-batch that the skip function
      rejected, even right after an update. (Of optax's own
      ``MultiStepsState`` only optax's test can be read, ``mini_step == 0``
      after an update, which a rejected mini-step leaves as it was.)

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
    return emitted(found)


def _value(x: Any) -> jax.Array:
    # flax nnx wraps optimizer-state arrays in Variables.
    return jnp.asarray(x.get_value() if hasattr(x, "get_value") else x)


def noise_scale(state: Any, microbatch_size: int | None = None) -> NoiseScale:
    r"""Reads the gradient noise scale from an optimizer state.

    .. math::

        B_\text{simple} = \frac{\mathrm{EMA}(S)}{\mathrm{EMA}(|G|^2)},\quad
        |G|^2 \approx \frac{B_\text{big} |G_\text{big}|^2
            - B_\text{small} |G_\text{small}|^2}{B_\text{big} - B_\text{small}},
        \quad S \approx \frac{|G_\text{small}|^2 - |G_\text{big}|^2}
            {1/B_\text{small} - 1/B_\text{big}}.

    Batch sizes count units of ``weight``: for `accumulate` and `MultiSteps`,
    micro-batches when no weight is passed (each weighs 1), tokens with token
    weighting. Pass ``microbatch_size`` (examples per micro-batch, per device)
    to count examples instead: ``b_simple``, ``trace_sigma``, ``b_small`` and
    ``b_big`` are then multiplied by it. `microbatch`'s tracker already counts
    rows (or the ``weight_fn`` weights): read it without ``microbatch_size``.

    Args:
      state: the state of `accumulate` or `MultiSteps` built with
        ``noise_scale_decay``, or any state that holds exactly one (an
        ``optax.chain`` tuple, an ``nnx.Optimizer``'s ``opt_state``).
      microbatch_size: optional examples per unit of weight, an int >= 1.

    Returns:
      A `NoiseScale`.

    Raises:
      ValueError: if ``state`` holds no noise-scale state, or several, or for
        ``microbatch_size`` < 1.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> tx = optax_accum.accumulate(optax.sgd(0.1), 2, noise_scale_decay=0.5)
      >>> params = {"w": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> for g in ([1.0, 1.0], [3.0, 1.0]):
      ...     _, state = tx.update({"w": jnp.array(g)}, state, params)
      >>> ns = optax_accum.noise_scale(state, microbatch_size=8)
      >>> float(ns.grad_sq), float(ns.trace_sigma), float(ns.b_simple)
      (4.0, 16.0, 4.0)
    """
    scale = (
        1
        if microbatch_size is None
        else _checks.positive_int(microbatch_size, "microbatch_size")
    )
    try:
        found = find_state(state, NoiseScaleState)
    except ValueError as e:
        raise ValueError(
            f"{e} Build the optimizer with `noise_scale_decay` to measure it."
        ) from None
    s = NoiseScaleState(*(_value(x) for x in found))
    return NoiseScale(
        b_simple=b_simple(s) * scale,
        trace_sigma=debiased(s.trace_ema, s) * scale,
        grad_sq=debiased(s.grad_sq_ema, s),
        windows=s.windows,
        b_small=s.b_small * scale,
        b_big=s.b_big * scale,
        k=s.k,
    )
