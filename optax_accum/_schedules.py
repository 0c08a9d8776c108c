# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""How many micro-batches a window holds: ``every_k`` and its schedules.

``every_k`` is an int, a callable of the update step (traced, so a schedule
of k never recompiles), or `adaptive_every_k`, which the engine feeds with the
measured gradient noise scale. This module owns their checks, the k of the
current window, and the two ready-made schedules, `batch_size_warmup` and
`adaptive_every_k`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks


@dataclasses.dataclass(frozen=True)
class AdaptiveEveryK:
    """An ``every_k`` that the engine feeds with the noise scale; see
    `adaptive_every_k`."""

    min_k: int
    max_k: int
    init_k: int
    never_decrease: bool

    def next_k(self, b_simple: jax.Array, step_batch: jax.Array, k: jax.Array):
        """``clip(ceil(b_simple / step_batch), min_k, max_k)``, NaN-safe."""
        want = jnp.ceil(b_simple / step_batch)
        want = jnp.where(jnp.isnan(want), k.astype(jnp.float32), want)
        new = jnp.clip(want, self.min_k, self.max_k).astype(jnp.int32)
        return jnp.maximum(new, k) if self.never_decrease else new


EveryK = int | Callable[[jax.Array], jax.typing.ArrayLike] | AdaptiveEveryK


def check(every_k: Any, name: str) -> None:
    """Checks ``every_k`` at construction: an int >= 1 or a callable."""
    if not callable(every_k) and not isinstance(every_k, AdaptiveEveryK):
        _checks.positive_int(every_k, name)


def is_static_one(every_k: Any) -> bool:
    """Whether every window is a single micro-batch, known at construction."""
    return (
        not callable(every_k)
        and not isinstance(every_k, AdaptiveEveryK)
        and (int(np.asarray(every_k)) == 1)
    )


def _checked_k(k: Any, name: str) -> jax.Array:
    """The value a schedule returned: an integer scalar (>= 1 if constant)."""
    name = f"{name}(step)"
    dtype = getattr(k, "dtype", None)
    if dtype is None:
        if isinstance(k, bool) or not isinstance(k, int | np.integer):
            raise TypeError(f"`{name}` must return an integer, got {k!r}.")
    elif not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"`{name}` must return an integer, got dtype {dtype}.")
    if np.ndim(k) != 0:
        raise ValueError(f"`{name}` must return a scalar, got shape {np.shape(k)}.")
    constant = not isinstance(k, jax.core.Tracer)
    if constant and _checks.positive_int(k, name) > _INT32_MAX:
        raise ValueError(f"`{name}` must fit in int32, got {k}.")
    # A traced value below 1 is treated as 1.
    return jnp.maximum(jnp.asarray(k, jnp.int32), 1)


def k_of(every_k: EveryK, name: str) -> Callable[[jax.Array, Any], jax.Array]:
    """``(update_step, noise_state) -> k`` of the window that step opens; a
    schedule's value is checked in the caller's ``name`` for it."""
    if isinstance(every_k, AdaptiveEveryK):
        return lambda update_step, noise: _adaptive_k(every_k, noise, name)
    if callable(every_k):
        return lambda update_step, noise: _checked_k(every_k(update_step), name)
    k = int(np.asarray(every_k))
    return lambda update_step, noise: jnp.asarray(k, jnp.int32)


def _adaptive_k(every_k: AdaptiveEveryK, noise: Any, name: str) -> jax.Array:
    """The k the noise scale chose, once it is known that k can be measured.

    Without ``axis_name`` the window sums have no device slot (``()``, see
    `_devices.Devices.slot`): one device, where a window of one micro-batch
    measures nothing. A k of 1 would then never be left again, so refuse it.
    """
    if every_k.min_k == 1 and jnp.ndim(noise.sq_sum) == 0:
        raise ValueError(
            f"`{name}`=adaptive_every_k(min_k=1, ...) on one device (no "
            "`axis_name`): a window of one micro-batch measures no noise "
            "scale, so k would stay at 1 for good. Use `min_k` >= 2, or "
            "`axis_name` over two or more devices (they supply the small "
            "batches)."
        )
    return noise.k  # chosen by the noise scale


