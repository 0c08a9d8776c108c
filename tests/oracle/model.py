# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The float64 NumPy model of the documented semantics.

It knows nothing of JAX. Its input is a list of `Unit`: one micro-batch's
gradient, value and weight, on one device (the data module builds them from a
cell's rows, per device where the mode weighs per device). From the docstrings
of `accumulate`, `microbatch`, `has_updated`, `skip_not_finite`,
`skip_large_updates`, `noise_scale` and `_weights`:

- a weight ``w > 0`` contributes ``w``-weighted; ``w == 0`` contributes
  nothing, even a NaN gradient, and is not a rejection (``skip_fn`` does not
  judge it); NaN, an infinity or ``w < 0`` rejects the micro-batch: it is
  averaged as if absent, counted in ``num_skipped`` (per device without
  ``skip_fn``: only that device's contribution weighs 0);
- mean ``sum w g / sum w`` (0 when the weights sum to 0), sum ``sum w g``;
- a window closes after ``k(update_step)`` accepted micro-batches, or on
  ``close_window`` once it holds one; a window whose weights sum to 0 emits
  zeros and is not an update; ``has_updated`` is "this call emitted an
  update";
- the noise statistics of McCandlish et al. (B_small = W / n, B_big = W);
- ``aux`` stacked per micro-batch;
- the privacy face (`privacy.clipped_value_and_grad`): the sum over real
  examples of each example's gradient, non-finite entries set to 0, clipped
  to L2 norm C; the mean loss over real examples (0 when there are none);
  padding contributes nothing, whatever its values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np


class Unit(NamedTuple):
    """One micro-batch on one device."""

    grad: np.ndarray  # float64 (D,)
    weight: float  # the reduction weight, as given (may be bad)
    noise_weight: float  # its unit for the noise scale (rows or the weight)
    value: float = 0.0
    scale: float = 0.0  # the size of the terms of ``value`` (for tolerances)


def usable(w: float) -> bool:
    return bool(np.isfinite(w) and w >= 0)


def admitted(w: float) -> float:
    return w if usable(w) else 0.0


def reduce(units: list[Unit], mean: bool) -> tuple[np.ndarray, float, float]:
    """``(gradient, value, total weight)`` of units, weights admitted."""
    dim = units[0].grad.shape
    g, v, total = np.zeros(dim), 0.0, 0.0
    for u in units:
        w = admitted(u.weight)
        if w > 0:  # select, never multiply: a weight-0 NaN stays out
            g, v, total = g + w * u.grad, v + w * u.value, total + w
    if mean:
        g, v = (g / total, v / total) if total > 0 else (np.zeros(dim), 0.0)
    return g, v, total


# ---- inner optimizers --------------------------------------------------------


class SGD:
    def __init__(self, lr: float = 0.5):
        self.lr = lr

    def init(self, dim: tuple) -> Any:
        return ()

    def update(self, g: np.ndarray, state: Any) -> tuple[np.ndarray, Any]:
        return -self.lr * g, state


class Adam:
    """optax.adam's update: bias-corrected moments, ``eps`` outside the root.
    ``eps`` is 1e-4, as `runtime.inner` passes it: optax's 1e-8 is 0 in fp16,
    where a zero gradient's update would be 0 / 0 without any accumulation."""

    def __init__(self, lr=0.1, b1=0.9, b2=0.999, eps=1e-4):
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps

    def init(self, dim: tuple) -> Any:
        return (np.zeros(dim), np.zeros(dim), 0)

    def update(self, g: np.ndarray, state: Any) -> tuple[np.ndarray, Any]:
        mu, nu, t = state
        mu = self.b1 * mu + (1 - self.b1) * g
        nu = self.b2 * nu + (1 - self.b2) * g * g
        t += 1
        mu_hat, nu_hat = mu / (1 - self.b1**t), nu / (1 - self.b2**t)
        return -self.lr * mu_hat / (np.sqrt(nu_hat) + self.eps), (mu, nu, t)


INNER = {"sgd": SGD, "adam": Adam}


# ---- the noise scale ---------------------------------------------------------


class Noise(NamedTuple):
    grad_sq_ema: float = 0.0
    trace_ema: float = 0.0
    ema_norm: float = 0.0
    windows: int = 0
    b_small: float = 0.0
    b_big: float = 0.0
    last_grad_sq: float = 0.0
    last_trace: float = 0.0


def noise_close(state: Noise, units: list[Unit], big: np.ndarray, decay: float):
    """Folds one window (its units with positive weight) into the EMAs."""
    kept = [u for u in units if admitted(u.weight) > 0 and u.noise_weight > 0]
    n = len(kept)
    total = sum(u.noise_weight for u in kept)
    if n < 2 or total <= 0:
        return state
    sq_sum = sum(u.noise_weight * float(u.grad @ u.grad) for u in kept)
    b_big, b_small = total, total / n
    small_sq, big_sq = sq_sum / total, float(big @ big)
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
    ema = lambda old, new: decay * old + (1 - decay) * new
    return Noise(
        ema(state.grad_sq_ema, grad_sq),
        ema(state.trace_ema, trace),
        ema(state.ema_norm, 1.0),
        state.windows + 1,
        b_small,
        b_big,
        grad_sq,
        trace,
    )


def noise_read(s: Noise) -> dict[str, float]:
    """What `noise_scale` reads from the state."""
    if s.windows == 0:
        return dict(b_simple=np.nan, trace_sigma=np.nan, grad_sq=np.nan, windows=0)
    g, t = s.grad_sq_ema, s.trace_ema
    ratio = (t / g if g > 0 else np.inf) if t > 0 else 0.0
    return dict(
        b_simple=ratio,
        trace_sigma=t / s.ema_norm,
        grad_sq=g / s.ema_norm,
        windows=s.windows,
        b_small=s.b_small,
        b_big=s.b_big,
    )


# ---- the per-call face: accumulate, MultiSteps -------------------------------


class Stream(NamedTuple):
    updates: np.ndarray  # (calls, D)
    updated: np.ndarray  # (calls,) bool
    num_skipped: int
    noise: Noise | None
    # Calls rejected while the window was empty after an update: the state
    # then reads as right after an update, though the call emitted none.
    idle_rejections: int = 0


def _rejected(units: list[Unit], skip: Callable | None, mapped: bool) -> bool:
    """A call's micro-batch (one unit per device) is rejected."""
    bad = any(not usable(u.weight) for u in units)
    if skip is None:
        return bad and not mapped  # per device: a bad weight weighs 0
    live = [u for u in units if admitted(u.weight) > 0]
    if bad:
        return True
    # Weight 0 is not a rejection: only a contributing micro-batch is judged,
    # by its gradient (over the devices that hold it).
    return bool(live) and skip(reduce(live, mean=True)[0])


def run_stream(
    calls: list[list[Unit]],
    k_of: Callable[[int], int],
    mean: bool,
    inner: Any,
    *,
    skip: Callable | None = None,
    close: list[bool] | None = None,
    mapped: bool = False,
    decay: float | None = None,
) -> Stream:
    """`accumulate` (and `MultiSteps`) over a stream of calls."""
    dim = calls[0][0].grad.shape
    inner_state, step, window, skipped = inner.init(dim), 0, [], 0
    micro, noise = 0, Noise() if decay is not None else None
    updates, updated = [], []
    idle = 0
    for t, units in enumerate(calls):
        if _rejected(units, skip, mapped):
            skipped += 1
            idle += micro == 0 and step > 0
        else:
            micro += 1
            window += units
        emit = micro > 0 and (micro >= max(1, k_of(step)) or bool(close and close[t]))
        u, did = np.zeros(dim), False
        if emit:
            g, _, total = reduce(window, mean)
            if total > 0:
                u, inner_state = inner.update(g, inner_state)
                step, did = step + 1, True
                if noise is not None:
                    noise = noise_close(noise, window, g, decay)
            micro, window = 0, []
        updates.append(u)
        updated.append(did)
    return Stream(np.array(updates), np.array(updated), skipped, noise, idle)


# ---- the fused face: microbatch, the loss face, the Flax steps ----------------


class Loop(NamedTuple):
    value: float
    grad: np.ndarray
    noise: Noise | None
    value_scale: float  # the value's terms' size: its rounding is relative to it


def run_loop(units: list[Unit], mean: bool, noise: Noise | None, decay: float | None):
    """One call of `microbatch`: all of its micro-batches (on all devices)."""
    g, v, _ = reduce(units, mean)
    if noise is not None:
        noise = noise_close(noise, units, g, decay)
    scale = reduce([u._replace(value=u.scale) for u in units], mean)[1]
    return Loop(v, g, noise, scale)


def skip_not_finite(g: np.ndarray) -> bool:
    return not bool(np.all(np.isfinite(g)))


def skip_large_updates(max_norm: float) -> Callable[[np.ndarray], bool]:
    return lambda g: not bool(np.sqrt(g @ g) <= max_norm)


# ---- the privacy face: per-example clipping ----------------------------------


def clipped_sum(
    grads: np.ndarray, values: np.ndarray, real: np.ndarray, c: float
) -> tuple[np.ndarray, float]:
    """``(sum of clipped gradients, mean loss)`` over the rows where ``real``;
    ``grads`` (rows, D) and ``values`` (rows,) in float64."""
    g = np.nan_to_num(grads[real], nan=0.0, posinf=0.0, neginf=0.0)
    norm = np.sqrt(np.sum(g * g, axis=1))
    with np.errstate(divide="ignore"):
        scale = np.minimum(1.0, c / norm)
    total = np.sum(g * scale[:, None], axis=0) if len(g) else np.zeros(grads.shape[1])
    value = float(np.mean(values[real])) if real.any() else 0.0
    return total, value
