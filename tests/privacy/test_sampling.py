# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`privacy.poisson_microbatches`: Poisson sampling, padded to fixed shapes.

References: the Binomial law of inclusion counts and batch sizes (each
example independently, with probability q), scipy's exact binomial tail for
the cap, and jax_privacy's batch selection for `pad_microbatches`.
"""

from __future__ import annotations

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from optax_accum import privacy
from optax_accum.privacy import _sampling

N, Q, M = 200, 0.3, 16


def _draws(sampler, steps):
    return [sampler.batch(t) for t in range(steps)]


def test_each_example_is_included_independently_with_probability_q():
    steps = 2000
    sampler = privacy.poisson_microbatches(N, Q, M, seed=1)
    counts = np.zeros(N)
    pair = 0  # examples 0 and 1 together: q² if independent
    sizes = []
    for batch in _draws(sampler, steps):
        real = batch.indices[batch.mask]
        counts[real] += 1
        pair += int(0 in real and 1 in real)
        sizes.append(batch.size)
    # Each count is Binomial(steps, q): within 5 standard deviations (a false
    # alarm over 200 examples has probability about 1e-4).
    sd = np.sqrt(steps * Q * (1 - Q))
    assert np.abs(counts - steps * Q).max() < 5 * sd
    # The sizes are Binomial(N, q): their mean and variance (a fixed-size
    # sampler has variance 0).
    sizes = np.asarray(sizes)
    assert abs(sizes.mean() - N * Q) < 5 * np.sqrt(N * Q * (1 - Q) / steps)
    assert sizes.var() == pytest.approx(N * Q * (1 - Q), rel=0.15)
    assert pair / steps == pytest.approx(Q * Q, abs=5 * np.sqrt(Q * Q / steps))


def test_masks_and_padding():
    sampler = privacy.poisson_microbatches(N, Q, M, seed=0, max_microbatches=8)
    assert sampler.num_microbatches == 8 and sampler.max_batch_size == 128
    for batch in _draws(sampler, 50):
        assert batch.indices.shape == batch.mask.shape == (8, M)
        assert batch.indices.dtype == np.int32 and batch.mask.dtype == np.bool_
        flat_idx, flat_mask = batch.indices.ravel(), batch.mask.ravel()
        np.testing.assert_array_equal(flat_mask, flat_idx >= 0)
        assert flat_mask.sum() == batch.size and not batch.truncated
        # Real rows first, sorted, distinct, in range; padding -1 after them.
        real = flat_idx[: batch.size]
        assert np.all(np.diff(real) > 0) and real.min() >= 0 and real.max() < N
        assert np.all(flat_idx[batch.size :] == -1)
        k_real = batch.num_real_microbatches
        assert k_real == -(-batch.size // M)
        assert batch.mask[:k_real].any(axis=1).all()
        assert not batch.mask[k_real:].any()


def test_no_recompilation_across_realised_sizes():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(N, 3)), jnp.float32)
    traces = []

    @jax.jit
    def masked_sum(indices, mask):
        traces.append(indices.shape)  # runs once per compilation
        rows = x[indices]
        return jnp.sum(jnp.where(mask[..., None], rows, 0.0), axis=(0, 1))

    sampler = privacy.poisson_microbatches(N, Q, M, seed=3)
    sizes = set()
    for batch in itertools.islice(sampler, 20):
        got = masked_sum(batch.indices, batch.mask)
        want = np.asarray(x)[batch.indices[batch.mask]].sum(0)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        sizes.add((batch.size, batch.num_real_microbatches))
    assert len({n for _, n in sizes}) > 1  # the number of real micro-batches varies
    assert len(traces) == 1 and masked_sum._cache_size() == 1


def test_deterministic_by_seed_and_resumable():
    a = list(privacy.poisson_microbatches(N, Q, M, seed=7, steps=10))
    b = list(privacy.poisson_microbatches(N, Q, M, seed=7, steps=10))
    c = list(privacy.poisson_microbatches(N, Q, M, seed=8, steps=10))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.indices, y.indices)
        np.testing.assert_array_equal(x.mask, y.mask)
    assert any(
        x.size != z.size or not np.array_equal(x.indices, z.indices)
        for x, z in zip(a, c, strict=True)
    )
    # Resuming at step 6 (a new object, as after a restart) continues the run.
    resumed = list(privacy.poisson_microbatches(N, Q, M, seed=7, start=6, steps=4))
    assert [r.step for r in resumed] == [6, 7, 8, 9]
    for x, r in zip(a[6:], resumed, strict=True):
        np.testing.assert_array_equal(x.indices, r.indices)
    np.testing.assert_array_equal(
        privacy.poisson_microbatches(N, Q, M, seed=7).batch(3).indices, a[3].indices
    )


def test_unbounded_iteration_and_steps():
    sampler = privacy.poisson_microbatches(N, Q, M, seed=0)
    assert len(list(itertools.islice(sampler, 5))) == 5
    assert list(privacy.poisson_microbatches(N, Q, M, seed=0, steps=0)) == []


@pytest.mark.parametrize(
    ("n", "q", "m"),
    [(200, 0.3, 16), (1437, 1024 / 1437, 64), (60_000, 256 / 60_000, 64)],
)
def test_default_cap_bounds_the_overflow_probability(n, q, m):
    sampler = privacy.poisson_microbatches(n, q, m, seed=0)
    bound = sampler.overflow_probability
    assert bound <= _sampling._DEFAULT_OVERFLOW_BOUND
    # The bound is an upper bound of the exact tail, at N + 1 (add-or-remove).
    assert stats.binom.sf(sampler.max_batch_size, n + 1, q) <= bound
    # And the cap is not wasteful: one micro-batch fewer would not be proven.
    assert _sampling.binomial_tail_bound(
        n + 1, q, (sampler.num_microbatches - 1) * m
    ) > (_sampling._DEFAULT_OVERFLOW_BOUND)
    assert sampler.expected_batch_size == pytest.approx(q * n)


def test_tail_bound_is_an_upper_bound():
    for n, p in [(10, 0.5), (100, 0.01), (1000, 0.9), (5000, 0.2)]:
        for cap in range(0, n + 1, max(1, n // 50)):
            assert stats.binom.sf(cap, n, p) <= _sampling.binomial_tail_bound(
                n, p, cap
            ) * (1 + 1e-9)


def test_sampling_rate_one_takes_every_example():
    batch = privacy.poisson_microbatches(10, 1.0, 4, seed=0).batch(0)
    assert batch.indices.shape == (3, 4) and batch.size == 10
    np.testing.assert_array_equal(batch.indices.ravel()[:10], np.arange(10))
    # The neighbour with N + 1 examples must fit too: 128 examples of
    # micro-batches of 64 take a third, all-padding micro-batch.
    full = privacy.poisson_microbatches(128, 1.0, 64, seed=0)
    assert full.num_microbatches == 3 and full.overflow_probability == 0.0
    assert privacy.poisson_microbatches(
        128, 1.0, 64, seed=0, max_microbatches=2
    ).overflow_probability == pytest.approx(1.0)


def test_overflow_truncates_to_a_uniform_subset_of_the_cap():
    # E[size] = 50 against a cap of 40: almost every draw overflows.
    sampler = privacy.poisson_microbatches(100, 0.5, 4, seed=0, max_microbatches=10)
    assert sampler.max_batch_size == 40 and sampler.overflow_probability > 0.5
    counts, truncated, steps = np.zeros(100), 0, 1000
    with pytest.warns(UserWarning, match="truncated to the cap of 40"):
        batches = _draws(sampler, steps)
    for batch in batches:
        assert batch.size <= 40 and batch.mask.all() == (batch.size == 40)
        truncated += batch.truncated
        counts[batch.indices[batch.mask]] += 1
    assert truncated > 0.9 * steps
    # The truncated draw keeps each example with probability E[min(X, 40)] / N.
    x = np.arange(101)
    p = (np.minimum(x, 40) * stats.binom.pmf(x, 100, 0.5)).sum() / 100
    assert np.abs(counts - steps * p).max() < 5 * np.sqrt(steps * p * (1 - p))


def test_overflow_raise_names_the_step_and_the_cap():
    sampler = privacy.poisson_microbatches(
        100, 0.5, 4, seed=0, max_microbatches=10, overflow="raise"
    )
    with pytest.raises(ValueError, match=r"Logical batch 0 .*max_microbatches=10"):
        sampler.batch(0)
    # Without an overflow, "raise" gives the batches "truncate" gives.
    ok = privacy.poisson_microbatches(N, Q, M, seed=5, overflow="raise")
    np.testing.assert_array_equal(
        ok.batch(2).indices,
        privacy.poisson_microbatches(N, Q, M, seed=5).batch(2).indices,
    )


def test_pad_microbatches_takes_jax_privacy_batches():
    batch_selection = pytest.importorskip("jax_privacy.batch_selection")
    strategy = batch_selection.CyclicPoissonSampling(sampling_prob=0.3, iterations=5)
    for indices in strategy.batch_iterator(N, rng=0):
        idx, mask = privacy.pad_microbatches(indices, M, 8)
        assert idx.shape == mask.shape == (8, M) and mask.sum() == indices.size
        np.testing.assert_array_equal(idx[mask], indices)
        assert np.all(idx[~mask] == -1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_examples": 0}, ValueError, r"`num_examples` must be >= 1, got 0"),
        ({"num_examples": 2.5}, TypeError, r"`num_examples` must be an integer"),
        (
            {"sampling_rate": 0.0},
            ValueError,
            r"`sampling_rate` must be in \(0, 1\], got 0",
        ),
        ({"sampling_rate": 1.5}, ValueError, r"`sampling_rate` .*got 1.5"),
        ({"sampling_rate": -0.1}, ValueError, r"`sampling_rate` .*got -0.1"),
        ({"sampling_rate": float("nan")}, ValueError, r"`sampling_rate` .*got nan"),
        ({"sampling_rate": "0.1"}, TypeError, r"`sampling_rate` must be a real"),
        ({"microbatch_size": 0}, ValueError, r"`microbatch_size` must be >= 1, got 0"),
        (
            {"microbatch_size": -4},
            ValueError,
            r"`microbatch_size` must be >= 1, got -4",
        ),
        ({"seed": -1}, ValueError, r"`seed` must be >= 0, got -1"),
        ({"seed": None}, TypeError, r"`seed` must be an integer, got None"),
        (
            {"max_microbatches": 0},
            ValueError,
            r"`max_microbatches` must be >= 1, got 0",
        ),
        ({"overflow": "split"}, ValueError, r"`overflow` must be one of .*'split'"),
        ({"steps": -1}, ValueError, r"`steps` must be >= 0, got -1"),
        ({"start": -2}, ValueError, r"`start` must be >= 0, got -2"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    args = {"num_examples": N, "sampling_rate": Q, "microbatch_size": M, "seed": 0}
    args.update(kwargs)
    positional = [
        args.pop(k) for k in ("num_examples", "sampling_rate", "microbatch_size")
    ]
    with pytest.raises(error, match=match):
        privacy.poisson_microbatches(*positional, **args)


def test_bad_step_and_padding_arguments_are_named():
    sampler = privacy.poisson_microbatches(N, Q, M, seed=0)
    with pytest.raises(ValueError, match=r"`step` must be >= 0, got -1"):
        sampler.batch(-1)
    with pytest.raises(ValueError, match=r"`indices` must be a 1-D integer array"):
        privacy.pad_microbatches(np.zeros((2, 2), np.int32), 2, 2)
    with pytest.raises(ValueError, match=r"`indices` must be >= 0, got -1"):
        privacy.pad_microbatches(np.array([3, -1]), 2, 2)
    with pytest.raises(ValueError, match=r"holds 5 examples.*`num_microbatches=2`"):
        privacy.pad_microbatches(np.arange(5), 2, 2)
    with pytest.raises(ValueError, match=r"`microbatch_size` must be >= 1, got 0"):
        privacy.pad_microbatches(np.arange(5), 0, 2)


def test_fused_rows_give_the_fused_loop_the_batch_micro_batches():
    x = np.random.default_rng(0).normal(size=(N, 3)).astype(np.float32)
    sampler = privacy.poisson_microbatches(N, Q, M, seed=2, max_microbatches=8)
    k = sampler.num_microbatches
    traces = []

    def loss(w, x, mask):
        del mask
        return jnp.sum(x * w)  # per example: the gradient is the row itself

    vg = privacy.clipped_value_and_grad(
        loss, 1e6, k, batch_argnums=(1, 2), example_mask_fn=lambda x, mask: mask
    )

    @jax.jit
    def step(w, rows, mask):
        traces.append(None)
        # Each micro-batch as the fused loop splits it: row i, i + k, ...
        return vg(w, jnp.asarray(x)[rows], mask)[1], mask.reshape(-1, k).T

    for batch in itertools.islice(sampler, 5):
        rows, mask = batch.fused_rows()
        grads, split_masks = step(jnp.zeros(3, jnp.float32), rows, mask)
        np.testing.assert_array_equal(split_masks, batch.mask)
        np.testing.assert_array_equal(rows.reshape(-1, k).T, batch.indices)
        want = x[batch.indices[batch.mask]].sum(0)
        np.testing.assert_allclose(grads, want, rtol=1e-5, atol=1e-5)
    assert len(traces) == 1


def test_padding_rows_read_no_example():
    # Issue 39, finding 5: indexing with the -1 padding read example N - 1
    # into every padding row; changing it, unsampled, moved the clipped sum
    # by 23.0 (bound 1). `take` reads no example for them.
    from .reference import clipped_sum, data, loss

    n, c = 40, 1.0
    params, x, y = data(rows=n, scale=3.0)
    sampler = privacy.poisson_microbatches(n, 0.1, 4, seed=0)
    batch = next(
        b
        for b in sampler
        if b.size and not b.mask.all() and n - 1 not in b.indices[b.mask]
    )
    k = sampler.num_microbatches
    plain = privacy.clipped_value_and_grad(loss, c, k, batch_argnums=(1, 2))
    masked = privacy.clipped_value_and_grad(
        lambda p, x, y, m: loss(p, x, y), c, k, batch_argnums=(1, 2, 3),
        example_mask_fn=lambda x, y, m: m,
    )  # fmt: skip
    x2, y2 = x.copy(), y.copy()
    x2[n - 1], y2[n - 1] = 100.0, -100.0  # not sampled in this batch
    sums = []
    for xs, ys in [(x, y), (x2, y2)]:
        xb, yb, mask = batch.take(xs, ys)
        sums.append((plain(params, xb, yb)[1], masked(params, xb, yb, mask)[1]))
    for a, b in zip(jax.tree.leaves(sums[0]), jax.tree.leaves(sums[1]), strict=True):
        np.testing.assert_array_equal(a, b)
    # with the mask, exactly the sampled examples' clipped sum
    real = batch.indices[batch.mask]
    _, ref = clipped_sum(params, x[real], y[real], c)
    for a, r in zip(jax.tree.leaves(sums[0][1]), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6)
    # JAX arrays and the per-micro-batch layout
    xj, mask = batch.take(jnp.asarray(x), fused=False)
    assert isinstance(xj, jax.Array) and xj.shape == (k, 4, 3)
    np.testing.assert_array_equal(np.asarray(xj)[~mask], 0.0)
    np.testing.assert_array_equal(np.asarray(xj)[mask], x[real])


def test_truncation_by_a_user_cap_warns_once_with_its_probability():
    # Issue 39, finding 9: N = 500, q = 0.05, cap 40 truncated a batch in
    # about 650 silently (the `truncated` flag only).
    sampler = privacy.poisson_microbatches(500, 0.05, 8, seed=0, max_microbatches=5)
    assert sampler.max_batch_size == 40
    p = stats.binom.sf(40, 500, 0.05)  # 0.155% per step
    with pytest.warns(UserWarning, match=r"probability 0\.00155 \(0\.155%\) per step"):
        first = next(b for b in sampler if b.truncated)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per sampler
        later = [b.step for b in itertools.islice(sampler, 20_000) if b.truncated]
    assert len(later) > 1 and first.step in later
    assert _sampling.binomial_tail(500, 0.05, 40) == pytest.approx(p, rel=1e-9)
    # no truncation, no warning: the default cap, or overflow="raise"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default = privacy.poisson_microbatches(500, 0.05, 8, seed=0)
        assert not any(b.truncated for b in itertools.islice(default, 2000))
