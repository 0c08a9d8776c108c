# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`privacy.epsilon` and `privacy.noise_multiplier_for` against dp_accounting.

References: dp_accounting's own RDP and PLD accountants on the
Poisson-subsampled Gaussian event, and, where sampling is q = 1, the exact
(ε, δ) of the composed Gaussian mechanism (Balle and Wang 2018), by hand.
"""

from __future__ import annotations

import math
import sys

import pytest
from scipy import optimize, stats

from optax_accum import privacy
from tests.helpers.lanes import sweep

dpa = pytest.importorskip("dp_accounting")

CASES = [
    (1.1, 0.01, 1000, 1e-5),
    (2.0, 1024 / 1437, 20, 1e-5),
    (0.8, 0.002, 5000, 1e-6),
]


def _reference(sigma, q, steps, delta, accountant):
    acc = dpa.rdp.RdpAccountant() if accountant == "rdp" else dpa.pld.PLDAccountant()
    event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma))
    acc.compose(dpa.SelfComposedDpEvent(event, steps))
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize(("sigma", "q", "steps", "delta"), CASES[:2])
def test_epsilon_equals_dp_accounting(sigma, q, steps, delta, accountant):
    got = privacy.epsilon(sigma, q, steps, delta, accountant=accountant)
    assert got == pytest.approx(
        _reference(sigma, q, steps, delta, accountant), rel=1e-9
    )


def test_rdp_is_the_default_and_pld_is_tighter():
    sigma, q, steps, delta = CASES[0]
    rdp = privacy.epsilon(sigma, q, steps, delta)
    assert rdp == _reference(sigma, q, steps, delta, "rdp")
    assert privacy.epsilon(sigma, q, steps, delta, accountant="pld") < rdp


def test_pld_matches_the_exact_gaussian_at_q_one():
    # T compositions of the Gaussian mechanism with σ are one Gaussian
    # mechanism with μ = √T / σ: δ(ε) = Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2).
    sigma, steps, delta = 5.0, 4, 1e-5
    mu = math.sqrt(steps) / sigma

    def delta_of(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(
            -eps / mu - mu / 2
        )

    exact = optimize.brentq(lambda e: delta_of(e) - delta, 1e-6, 50)
    got = privacy.epsilon(sigma, 1.0, steps, delta, accountant="pld")
    assert got == pytest.approx(exact, rel=1e-2)
    assert got >= exact * (1 - 1e-6)  # PLD's discretisation is pessimistic


@pytest.mark.parametrize("accountant", sweep(["rdp", "pld"], fast=["rdp"]))
def test_noise_multiplier_for_inverts_epsilon(accountant):
    q, steps, delta, target = 0.01, 1000, 1e-5, 2.0
    tol = 1e-3
    sigma = privacy.noise_multiplier_for(
        target, delta, q, steps, accountant=accountant, tolerance=tol
    )
    # The guarantee holds at σ and would not a little below it.
    assert privacy.epsilon(sigma, q, steps, delta, accountant=accountant) <= target
    below = privacy.epsilon(sigma - 2 * tol, q, steps, delta, accountant=accountant)
    assert below > target
    # And dp_accounting's own calibration agrees.
    make = dpa.rdp.RdpAccountant if accountant == "rdp" else dpa.pld.PLDAccountant

    def event(s):
        one = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(s))
        return dpa.SelfComposedDpEvent(one, steps)

    want = dpa.calibrate_dp_mechanism(make, event, target, delta, tol=tol)
    assert sigma == pytest.approx(want, abs=tol)


def test_epsilon_of_no_noise_and_no_steps():
    assert privacy.epsilon(0.0, 0.1, 10, 1e-5) == math.inf
    assert privacy.epsilon(1.0, 0.1, 0, 1e-5) == 0.0
    assert privacy.noise_multiplier_for(1.0, 1e-5, 0.1, 0) == 0.0


def test_more_steps_or_a_larger_rate_spend_more():
    base = privacy.epsilon(1.0, 0.01, 100, 1e-5)
    assert privacy.epsilon(1.0, 0.01, 200, 1e-5) > base
    assert privacy.epsilon(1.0, 0.02, 100, 1e-5) > base
    assert privacy.epsilon(2.0, 0.01, 100, 1e-5) < base


def test_truncated_poisson_equals_dp_accounting_and_the_default_cap_costs_nothing():
    n, q, m, sigma, steps, delta = 1437, 1024 / 1437, 64, 2.0, 10, 1e-5
    sampler = privacy.poisson_microbatches(n, q, m, seed=0)
    got = privacy.epsilon(
        sigma, q, steps, delta, accountant="pld",
        truncated_batch_size=sampler.max_batch_size, num_examples=n,
    )  # fmt: skip
    acc = dpa.pld.PLDAccountant()
    one = dpa.TruncatedSubsampledGaussianDpEvent(n, q, sampler.max_batch_size, sigma)
    acc.compose(dpa.SelfComposedDpEvent(one, steps))
    assert got == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
    untruncated = privacy.epsilon(sigma, q, steps, delta, accountant="pld")
    assert got == pytest.approx(untruncated, rel=1e-6)


@pytest.mark.slow
def test_noise_multiplier_for_a_truncated_sampler():
    n, q, steps, delta = 1437, 1024 / 1437, 10, 1e-5
    kwargs = {"accountant": "pld", "truncated_batch_size": 1100, "num_examples": n}
    sigma = privacy.noise_multiplier_for(4.0, delta, q, steps, tolerance=1e-2, **kwargs)
    assert privacy.epsilon(sigma, q, steps, delta, **kwargs) <= 4.0
    assert privacy.epsilon(sigma - 2e-2, q, steps, delta, **kwargs) > 4.0


def test_truncation_needs_pld_and_both_arguments():
    with pytest.raises(ValueError, match=r'accountant="pld"`, got accountant=\'rdp\''):
        privacy.epsilon(1.0, 0.5, 10, 1e-5, truncated_batch_size=60, num_examples=100)
    with pytest.raises(ValueError, match=r"`truncated_batch_size` and `num_examples`"):
        privacy.epsilon(1.0, 0.5, 10, 1e-5, accountant="pld", truncated_batch_size=60)
    with pytest.raises(ValueError, match=r"`truncated_batch_size` must be >= 1, got 0"):
        privacy.epsilon(
            1.0, 0.5, 10, 1e-5, accountant="pld", truncated_batch_size=0, num_examples=9
        )


def test_missing_dp_accounting_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # import raises
    with pytest.raises(ImportError, match=r"optax_accum\[privacy\]"):
        privacy.epsilon(1.0, 0.1, 10, 1e-5)
    with pytest.raises(ImportError, match=r"`privacy` extra"):
        privacy.noise_multiplier_for(1.0, 1e-5, 0.1, 10)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((-0.5, 0.1, 10, 1e-5), {}, ValueError, r"`noise_multiplier` must be in \[0.0"),
        ((math.nan, 0.1, 10, 1e-5), {}, ValueError, r"`noise_multiplier` .*got nan"),
        (("1", 0.1, 10, 1e-5), {}, TypeError, r"`noise_multiplier` must be a real"),
        ((1.0, 0.0, 10, 1e-5), {}, ValueError, r"`sampling_rate` must be in \(0, 1\]"),
        ((1.0, 1.01, 10, 1e-5), {}, ValueError, r"`sampling_rate` .*got 1.01"),
        ((1.0, 0.1, -1, 1e-5), {}, ValueError, r"`steps` must be >= 0, got -1"),
        ((1.0, 0.1, 2.5, 1e-5), {}, TypeError, r"`steps` must be an integer, got 2.5"),
        (
            (1.0, 0.1, 10, 0.0),
            {},
            ValueError,
            r"`delta` must be in \(0.0, 1.0\), got 0.0",
        ),
        ((1.0, 0.1, 10, 1.0), {}, ValueError, r"`delta` .*got 1.0"),
        (
            (1.0, 0.1, 10, 1e-5),
            {"accountant": "prv"},
            ValueError,
            r"`accountant` .*'prv'",
        ),
    ],
)
def test_bad_epsilon_arguments_are_named(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        privacy.epsilon(*args, **kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (
            (0.0, 1e-5, 0.1, 10),
            {},
            ValueError,
            r"`target_epsilon` must be in \(0.0, inf",
        ),
        ((-1.0, 1e-5, 0.1, 10), {}, ValueError, r"`target_epsilon` .*got -1.0"),
        ((1.0, 2.0, 0.1, 10), {}, ValueError, r"`delta` .*got 2.0"),
        ((1.0, 1e-5, 0.0, 10), {}, ValueError, r"`sampling_rate` .*got 0.0"),
        ((1.0, 1e-5, 0.1, -3), {}, ValueError, r"`steps` must be >= 0, got -3"),
        ((1.0, 1e-5, 0.1, 10), {"tolerance": 0}, ValueError, r"`tolerance` .*got 0"),
    ],
)
def test_bad_noise_multiplier_for_arguments_are_named(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        privacy.noise_multiplier_for(*args, **kwargs)
