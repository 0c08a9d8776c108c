# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Learning rate and batch size: `scale_learning_rate` and `batch_size_warmup`.

Accumulating ``k`` micro-batches multiplies the effective batch size by ``k``;
this module owns the two knobs that go with that: the learning-rate scaling
rules, and a growing batch size expressed as an ``every_k`` schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._validation import check_positive_int

RULES = ("linear", "sqrt")


def _check_learning_rate(learning_rate: Any) -> None:
    if callable(learning_rate):
        return
    if isinstance(learning_rate, bool) or np.ndim(learning_rate) != 0:
        raise TypeError(
            "`learning_rate` must be a real scalar or an optax schedule (a "
            f"callable of the step count), got {learning_rate!r}."
        )
    try:
        dtype = jnp.result_type(learning_rate)
    except TypeError as e:
        raise TypeError(
            "`learning_rate` must be a real scalar or an optax schedule (a "
            f"callable of the step count), got {learning_rate!r}."
        ) from e
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(
            f"`learning_rate` must be a real scalar, got dtype {dtype}: "
            f"{learning_rate!r}."
        )
    if isinstance(learning_rate, jax.core.Tracer):
        return
    value = float(learning_rate)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(
            f"`learning_rate` must be finite and >= 0, got {learning_rate!r}."
        )


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
    base_batch_size = check_positive_int(base_batch_size, "base_batch_size")
    traced = isinstance(batch_size, jax.core.Tracer)
    if traced:
        # A batch size that changes during training (adaptive_every_k's k
        # times the micro-batch size), inside jit: checked for type only.
        if not jnp.issubdtype(batch_size.dtype, jnp.integer) or batch_size.ndim:
            raise TypeError(
                f"`batch_size` must be an integer scalar, got {batch_size!r}."
            )
    else:
        batch_size = check_positive_int(batch_size, "batch_size")
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


def batch_size_warmup(
    micro_batch_size: int,
    init_batch_size: int,
    batch_size: int,
    warmup_updates: int,
) -> Callable[[jax.typing.ArrayLike], jax.Array]:
    r"""An ``every_k`` schedule that grows the effective batch size.

    The number of micro-batches per update rises linearly, in whole steps, from
    ``init_batch_size / micro_batch_size`` to ``batch_size / micro_batch_size``
    over the first ``warmup_updates`` updates, then stays there:

    .. math::

        k(t) = k_0 + \left\lfloor (k_1 - k_0)
            \frac{\min(t, T)}{T} \right\rfloor .

    Pass it as ``every_k`` to `accumulate` (or ``every_k_schedule`` to
    `MultiSteps`). ``t`` is the update step, which only changes at window
    boundaries, so every window has one size and the schedule is traced: no
    recompilation as the batch grows. Small early batches make quick progress
    while the loss is high (Smith et al. 2018, "Don't Decay the Learning Rate,
    Increase the Batch Size"); to keep the linear rule while the batch grows,
    pair it with a learning rate of ``base_lr * k(t) / k_1`` via
    ``optax.inject_hyperparams`` or a schedule.

    Args:
      micro_batch_size: examples per micro-batch, an int >= 1.
      init_batch_size: effective batch size of the first update, a multiple of
        ``micro_batch_size``.
      batch_size: effective batch size after the warm-up, a multiple of
        ``micro_batch_size``.
      warmup_updates: number of updates over which the batch grows, >= 1.

    Returns:
      A callable ``update_step -> k`` returning an int32 scalar.

    Raises:
      TypeError: if an argument is not an integer.
      ValueError: if an argument is below 1 or a batch size is not a multiple
        of ``micro_batch_size``.

    Examples:
      >>> import optax, optax_accum
      >>> every_k = optax_accum.batch_size_warmup(
      ...     micro_batch_size=32, init_batch_size=32, batch_size=128,
      ...     warmup_updates=3)
      >>> [int(every_k(t)) for t in range(5)]
      [1, 2, 3, 4, 4]
      >>> tx = optax_accum.accumulate(optax.adam(1e-3), every_k=every_k)
    """
    micro = check_positive_int(micro_batch_size, "micro_batch_size")
    init = check_positive_int(init_batch_size, "init_batch_size")
    final = check_positive_int(batch_size, "batch_size")
    warmup = check_positive_int(warmup_updates, "warmup_updates")
    for name, value in (("init_batch_size", init), ("batch_size", final)):
        if value % micro:
            raise ValueError(
                f"`{name}` must be a multiple of `micro_batch_size`={micro}, "
                f"got {value}."
            )
    k0, k1 = init // micro, final // micro

    def every_k(update_step: jax.typing.ArrayLike) -> jax.Array:
        t = jnp.minimum(jnp.asarray(update_step, jnp.int32), warmup)
        # Integer arithmetic: a float ramp could round a boundary differently
        # on different backends.
        return (k0 + ((k1 - k0) * t) // warmup).astype(jnp.int32)

    return every_k
