# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The DP-SGD pitfalls of docs/guides/privacy.md, each pinned.

Each test computes the mistake by hand next to `dp_accumulate`, and checks
that the library's update is the correct one and measurably not the
mistake's: noise on the mean instead of the sum, noise on every micro-step,
noise per device, normalising by the realised batch size, and reusing the
noise key. The noise is read as ``update - noiseless update`` with
``optax.sgd(1.0)``, on a vector of D zeros, so that its standard deviation is
estimated to about 0.5%.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import privacy

D, C, SIGMA, B = 20_000, 1.0, 1.5, 64.0
TOL = 0.05  # relative, on a standard deviation estimated from D draws


def _tx(every_k=1, sigma=SIGMA, key=0, b=B, axis_name=None):
    return privacy.dp_accumulate(
        optax.sgd(1.0), every_k, l2_clip_norm=C, noise_multiplier=sigma,
        expected_batch_size=b, key=jax.random.key(key), axis_name=axis_name,
    )  # fmt: skip


def _updates(tx, calls, params=None):
    """The updates of one run of ``calls`` (gradient trees) from a fresh state."""
    params = {"w": jnp.zeros(D)} if params is None else params
    state, out = tx.init(params), []
    update = jax.jit(tx.update)
    for g in calls:
        u, state = update(g, state, params)
        out.append(np.asarray(u["w"], np.float64))
    return out


def _zeros():
    return {"w": jnp.zeros(D)}


def _std_close(noise, want):
    assert abs(np.std(noise) / want - 1) < TOL, (np.std(noise), want)


def test_noise_is_added_to_the_sum_not_the_mean():
    rng = np.random.default_rng(0)
    clipped_sum = {"w": jnp.asarray(rng.normal(size=D), jnp.float32)}
    (noisy,) = _updates(_tx(), [clipped_sum])
    (noiseless,) = _updates(_tx(sigma=0.0), [clipped_sum])
    np.testing.assert_allclose(noiseless, -np.asarray(clipped_sum["w"]) / B, rtol=1e-6)
    noise = noisy - noiseless
    # N(0, σ²C²) on the sum, then / B: σC/B on the mean.
    _std_close(noise, SIGMA * C / B)
    # The mistake, N(0, σ²C²) on the mean, is B times louder.
    mistake = SIGMA * C
    assert np.std(noise) < mistake / (B / 2)


def test_noise_is_drawn_once_per_window_not_on_every_micro_step():
    k = 4
    updates = _updates(_tx(every_k=k), [_zeros()] * k)
    for hold in updates[:-1]:
        np.testing.assert_array_equal(hold, 0.0)  # hold steps: exact zeros
    _std_close(updates[-1], SIGMA * C / B)
    # The mistake, a draw on each of the k micro-steps, sums to √k times it.
    assert np.std(updates[-1]) < np.sqrt(k) * SIGMA * C / B * (1 - 2 * TOL)
    # And it is the draw of the fused form (one call with the whole sum).
    (fused,) = _updates(_tx(every_k=1), [_zeros()])
    np.testing.assert_array_equal(updates[-1], fused)


def test_noise_is_drawn_once_for_all_devices_not_per_device():
    n = jax.device_count()
    assert n == 8
    mesh = jax.make_mesh((n,), ("d",))
    tx = _tx(axis_name="d")
    params = _zeros()
    specs = optax_accum.state_specs(jax.eval_shape(tx.init, params), "d")
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def step(p, s, g):
        u, s = tx.update({"w": g[0]}, s, p)  # this device's clipped sum
        return u, jax.tree.map(lambda a: a[None], u)

    step = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), specs, P("d")), out_specs=(P(), P("d"))
        )
    )
    g = jax.device_put(jnp.zeros((n, D)), NamedSharding(mesh, P("d")))
    u, copies = step(params, init(params), g)
    copies = np.asarray(copies["w"])
    np.testing.assert_array_equal(copies, copies[:1].repeat(n, 0))  # one draw
    noise = np.asarray(u["w"], np.float64)
    _std_close(noise, SIGMA * C / B)
    # The mistake, a draw per device summed over devices, is √n times louder.
    assert np.std(noise) < np.sqrt(n) * SIGMA * C / B * (1 - 2 * TOL)
    (one_device,) = _updates(_tx(), [_zeros()])
    np.testing.assert_allclose(noise, one_device, rtol=1e-6, atol=1e-9)


def test_normalised_by_the_expected_batch_size_not_the_realised_one():
    n, q, m = 300, 0.2, 16
    sampler = privacy.poisson_microbatches(n, q, m, seed=0)
    b = sampler.expected_batch_size
    x = np.random.default_rng(1).normal(size=(n, 4)).astype(np.float32)

    def loss(w, x, mask):
        del mask
        return jnp.sum(x * w)  # per example, the gradient is the row (norm < 10)

    vg = jax.jit(
        privacy.clipped_value_and_grad(
            loss, 10.0, sampler.num_microbatches, batch_argnums=(1, 2),
            example_mask_fn=lambda x, mask: mask,
        )
    )  # fmt: skip
    params = {"w": jnp.zeros(4)}
    tx = privacy.dp_accumulate(
        optax.sgd(1.0), 1, l2_clip_norm=10.0, noise_multiplier=0.0,
        expected_batch_size=b, key=jax.random.key(0),
    )  # fmt: skip

    def update(xb, mask):
        g = vg(params["w"], xb, mask)[1]
        return np.asarray(tx.update({"w": g}, tx.init(params), params)[0]["w"])

    sizes = set()
    for batch in (sampler.batch(t) for t in range(4)):
        rows, mask = batch.fused_rows()
        u = update(x[rows], mask)
        real_sum = x[batch.indices[batch.mask]].sum(0)
        np.testing.assert_allclose(u, -real_sum / b, rtol=1e-5, atol=1e-6)
        sizes.add(batch.size)
    assert len(sizes) > 1
    # Why: the neighbouring data set with one more example, whose gradient is
    # 0, gives the same clipped sum. Divided by B, the update is the same;
    # divided by the realised size it moves, and tells that the example is in.
    xb = x[rows]
    extra = int(np.flatnonzero(~mask)[0])  # a padding row becomes that example
    xb[extra], mask_plus = 0.0, mask.copy()
    mask_plus[extra] = True
    np.testing.assert_array_equal(update(xb, mask_plus), update(xb, mask))
    size = batch.size
    realised, realised_plus = u * b / size, u * b / (size + 1)
    assert not np.allclose(realised, realised_plus, rtol=1e-4)


def test_each_window_draws_fresh_noise_from_the_key_in_the_state():
    windows = 4
    noise = np.stack(_updates(_tx(), [_zeros()] * windows))
    corr = np.corrcoef(noise)
    off_diagonal = corr[~np.eye(windows, dtype=bool)]
    assert np.abs(off_diagonal).max() < 0.05  # fresh, independent draws
    # The same key repeats the run (resumable); another key gives other noise.
    np.testing.assert_array_equal(noise, np.stack(_updates(_tx(), [_zeros()] * 4)))
    other = np.stack(_updates(_tx(key=1), [_zeros()] * windows))
    assert np.abs(np.corrcoef(noise[0], other[0])[0, 1]) < 0.05
    # The mistake: a state made afresh for each step (or a key reused) draws
    # window 0's noise every time, and averaging the steps never cancels it.
    repeated = [_updates(_tx(), [_zeros()])[0] for _ in range(2)]
    np.testing.assert_array_equal(repeated[0], repeated[1])
    np.testing.assert_array_equal(repeated[0], noise[0])
