# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The gradient noise scale of an accumulation window, and an adaptive ``every_k``.

This module owns the estimator of McCandlish et al. 2018 ("An Empirical Model
of Large-Batch Training", arXiv 1812.06162, Appendix A): arithmetic on the
squared norms of the window's micro-batch gradients and of their mean, the
bias-corrected EMAs and the pick of the next window's k for
`adaptive_every_k` (`_schedules`). The engine in `_engine` only calls it:
`observe` once per micro-step (one reduction of the gradient it already
reads), `boundary_stats` in the boundary branch, `close` on the scalars
afterwards; `microbatch` keeps `window_sums` in its own loop carry. The
reader, `noise_scale`, is in `_states`.

Units. Micro-batch ``i`` has weight ``w_i`` (1 unless the caller passes
``weight``) and gradient ``g_i``, the mean gradient of ``w_i`` units (examples
of a micro-batch of ``b``, or tokens with token weighting), so that
``E|g_i|^2 = |G|^2 + tr(Sigma) / w_i``. Over a window of ``n`` micro-batches
with positive weight (on all devices) and total weight ``W``::

    |G_small|^2 = sum_i w_i |g_i|^2 / W,   B_small = W / n
    |G_big|^2   = |sum_i w_i g_i / W|^2,   B_big   = W

are unbiased for ``|G|^2 + tr(Sigma) / B``, for any unequal weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _checks, _dtypes

if TYPE_CHECKING:
    from ._schedules import AdaptiveEveryK


class NoiseScaleState(NamedTuple):
    """Noise-scale part of `AccumulateState` (``noise_scale_decay`` set).

    Attributes:
      sq_sum: float32, ``sum_i w_i |g_i|^2`` over the window's micro-batches so
        far; device-local (a leading axis of length 1) with ``axis_name``.
      count: float32, the window's micro-batches with positive weight so far;
        device-local like ``sq_sum``.
      grad_sq_ema: float32, EMA of the per-window estimates of ``|G|^2``,
        without bias correction (`noise_scale` corrects it).
      trace_ema: float32, EMA of the estimates of ``tr(Sigma)``, likewise.
      ema_norm: float32, the same EMA of ones, ``1 - decay**windows``: the
        bias correction.
      windows: int32, windows folded into the EMAs (a window of one
        micro-batch on one device measures nothing and is not counted).
      b_small: float32, ``B_small`` of the last counted window.
      b_big: float32, ``B_big`` of the last counted window.
      last_grad_sq: float32, that window's own estimate of ``|G|^2``.
      last_trace: float32, that window's own estimate of ``tr(Sigma)``.
      k: int32, the current window's k under `adaptive_every_k`, else 0.
    """

    sq_sum: jax.Array
    count: jax.Array
    grad_sq_ema: jax.Array
    trace_ema: jax.Array
    ema_norm: jax.Array
    windows: jax.Array
    b_small: jax.Array
    b_big: jax.Array
    last_grad_sq: jax.Array
    last_trace: jax.Array
    k: jax.Array


class NoiseScale(NamedTuple):
    r"""The gradient noise scale read from a state by `noise_scale`.

    Attributes:
      b_simple: ``tr(Sigma) / |G|^2``, the ratio of the two EMAs; NaN before
        the first window. The estimates can be <= 0 (an early, noisy window):
        ``b_simple`` is ``inf`` where the ``|G|^2`` estimate is <= 0 and the
        ``tr(Sigma)`` one positive (the noise dominates: no batch is too
        large), and 0 where the ``tr(Sigma)`` estimate is <= 0.
      trace_sigma: bias-corrected EMA of ``tr(Sigma)``, the per-unit gradient
        covariance trace.
      grad_sq: bias-corrected EMA of ``|G|^2``, the true gradient's squared
        norm.
      windows: windows measured so far.
      b_small: the last window's micro-batch size ``B_small``.
      b_big: the last window's effective batch size ``B_big``.
      k: the current window's k under `adaptive_every_k`, else 0.
    """

    b_simple: jax.Array
    trace_sigma: jax.Array
    grad_sq: jax.Array
    windows: jax.Array
    b_small: jax.Array
    b_big: jax.Array
    k: jax.Array


def check_decay(decay: Any) -> float | None:
    """Returns ``noise_scale_decay`` as a float, or raises; None stays None."""
    if decay is None:
        return None
    if isinstance(decay, bool) or not isinstance(decay, int | float | np.floating):
        raise TypeError(
            f"`noise_scale_decay` must be a float in (0, 1) or None, got {decay!r}."
        )
    if not 0.0 < float(decay) < 1.0:
        raise ValueError(
            f"`noise_scale_decay` must be in (0, 1) (open), got {decay!r}."
        )
    return float(decay)


def check_options(
    decay: Any,
    adaptive: bool,
    reduction: str,
    k_name: str,
    data_axes: Any = (),
    *,
    single: bool = False,
    axis_name_option: bool = True,
) -> float | None:
    """``noise_scale_decay`` checked with the options it depends on.

    ``single``: every window is one micro-batch on one device (a static k of
    1, no axis name), which measures nothing; ``axis_name_option``: whether
    the caller has an ``axis_name`` to suggest instead.
    """
    decay = check_decay(decay)
    _checks.needs_whole_gradients(data_axes, {"noise_scale_decay": decay})
    if adaptive and decay is None:
        raise ValueError(
            f"`{k_name}`=adaptive_every_k(...) reads the noise scale: pass "
            "`noise_scale_decay` too (e.g. 0.9)."
        )
    if decay is not None and reduction != "mean":
        raise ValueError(
            "`noise_scale_decay` needs mean gradients (reduction='mean', or "
            f"use_grad_mean=True), got reduction={reduction!r}."
        )
    if decay is not None and single:
        devices = (
            ", or `axis_name` inside shard_map/pmap (each device's micro-batch "
            "is then a small batch)"
            if axis_name_option
            else ""
        )
        raise ValueError(
            f"`noise_scale_decay`={decay!r} with `{k_name}`=1 measures nothing: "
            "the noise scale compares a window's micro-batch gradients with "
            "their mean, and a window of one micro-batch on one device has "
            f"nothing to compare (B_simple would stay NaN). Use `{k_name}` >= 2"
            f"{devices}, or leave `noise_scale_decay` unset."
        )
    return decay


def init(slot: tuple[int, ...], schedule: AdaptiveEveryK | None) -> NoiseScaleState:
    # One buffer per leaf: a donated state must not hold one array twice.
    zero = lambda: jnp.zeros([], jnp.float32)
    return NoiseScaleState(
        sq_sum=jnp.zeros(slot, jnp.float32),
        count=jnp.zeros(slot, jnp.float32),
        grad_sq_ema=zero(),
        trace_ema=zero(),
        ema_norm=zero(),
        windows=jnp.zeros([], jnp.int32),
        b_small=zero(),
        b_big=zero(),
        last_grad_sq=zero(),
        last_trace=zero(),
        k=jnp.asarray(0 if schedule is None else schedule.init_k, jnp.int32),
    )


def squared_norm(tree: Any) -> jax.Array:
    """Sum of squares over all leaves, accumulated in float32.

    A full contraction ``x . x`` rather than ``sum(x**2)``: the same single
    read of ``x``, and on the CPU XLA runs it as a BLAS dot, about 15% faster
    than its reduction; bf16 leaves are read as they are, with no f32 copy.
    ``float0`` leaves (integer parameters' gradients) count as zero.
    """
    total = jnp.zeros([], jnp.float32)
    for x in jax.tree.leaves(tree):
        if _dtypes.is_float0(x):  # an integer input's gradient: no norm
            continue
        dims = tuple(range(jnp.ndim(x)))
        total = total + lax.dot_general(
            x, x, ((dims, dims), ((), ())), preferred_element_type=jnp.float32
        )
    return total


def observe(
    state: NoiseScaleState, grads: Any, w: jax.Array, first: jax.Array
) -> NoiseScaleState:
    """Adds one micro-batch (weight ``w``, 0 if rejected) to the window."""
    sq = squared_norm(grads)
    w = w.astype(jnp.float32)
    keep = w > 0
    # jnp.where, not w * sq: a rejected micro-batch may be NaN.
    add_sq = jnp.where(keep, w * sq, 0.0).reshape(state.sq_sum.shape)
    add_n = keep.astype(jnp.float32).reshape(state.count.shape)
    return state._replace(
        sq_sum=jnp.where(first, 0.0, state.sq_sum) + add_sq,
        count=jnp.where(first, 0.0, state.count) + add_n,
    )


def local_stats(state: NoiseScaleState | tuple) -> tuple:
    """The device-local window sums to reduce at the boundary (``()`` if off)."""
    if not isinstance(state, NoiseScaleState):
        return ()
    return state.sq_sum, state.count


def boundary_stats(reduced_grads: Any, totals: tuple) -> tuple:
    """Scalars for `close`: summed ``(sq_sum, count, weight)`` and |G_big|^2."""
    # float32, as the statistics are kept (a float64 window's weight is not).
    sq_sum, count, weight = (jnp.reshape(t, []).astype(jnp.float32) for t in totals)
    return sq_sum, count, weight, squared_norm(reduced_grads)


def window_sums(sums: tuple, sq: jax.Array, w: jax.Array) -> tuple:
    """Adds a micro-batch of squared norm ``sq`` and weight ``w`` to
    `microbatch`'s ``(sum w |g|^2, n, sum w)``."""
    total_sq, n, total = sums
    w = w.astype(jnp.float32)
    keep = w > 0
    # jnp.where, not w * sq: a rejected micro-batch may be NaN.
    total_sq = total_sq + jnp.where(keep, w * sq, 0.0)
    return total_sq, n + keep.astype(jnp.float32), total + w


def zero_stats() -> tuple:
    return tuple(jnp.zeros([], jnp.float32) for _ in range(4))


def close(
    state: NoiseScaleState,
    emit: jax.Array,
    stats: tuple,
    decay: float,
    schedule: AdaptiveEveryK | None,
    num_devices: int,
) -> NoiseScaleState:
    """Folds a closed window into the EMAs and picks the next k."""
    sq_sum, count, weight, big_sq = stats
    valid = emit & (count > 1.5) & (weight > 0)
    safe_w = jnp.where(valid, weight, 1.0)
    b_big = safe_w
    b_small = safe_w / jnp.where(valid, count, 0.5)
    small_sq = sq_sum / safe_w
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    ema = lambda old, new: jnp.where(valid, decay * old + (1 - decay) * new, old)
    new = state._replace(
        grad_sq_ema=ema(state.grad_sq_ema, grad_sq),
        trace_ema=ema(state.trace_ema, trace),
        ema_norm=ema(state.ema_norm, 1.0),
        windows=state.windows + valid.astype(jnp.int32),
        b_small=jnp.where(valid, b_small, state.b_small),
        b_big=jnp.where(valid, b_big, state.b_big),
        last_grad_sq=jnp.where(valid, grad_sq, state.last_grad_sq),
        last_trace=jnp.where(valid, trace, state.last_trace),
    )
    if schedule is not None:
        k = schedule.next_k(b_simple(new), new.b_small * num_devices, state.k)
        new = new._replace(k=jnp.where(emit & (new.windows > 0), k, state.k))
    return new


def state_specs(state: Any, sharded: Any, replicated: Any) -> Any:
    """``PartitionSpec``s: the window sums are device-local, the rest replicated."""
    if not isinstance(state, NoiseScaleState):
        return state
    specs = NoiseScaleState(*(replicated for _ in state))
    return specs._replace(sq_sum=sharded, count=sharded)


def b_simple(state: NoiseScaleState) -> jax.Array:
    g, t = state.grad_sq_ema, state.trace_ema
    # |G|^2 <= 0 (a noisy early estimate): the noise dominates, B is unbounded.
    ratio = jnp.where(g > 0, t / jnp.where(g > 0, g, 1.0), jnp.inf)
    ratio = jnp.where(t > 0, ratio, 0.0)
    return jnp.where(state.windows > 0, ratio, jnp.nan)


def debiased(ema: jax.Array, state: NoiseScaleState) -> jax.Array:
    return jnp.where(state.windows > 0, ema / state.ema_norm, jnp.nan)
