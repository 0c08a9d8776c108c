# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The learning rate for an accumulated batch: `scale_learning_rate`.

Accumulating ``k`` micro-batches multiplies the effective batch size by ``k``;
this module owns the rules that rescale a learning rate tuned at another batch
size. (A growing batch size is an ``every_k`` schedule: see `_schedules`.)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _checks

RULES = ("linear", "sqrt")


def _check_learning_rate(learning_rate: Any) -> None:
    if callable(learning_rate):
        return
    _checks.real_scalar(
        learning_rate,
        "learning_rate",
        what="a real scalar or an optax schedule (a callable of the step count)",
        shape_error=TypeError,
        bool_ok=False,
    )
    _checks.finite_nonnegative(learning_rate, "learning_rate", arrays=True)


def scale_learning_rate(
    learning_rate: float | jax.typing.ArrayLike | optax.Schedule,
    base_batch_size: int,
    batch_size: int,
    rule: str = "linear",
) -> Any:
    r"""Rescales a learning rate tuned at ``base_batch_size`` for ``batch_size``.

    With ``k`` accumulated micro-batches of ``b`` examples, ``batch_size`` is
    the effective batch ``k * b``. The two usual rules:

    .. math::

        \eta = \eta_0 \frac{B}{B_0} \quad (\text{linear}), \qquad
        \eta = \eta_0 \sqrt{\frac{B}{B_0}} \quad (\text{sqrt}).

    The linear rule (Goyal et al. 2017, "Accurate, Large Minibatch SGD") keeps
    SGD's expected progress per example constant; it usually needs a warm-up
    and breaks down at very large batches. The square-root rule keeps the
    variance of the update constant and is the common starting point for Adam
    and other adaptive optimizers (Hoffer et al. 2017; Malladi et al. 2022).
    Both are starting points for tuning, not guarantees.

    Args:
      learning_rate: the tuned learning rate, a real scalar >= 0, or an optax
        schedule (a callable of the step count).
      base_batch_size: the batch size ``learning_rate`` was tuned at, an int >= 1.
      batch_size: the new (effective) batch size, an int >= 1, or a traced
        int32 scalar inside ``jit`` (a batch that follows `adaptive_every_k`).
      rule: ``"linear"`` or ``"sqrt"``.

    Returns:
      The scaled learning rate: a float for a Python number, an array for an
      array, or, for a schedule, a schedule whose values are scaled.

    Raises:
      TypeError: for a non-numeric ``learning_rate`` or non-integer batch sizes.
      ValueError: for a negative or non-finite ``learning_rate``, batch sizes
        below 1, or an unknown ``rule``.

    Examples:
      >>> import optax, optax_accum
      >>> optax_accum.scale_learning_rate(0.1, base_batch_size=256, batch_size=1024)
      0.4
      >>> optax_accum.scale_learning_rate(1e-3, 64, 256, rule="sqrt")
      0.002
      >>> schedule = optax_accum.scale_learning_rate(
      ...     optax.linear_schedule(0.0, 0.5, transition_steps=10), 256, 512)
      >>> float(schedule(10))
      1.0
    """
    _check_learning_rate(learning_rate)
    base_batch_size = _checks.positive_int(base_batch_size, "base_batch_size")
    traced = isinstance(batch_size, jax.core.Tracer)
    if traced:
        # A batch size that changes during training (adaptive_every_k's k
        # times the micro-batch size), inside jit: checked for type only.
        if not jnp.issubdtype(batch_size.dtype, jnp.integer) or batch_size.ndim:
            raise TypeError(
                f"`batch_size` must be an integer scalar, got {batch_size!r}."
            )
    else:
        batch_size = _checks.positive_int(batch_size, "batch_size")
    if rule not in RULES:
        raise ValueError(f"`rule` must be one of {RULES}, got {rule!r}.")
    if traced:
        ratio = batch_size.astype(jnp.float32) / base_batch_size
        factor = ratio if rule == "linear" else jnp.sqrt(ratio)
    else:
        ratio = batch_size / base_batch_size
        factor = ratio if rule == "linear" else math.sqrt(ratio)

    if callable(learning_rate):
        schedule = learning_rate

        def scaled_schedule(count: jax.typing.ArrayLike) -> jax.typing.ArrayLike:
            return schedule(count) * factor

        return scaled_schedule
    if isinstance(learning_rate, int | float | np.number) and not traced:
        return float(learning_rate) * factor
    return jnp.asarray(learning_rate) * factor
