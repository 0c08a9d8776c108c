# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The weight contract, one for both faces.

A micro-batch's weight ``w`` (``accumulate``'s ``weight=``, ``microbatch``'s
``weight_fn``) is a real scalar:

- ``w > 0`` contributes ``w``-weighted: the window's gradient is
  ``sum_i w_i g_i / sum_i w_i`` (mean) or ``sum_i w_i g_i`` (sum);
- ``w == 0`` contributes nothing, whatever its gradients hold (an all-padding
  micro-batch's 0/0 = NaN token mean is selected out, never multiplied), and
  is no rejection: a ``skip_fn`` does not judge it, and it counts in the
  window like any accepted micro-batch;
- NaN, an infinity or ``w < 0`` rejects the micro-batch: it contributes
  nothing, and the rest of the window is unchanged (`accumulate` counts it in
  ``num_skipped``). On one device of several it changes only that device's
  contribution.

Range: weights are held in the window's weight dtype (float32, or float64
where the accumulator is float64). Positive weights from the smallest normal
number to the largest finite one are honoured, and any number of them: sums
are normalised by the window's largest weight (or kept as a mean), so they
cannot overflow. A constant weight outside that range (1e39 or 1e-40 in
float32) raises, and so does a negative or non-finite one, whether it is a
Python or NumPy value or a ``jax.Array`` in an eager call; a traced one
(under ``jit``) cannot raise, so it is rejected at run time, and a traced
subnormal weight is flushed to 0 by XLA on CPU and GPU and so weighs 0.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _checks


def ratio(num: jax.Array, den: jax.Array) -> jax.Array:
    """``num / den`` where ``den > 0``, else 0: the one safe weighted mean.

    Safe for any finite ``den``: XLA computes an array over a scalar as
    ``num * (1 / den)``, and ``1 / den`` is subnormal, so flushed to 0, for
    ``den`` above 8.5e37 in float32. Both are first scaled by the power of
    two that brings ``den`` into [0.5, 1) (exact, done on the exponent bits).
    """
    positive = den > 0
    den = jnp.where(positive, den, jnp.ones_like(den))
    _, exponent = jnp.frexp(den)
    quotient = _ldexp(num, -exponent) / jnp.ldexp(den, -exponent)
    return jnp.where(positive, quotient, jnp.zeros_like(quotient))


def _ldexp(x: jax.Array, exponent: jax.Array) -> jax.Array:
    """``x * 2**exponent``, exactly; complex ``x`` part by part."""
    if jnp.iscomplexobj(x):
        return lax.complex(_ldexp(x.real, exponent), _ldexp(x.imag, exponent))
    return jnp.ldexp(x, exponent)


def check(weight: Any, dtype: Any) -> jax.Array:
    """The micro-batch weight as a ``dtype`` scalar (1 for None).

    A weight whose value is known now (a Python or NumPy value, or a
    ``jax.Array`` in an eager call) raises if it is not a real scalar, is
    negative or not finite, or does not fit ``dtype`` (overflows it, or is
    subnormal in it); a traced bad weight is rejected at run time (see
    `usable`).
    """
    if weight is None:
        return jnp.ones([], dtype)
    _checks.real_scalar(weight, "weight")
    _checks.finite_nonnegative(weight, "weight", arrays=True)
    if _checks.is_concrete(weight):
        _check_range(float(np.asarray(weight)), weight, dtype)
    return jnp.asarray(weight, dtype)


def from_fn(w: Any, dtype: Any, name: str = "weight_fn") -> jax.Array:
    """What a ``weight_fn`` returned, as a ``dtype`` scalar.

    Raises:
      TypeError: if ``w`` is not a real number (a string; a complex number,
        whose imaginary part a cast would drop), naming ``name`` and ``w``.
      ValueError: if ``w`` is not a scalar.
    """
    try:
        real = w is not None and not isinstance(w, str | bytes)
        real = real and not jnp.issubdtype(jnp.result_type(w), jnp.complexfloating)
    except (TypeError, ValueError):
        real = False
    if not real:
        got = (
            f"a {w.dtype} array"
            if isinstance(w, jax.Array)
            else f"{w!r:.60} of type {type(w).__name__}"
        )
        raise TypeError(
            f"`{name}` must return a real scalar (the micro-batch's weight), got {got}."
        )
    if jnp.ndim(w) != 0:
        raise ValueError(f"`{name}` must return a scalar, got shape {jnp.shape(w)}.")
    return jnp.asarray(w, dtype)


def _check_range(value: float, weight: Any, dtype: Any) -> None:
    """A known weight > 0 must be a normal number of ``dtype``."""
    info = jnp.finfo(dtype)
    if value > float(info.max):
        raise ValueError(
            f"`weight`={weight!r} overflows {info.dtype} (largest finite "
            f"value {float(info.max):.3g}): scale the weights down; only "
            "their ratios matter for the mean."
        )
    if 0 < value < float(info.smallest_normal):
        raise ValueError(
            f"`weight`={weight!r} is subnormal in {info.dtype} (below "
            f"{float(info.smallest_normal):.3g}), which XLA flushes to 0 "
            "on CPU and GPU: scale the weights up; only their ratios "
            "matter for the mean."
        )


def usable(w: jax.Array) -> jax.Array:
    """Whether a (traced) weight is usable: finite and >= 0."""
    return jnp.logical_and(jnp.isfinite(w), w >= 0)


def admitted(w: jax.Array) -> jax.Array:
    """``w`` where it is usable, else 0 (a rejected micro-batch weighs 0)."""
    return jnp.where(usable(w), w, jnp.zeros_like(w))


def running_mean(
    mean: jax.Array, count: jax.Array, w: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Adds weight ``w`` as the ``count``-th (>= 1) of the window.

    The window keeps the mean of its weights, not their sum, so that it
    cannot overflow. Returns the new mean and ``w``'s share of the window,
    ``w / sum``, the coefficient of the running weighted mean (in [0, 1]).
    """
    count = count.astype(mean.dtype)
    new_mean = mean + (w - mean) / count
    # XLA rewrites (w / new_mean) / count as w / (new_mean * count), which
    # overflows with the total; `ratio` scales new_mean into [0.5, 1) first.
    return new_mean, ratio(w / count, new_mean)


def shares(ws: jax.Array) -> jax.Array:
    """Each admitted weight's share ``w_i / sum_j w_j`` of a vector of them.

    Scaled first (`normalized`), so that the sum cannot overflow.
    """
    scaled = normalized(ws)
    return ratio(scaled, jnp.sum(scaled))


def normalized(ws: jax.Array) -> jax.Array:
    """``ws`` scaled by the power of two that brings the largest into
    [0.5, 1): exact, and their sum cannot overflow."""
    _, exponent = jnp.frexp(jnp.max(ws))
    return jnp.ldexp(ws, -exponent)


def running_shares(ws: jax.Array) -> jax.Array:
    """Each weight's share of the weights up to it, ``w_i / sum_{j<=i} w_j``:
    the coefficients of a running weighted mean (0 while the sum is 0)."""
    return ratio(ws, jnp.cumsum(ws))
