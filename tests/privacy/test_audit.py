# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""An empirical privacy audit of one DP step: a canary example in or out.

As jax_privacy's ``auditing`` module and Opacus's tests do it: run the step
many times, with fresh noise, on neighbouring data sets (a canary example
masked out, or in), score each run by the update's projection on the
canary's gradient, and turn the best threshold's true and false positive
rates (Clopper-Pearson bounds) into a lower bound on epsilon. A correct
mechanism's bound stays below the analytic epsilon of the Gaussian
mechanism; a broken one (sensitivity 10 C: the canary clipped to 10 C but
noised for C) exceeds it, so the audit has the power to catch it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import optimize, stats

from optax_accum import privacy

C, SIGMA, DELTA, D, TRIALS = 1.0, 2.0, 1e-5, 16, 4000


def _gaussian_epsilon(sigma: float, delta: float) -> float:
    """The exact epsilon of the Gaussian mechanism of sensitivity 1 and noise
    ``sigma`` at ``delta`` (Balle and Wang 2018, Theorem 8)."""
    mu = 1.0 / sigma

    def excess(eps):
        d = stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(
            -eps / mu - mu / 2
        )
        return d - delta

    return optimize.brentq(excess, 0.0, 100.0)


def _epsilon_lower_bound(out_scores, in_scores, delta, confidence=0.999):
    """max over thresholds of log((TPR_low - delta) / FPR_high)."""
    n_out, n_in = len(out_scores), len(in_scores)
    best = 0.0
    for t in np.quantile(in_scores, np.linspace(0.01, 0.99, 99)):
        tp = int(np.sum(in_scores > t))
        fp = int(np.sum(out_scores > t))
        tpr_low = stats.beta.ppf(1 - confidence, tp, n_in - tp + 1) if tp else 0.0
        fpr_high = stats.beta.ppf(confidence, fp + 1, n_out - fp)
        if tpr_low - delta > 0:
            best = max(best, math.log((tpr_low - delta) / fpr_high))
    return best


def _scores(clip_in_loss):
    """Each trial's update projected on the canary's direction, canary out
    and in."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, D)).astype(np.float32)
    canary = np.zeros(D, np.float32)
    canary[0] = 10.0  # gradient norm 10: clipped to C (or to 10 C)
    x = np.concatenate([x, canary[None]])

    def loss(w, x, m):
        del m
        return jnp.sum(x * w)  # per example, the gradient is the row

    vg = privacy.clipped_value_and_grad(
        loss, clip_in_loss, 1, batch_argnums=(1, 2), example_mask_fn=lambda x, m: m
    )
    tx = privacy.dp_accumulate(
        optax.sgd(1.0), 1, l2_clip_norm=C, noise_multiplier=SIGMA,
        expected_batch_size=1.0, key=jax.random.key(0),
    )  # fmt: skip
    params = jnp.zeros(D)
    state = tx.init(params)

    def trial(key_data, with_canary):
        mask = jnp.arange(9) < 8 + with_canary
        noise_state, inner = state.inner_state
        s = state._replace(inner_state=(noise_state._replace(key=key_data), inner))
        u, _ = tx.update(vg(params, jnp.asarray(x), mask)[1], s, params)
        return -u[0]  # the noised sum along the canary's direction

    keys = jax.vmap(lambda i: jax.random.key_data(jax.random.key(i)))(
        jnp.arange(2 * TRIALS)
    )
    run = jax.jit(jax.vmap(trial, in_axes=(0, None)))
    out = np.asarray(run(keys[:TRIALS], 0))
    into = np.asarray(run(keys[TRIALS:], 1))
    return out, into


def test_the_audit_bound_stays_below_the_gaussian_mechanisms_epsilon():
    theory = _gaussian_epsilon(SIGMA, DELTA)  # about 2.0 at sigma 2
    out, into = _scores(clip_in_loss=C)
    # the canary moves the mean by exactly C, the noise is sigma C
    assert np.mean(into) - np.mean(out) == pytest.approx(C, abs=5 * SIGMA * C * 0.023)
    assert np.std(out) == pytest.approx(SIGMA * C, rel=0.05)
    assert _epsilon_lower_bound(out, into, DELTA) < theory


def test_the_audit_catches_a_sensitivity_above_c():
    theory = _gaussian_epsilon(SIGMA, DELTA)
    out, into = _scores(clip_in_loss=10 * C)  # noised for C, clipped to 10 C
    assert _epsilon_lower_bound(out, into, DELTA) > theory