def adaptive_every_k(
    min_k: int,
    max_k: int,
    *,
    init_k: int | None = None,
    never_decrease: bool = False,
) -> AdaptiveEveryK:
    r"""An ``every_k`` that sizes each window from the measured noise scale.

    After each window, the next one gets

    .. math::

        k = \mathrm{clip}\left(\left\lceil \frac{B_\text{simple}}{b N}
            \right\rceil, k_\min, k_\max\right),

    with ``b`` the micro-batch size (the measured ``B_small``, in the same
    units as ``B_simple``: examples, or tokens with token weighting) and ``N``
    the devices under ``axis_name``: the effective batch ``k b N`` follows the
    critical batch size. The EMA of `accumulate`'s ``noise_scale_decay`` is the
    smoothing; ``never_decrease`` also keeps k from going down. k is traced
    and stored in the state (``NoiseScaleState.k``), so nothing recompiles
    and a checkpoint resumes the schedule. Pass it as ``every_k`` to
    `accumulate` (or ``every_k_schedule`` to `MultiSteps`) together with
    ``noise_scale_decay``.

    A window is measured only if it holds two or more micro-batches with a
    positive weight, over all devices. On one device (no ``axis_name``) that
    means ``min_k`` >= 2: with ``min_k=1`` the first window of one
    micro-batch would freeze the estimate, and k with it, so the first update
    raises. With ``axis_name`` over ``N`` >= 2 devices a window of one
    micro-batch per device measures, and ``min_k=1`` is fine.

    Args:
      min_k: smallest k, an int >= 1; >= 2 on one device.
      max_k: largest k, an int >= ``min_k``.
      init_k: k of the windows before the first estimate; ``min_k`` by
        default.
      never_decrease: if true, k never goes down.

    Returns:
      An `AdaptiveEveryK` to pass as ``every_k``.

    Raises:
      TypeError: for non-integer ``min_k``, ``max_k`` or ``init_k``.
      ValueError: for values below 1, ``max_k`` beyond int32, ``min_k >
        max_k``, or ``init_k`` outside ``[min_k, max_k]``; at the first update,
        for ``min_k=1`` on one device.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> every_k = optax_accum.adaptive_every_k(2, 16)
      >>> tx = optax_accum.accumulate(
      ...     optax.sgd(0.1), every_k, noise_scale_decay=0.9)
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> int(optax_accum.noise_scale(state).k)
      2
    """
    min_k = _checks.positive_int(min_k, "min_k")
    max_k = _checks.positive_int(max_k, "max_k")
    if max_k > _INT32_MAX:
        raise ValueError(f"`max_k` must fit in int32, got {max_k}.")
    if min_k > max_k:
        raise ValueError(
            f"`min_k` must be <= `max_k`, got min_k={min_k}, max_k={max_k}."
        )
    init_k = min_k if init_k is None else _checks.positive_int(init_k, "init_k")
    if not min_k <= init_k <= max_k:
        raise ValueError(
            f"`init_k` must be in [min_k, max_k] = [{min_k}, {max_k}], got {init_k}."
        )
    return AdaptiveEveryK(min_k, max_k, init_k, bool(never_decrease))


def batch_size_warmup(
    microbatch_size: int,
    init_batch_size: int,
    batch_size: int,
    warmup_steps: int,
) -> Callable[[jax.typing.ArrayLike], jax.Array]:
    r"""An ``every_k`` schedule that grows the effective batch size.

    The number of micro-batches per update rises linearly, in whole steps, from
    ``init_batch_size / microbatch_size`` to ``batch_size / microbatch_size``
    over the first ``warmup_steps`` updates, then stays there:

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
      microbatch_size: examples per micro-batch, an int >= 1.
      init_batch_size: effective batch size of the first update, a multiple of
        ``microbatch_size``.
      batch_size: effective batch size after the warm-up, a multiple of
        ``microbatch_size``.
      warmup_steps: number of updates over which the batch grows, >= 1.

    Returns:
      A callable ``update_step -> k`` returning an int32 scalar.

    Raises:
      TypeError: if an argument is not an integer.
      ValueError: if an argument is below 1 or a batch size is not a multiple
        of ``microbatch_size``.

    Examples:
      >>> import optax, optax_accum
      >>> every_k = optax_accum.batch_size_warmup(
      ...     microbatch_size=32, init_batch_size=32, batch_size=128,
      ...     warmup_steps=3)
      >>> [int(every_k(t)) for t in range(5)]
      [1, 2, 3, 4, 4]
      >>> tx = optax_accum.accumulate(optax.adam(1e-3), every_k=every_k)
    """
    micro = _checks.positive_int(microbatch_size, "microbatch_size")
    init = _checks.positive_int(init_batch_size, "init_batch_size")
    final = _checks.positive_int(batch_size, "batch_size")
    warmup = _checks.positive_int(warmup_steps, "warmup_steps")
    for name, value in (("init_batch_size", init), ("batch_size", final)):
        if value % micro:
            raise ValueError(
                f"`{name}` must be a multiple of `microbatch_size`={micro}, "
                f"got {value}."
            )
    k0, k1 = init // micro, final // micro
    _check_ramp(k0, k1, warmup)

    def every_k(update_step: jax.typing.ArrayLike) -> jax.Array:
        t = jnp.clip(jnp.asarray(update_step, jnp.int32), 0, warmup)
        return (k0 + _floor_ratio(k1 - k0, t, warmup)).astype(jnp.int32)

    return every_k


def _check_ramp(k0: int, k1: int, warmup: int) -> None:
    """Refuses a ramp that `_floor_ratio` cannot compute exactly in int32."""
    if k1 > _INT32_MAX:
        raise ValueError(
            f"`batch_size` / `microbatch_size` must fit in int32, got k={k1}."
        )
    if (abs(k1 - k0) * 2.0**-22 + 2) * warmup >= 2.0**31:
        raise ValueError(
            f"`warmup_steps`={warmup} is too long for an exact int32 ramp from "
            f"k={k0} to k={k1}; use fewer steps."
        )


_INT32_MAX = 2**31 - 1


def _floor_ratio(d: int, t: jax.Array, warmup: int) -> jax.Array:
    """``floor(d * t / warmup)`` exactly, for int32 ``0 <= t <= warmup``.

    ``d * t`` overflows int32 (4096 * 10**6 does), and x64 is usually off. A
    float32 estimate ``q`` is within a few units of the answer, so the
    remainder ``d * t - q * warmup`` is small: computed with int32's
    wrap-around, its low 32 bits are the exact value, and one floor division
    corrects ``q``. `_check_ramp` keeps that remainder inside int32. Integer
    arithmetic also keeps each boundary on the same step on every backend.
    """
    q = jnp.floor(t.astype(jnp.float32) * np.float32(d / warmup))
    q = jnp.clip(q, min(d, 0), max(d, 0)).astype(jnp.int32)
    r = jnp.int32(d) * t - q * jnp.int32(warmup)  # exact: |r| < 2**31
    return q + r // warmup
