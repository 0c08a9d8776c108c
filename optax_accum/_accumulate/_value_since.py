# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The value slot of a window restored without one (`MultiSteps`).

An ``optax.MultiSteps`` checkpoint holds no ``value`` slot: optax passes each
mini-step's value to the inner optimizer and keeps none. Restored mid-window
into our `MultiSteps`, whose inner optimizer reads the window's value, the
values already seen are gone, so the window's value is the mean (or sum, as
the gradients) of the values seen since the restore. That needs their count,
which a window whose slot was there from its start reads off ``mini_step``;
`ValueSince` carries it, and from then on restarts it with each window.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class ValueSince(NamedTuple):
    """A window's value and the number of values it holds.

    Attributes:
      value: the mean (or sum) of the window's values since the restore.
      count: how many values that is (accepted mini-steps since then).
    """

    value: jax.Array
    count: jax.Array


def empty(dtype: Any) -> ValueSince:
    """A slot that has seen no value (right after a restore)."""
    return ValueSince(jnp.zeros([], dtype), jnp.zeros([], jnp.int32))


def add(
    slot: ValueSince, value: jax.Array, first: jax.Array, weight: jax.Array, reduction
) -> ValueSince:
    """``value`` into ``slot``; ``first``: the window starts with this call.

    ``weight`` is the mini-step's weight, 0 where it contributes nothing; the
    running mean weighs each accepted value equally (`MultiSteps`' unit
    weights), the sum adds it scaled by the weight, as the gradients.
    """
    seen = jnp.where(first, 0, slot.count)
    contributes = weight > 0
    count = seen + contributes.astype(jnp.int32)
    value = jnp.asarray(value, slot.value.dtype)
    coef = 1 / jnp.maximum(count, 1).astype(slot.value.dtype)
    written = jnp.where(
        seen == 0,
        reduction.first(value, weight).astype(slot.value.dtype),
        reduction.step(slot.value, value, coef, weight).astype(slot.value.dtype),
    )
    return ValueSince(jnp.where(contributes, written, slot.value), count)


def is_slot(slot: Any) -> bool:
    """Whether the window has a value slot (``()`` is none)."""
    return isinstance(slot, ValueSince) or not isinstance(slot, tuple)


def current(slot: Any) -> Any:
    """The window's value, as the inner optimizer reads it."""
    return slot.value if isinstance(slot, ValueSince) else slot
