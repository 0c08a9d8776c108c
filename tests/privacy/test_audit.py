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
from jax.sharding import PartitionSpec as P
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


def _scores(clip_in_loss, sigma=SIGMA, dtype=jnp.float32, calls=1, k=1, mesh=None):
    """Each trial's update projected on the canary's direction, canary out
    and in: ``calls`` calls per window, each clipped in ``k`` micro-batches,
    the parameters in ``dtype``, the rows sharded over ``mesh``'s data axis
    when given (the global view)."""
    rows = 8 * calls  # the canary is the last call's last row
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, D)).astype(np.float32)
    canary = np.zeros(D, np.float32)
    canary[0] = 10.0  # gradient norm 10: clipped to C (or to 10 C)
    x = np.concatenate([x[:-1], canary[None]]).reshape(calls, 8, D)

    def loss(w, x, m):
        del m
        return jnp.sum(x * w.astype(x.dtype))  # per example, the row

    vg = privacy.clipped_value_and_grad(
        loss, clip_in_loss, k, batch_argnums=(1, 2), example_mask_fn=lambda x, m: m
    )
    tx = privacy.dp_accumulate(
        optax.sgd(1.0), calls, l2_clip_norm=C, noise_multiplier=sigma,
        expected_batch_size=1.0, key=jax.random.key(0),
    )  # fmt: skip
    params = jnp.zeros(D, dtype)
    xs = jnp.asarray(x, dtype)
    if mesh is not None:
        xs = jax.device_put(xs, jax.sharding.NamedSharding(mesh, P(None, "data")))
    state = tx.init(params)

    def trial(key_data, with_canary):
        noise_state, inner = state.inner_state
        s = state._replace(inner_state=(noise_state._replace(key=key_data), inner))
        for c in range(calls):
            mask = jnp.arange(8) < 7 + (with_canary if c == calls - 1 else 1)
            u, s = tx.update(vg(params, xs[c], mask)[1], s, params)
        return -u[0].astype(jnp.float32)  # the noised sum along the canary

    keys = jax.vmap(lambda i: jax.random.key_data(jax.random.key(i)))(
        jnp.arange(2 * TRIALS)
    )
    run = jax.jit(jax.vmap(trial, in_axes=(0, None)))
    out = np.asarray(run(keys[:TRIALS], 0))
    into = np.asarray(run(keys[TRIALS:], 1))
    return out, into


CASES = {  # name: (sigma, parameters' dtype, calls per window, micro-batches)
    "sigma2_f32": (2.0, jnp.float32, 1, 1),
    "sigma1_f32_3calls": (1.0, jnp.float32, 3, 2),
    "sigma4_bf16_2calls": (4.0, jnp.bfloat16, 2, 4),
    "sigma2_f16": (2.0, jnp.float16, 1, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_audit_bound_stays_below_the_gaussian_mechanisms_epsilon(case):
    sigma, dtype, calls, k = CASES[case]
    theory = _gaussian_epsilon(sigma, DELTA)
    out, into = _scores(C, sigma, dtype, calls, k)
    # the canary moves the mean by exactly C, the noise is sigma C
    spread = sigma * C / math.sqrt(TRIALS)
    assert np.mean(into) - np.mean(out) == pytest.approx(
        C, abs=5 * math.sqrt(2) * spread
    )
    assert np.std(out) == pytest.approx(sigma * C, rel=0.05)
    assert _epsilon_lower_bound(out, into, DELTA) < theory


def test_the_audit_holds_with_the_rows_sharded_over_a_data_axis():
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        out, into = _scores(C, 2.0, jnp.float32, 2, 2, mesh=mesh)
    assert np.std(out) == pytest.approx(2.0 * C, rel=0.05)
    assert _epsilon_lower_bound(out, into, DELTA) < _gaussian_epsilon(2.0, DELTA)


def test_the_audit_catches_a_sensitivity_above_c():
    theory = _gaussian_epsilon(SIGMA, DELTA)
    out, into = _scores(clip_in_loss=10 * C)  # noised for C, clipped to 10 C
    assert _epsilon_lower_bound(out, into, DELTA) > theory


def test_the_audit_catches_too_little_noise(monkeypatch):
    """A seeded bug: noise of a quarter of its standard deviation. (Complex
    noise at variance 1/2 per part was short by sqrt(2): too little for 4,000
    trials to show, so its own test measures the variance directly.)"""
    from optax_accum.privacy import _noise

    normal = _noise._standard_normal
    monkeypatch.setattr(_noise, "_standard_normal", lambda *a: normal(*a) / 4)
    out, into = _scores(C, sigma=SIGMA, calls=2, k=2)
    assert _epsilon_lower_bound(out, into, DELTA) > _gaussian_epsilon(SIGMA, DELTA)
