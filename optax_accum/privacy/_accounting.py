# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Privacy accounting of DP-SGD on dp_accounting: ε from σ, and σ from ε.

The mechanism is ``steps`` compositions of the Poisson-subsampled Gaussian
(sampling rate ``q``, noise ``σ · C`` on a sum of sensitivity ``C``), or of
its truncated form where `poisson_microbatches` truncates. dp_accounting is
imported on first use, so that the rest of the wing works without it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from .. import _checks
from .._extras import install_command
from ._sampling import nonnegative_int, sampling_rate_check

_ACCOUNTANTS = ("rdp", "pld")
_INSTALL = install_command("privacy")


def _dp_accounting() -> Any:
    try:
        import dp_accounting  # type: ignore[import-untyped]
    except ImportError as e:
        raise ImportError(
            "optax_accum.privacy's accounting (`epsilon`, `noise_multiplier_for`) "
            f"needs dp_accounting, in the `privacy` extra: {_INSTALL}."
        ) from e
    return dp_accounting


def _real(value: Any, name: str, low: float, high: float, *, closed: bool) -> float:
    """``value`` as a float in (low, high) (``closed``: in [low, high))."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number, got {value!r}.")
    value = float(value)
    ok = (low <= value if closed else low < value) and value < high
    if not ok or math.isnan(value):
        interval = f"{'[' if closed else '('}{low}, {high})"
        raise ValueError(f"`{name}` must be in {interval}, got {value!r}.")
    return value


def _delta(delta: Any) -> float:
    return _real(delta, "delta", 0.0, 1.0, closed=False)


def _mechanism(
    sampling_rate: Any,
    steps: Any,
    accountant: Any,
    truncated_batch_size: Any,
    num_examples: Any,
) -> tuple[Any, Any]:
    """The checked options as ``(make_accountant, event_of(σ))``."""
    q = sampling_rate_check(sampling_rate)
    steps = nonnegative_int(steps, "steps")
    _checks.one_of(accountant, "accountant", _ACCOUNTANTS)
    if (truncated_batch_size is None) != (num_examples is None):
        raise ValueError(
            "`truncated_batch_size` and `num_examples` go together (the "
            f"truncated event needs both), got truncated_batch_size="
            f"{truncated_batch_size!r}, num_examples={num_examples!r}."
        )
    dpa = _dp_accounting()
    if truncated_batch_size is None:

        def event_of(sigma: float) -> Any:
            one = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma))
            return dpa.SelfComposedDpEvent(one, steps)
    else:
        cap = _checks.positive_int(truncated_batch_size, "truncated_batch_size")
        n = _checks.positive_int(num_examples, "num_examples")
        if accountant != "pld":
            raise ValueError(
                "Truncated Poisson sampling (`truncated_batch_size`) is accounted "
                f'by the PLD accountant only: pass `accountant="pld"`, got '
                f"accountant={accountant!r}."
            )

        def event_of(sigma: float) -> Any:
            one = dpa.TruncatedSubsampledGaussianDpEvent(n, q, cap, sigma)
            return dpa.SelfComposedDpEvent(one, steps)

    make = dpa.rdp.RdpAccountant if accountant == "rdp" else dpa.pld.PLDAccountant
    return make, event_of


def epsilon(
    noise_multiplier: float,
    sampling_rate: float,
    steps: int,
    delta: float,
    *,
    accountant: str = "rdp",
    truncated_batch_size: int | None = None,
    num_examples: int | None = None,
) -> float:
    """The ε of DP-SGD: ``steps`` Poisson-subsampled Gaussian mechanisms.

    Each step samples every example with probability ``q = sampling_rate``,
    sums the examples' gradients clipped to L2 norm ``C``, and adds Gaussian
    noise of standard deviation ``σ · C`` (``σ = noise_multiplier``), once:
    what ``dp_accumulate`` does per logical batch. The guarantee is ``(ε,
    δ)``-DP under add-or-remove-one adjacency, as dp_accounting computes it.

    **RDP warnings.** At a large sampling rate (``q`` above about 0.5) or a
    small ``σ``, dp_accounting's RDP accountant logs (through absl)
    ``_compute_log_a_frac failed to converge ... Excluding this order``: it
    drops the fractional Rényi orders whose series does not converge. That
    is a log, not an error: ε is the minimum over the orders left, still an
    upper bound, if a looser one when few are left. A log of a *negative*
    Rényi divergence is another matter (numerical instability, and that
    order's ε is taken as 0): do not trust that value. ``accountant="pld"``
    has no orders; compare with it where the value matters, and silence the
    logs with ``absl.logging.set_verbosity(absl.logging.ERROR)``.

    Args:
      noise_multiplier: ``σ >= 0``; 0 gives ``inf``.
      sampling_rate: ``q`` in (0, 1].
      steps: the number of noised updates (logical batches), >= 0.
      delta: ``δ`` in (0, 1).
      accountant: ``"rdp"`` (dp_accounting's ``RdpAccountant``, the common
        choice and quick) or ``"pld"`` (``PLDAccountant``: tighter, slower).
      truncated_batch_size: with ``num_examples``, account for truncated
        Poisson sampling (`poisson_microbatches` with ``overflow="truncate"``
        cuts a draw above ``max_batch_size``); PLD only.
      num_examples: the data set's size, for the truncated event.

    Returns:
      ε, a float (``inf`` without noise).

    Raises:
      ImportError: without dp_accounting (the ``privacy`` extra).
      TypeError, ValueError: for an argument out of range, naming it.

    Examples:
      >>> from optax_accum import privacy
      >>> round(privacy.epsilon(1.1, 256 / 60_000, 14_000, 1e-5), 2)
      2.59
    """
    sigma = _real(noise_multiplier, "noise_multiplier", 0.0, math.inf, closed=True)
    delta = _delta(delta)
    make, event_of = _mechanism(
        sampling_rate, steps, accountant, truncated_batch_size, num_examples
    )
    if steps == 0:
        return 0.0  # no step, no privacy spent (dp_accounting refuses a count of 0)
    acc = make()
    acc.compose(event_of(sigma))
    return float(acc.get_epsilon(delta))


def noise_multiplier_for(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    *,
    accountant: str = "rdp",
    truncated_batch_size: int | None = None,
    num_examples: int | None = None,
    tolerance: float = 1e-3,
) -> float:
    """The smallest noise multiplier whose `epsilon` is at most ``target_epsilon``.

    A bisection by dp_accounting's ``calibrate_dp_mechanism``, which returns
    the upper end of its bracket: ``epsilon(result, ...) <= target_epsilon``
    always, and ``result`` is within ``tolerance`` of the exact σ.

    Args:
      target_epsilon: ε > 0.
      delta: ``δ`` in (0, 1).
      sampling_rate: ``q`` in (0, 1].
      steps: the number of noised updates, >= 0.
      accountant: ``"rdp"`` or ``"pld"``, as in `epsilon`.
      truncated_batch_size: as in `epsilon`.
      num_examples: as in `epsilon`.
      tolerance: the bisection's width in σ (> 0).

    Returns:
      σ, a float.

    Raises:
      ImportError: without dp_accounting (the ``privacy`` extra).
      TypeError, ValueError: for an argument out of range, naming it.

    Examples:
      >>> from optax_accum import privacy
      >>> sigma = privacy.noise_multiplier_for(2.0, 1e-5, 0.01, 1000)
      >>> privacy.epsilon(sigma, 0.01, 1000, 1e-5) <= 2.0
      True
    """
    target = _real(target_epsilon, "target_epsilon", 0.0, math.inf, closed=False)
    delta = _delta(delta)
    tolerance = _real(tolerance, "tolerance", 0.0, math.inf, closed=False)
    make, event_of = _mechanism(
        sampling_rate, steps, accountant, truncated_batch_size, num_examples
    )
    dpa = _dp_accounting()
    if nonnegative_int(steps, "steps") == 0:
        return 0.0  # no step, no privacy spent
    return float(
        dpa.calibrate_dp_mechanism(
            make,
            event_of,
            target,
            delta,
            dpa.LowerEndpointAndGuess(0.0, 1.0),
            tol=tolerance,
        )
    )
