# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`privacy.dp_accumulate`: the noise once per window, its scale, its key, the
noiseless path against a float64 reference, hold steps and errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum import privacy

from .reference import clipped_sum, data, loss

C, B, SIGMA = 1.0, 16.0, 1.5


def _tx(inner=None, k=1, sigma=SIGMA, key=None, **kw):
    return privacy.dp_accumulate(
        inner or optax.sgd(1.0), k, l2_clip_norm=C, noise_multiplier=sigma,
        expected_batch_size=B, key=jax.random.key(7) if key is None else key, **kw,
    )  # fmt: skip


def _run(tx, params, x, y, calls, k_per_call):
    """Feeds the batch in ``calls`` calls, each clipped in ``k_per_call``
    micro-batches; returns the updates of every call and the state."""
    vg = privacy.clipped_value_and_grad(loss, C, k_per_call, batch_argnums=(1, 2))
    state = tx.init(params)
    out = []
    step = jax.jit(lambda p, s, x, y: tx.update(vg(p, x, y)[1], s, p))
    for xs, ys in zip(np.split(x, calls), np.split(y, calls), strict=True):
        u, state = step(params, state, xs, ys)
        out.append(u)
    return out, state


def _noise_draw(key, window, params):
    """The standard normal draw of window ``window``: leaf ``i`` from
    ``fold_in(fold_in(key, window), i)``."""
    k = jax.random.fold_in(key, window)
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(
        treedef,
        [jax.random.normal(jax.random.fold_in(k, i), np.shape(p))
         for i, p in enumerate(leaves)],
    )  # fmt: skip


def test_noiseless_equals_clipped_sum_over_b_through_adam_float64():
    params, x, y = data(rows=32, scale=2.0)
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-8
    tx = _tx(optax.adam(lr, b1, b2, eps), k=2, sigma=0.0)
    updates, _ = _run(tx, params, x, y, calls=4, k_per_call=2)
    # float64 Adam over the two windows' clipped sums / B
    m = v = {"w": np.zeros(3), "b": np.zeros(())}
    for t, (lo, hi) in enumerate([(0, 16), (16, 32)], start=1):
        _, g = clipped_sum(params, x[lo:hi], y[lo:hi], C)
        g = {n: np.asarray(a) / B for n, a in g.items()}
        m = {n: b1 * m[n] + (1 - b1) * g[n] for n in g}
        v = {n: b2 * v[n] + (1 - b2) * g[n] ** 2 for n in g}
        c1, c2 = 1 - b1**t, 1 - b2**t
        ref = {n: -lr * (m[n] / c1) / (np.sqrt(v[n] / c2) + eps) for n in g}
        emitted = updates[2 * t - 1]
        for n in ref:
            np.testing.assert_allclose(emitted[n], ref[n], rtol=1e-5, atol=1e-6)
        hold = updates[2 * t - 2]
        assert all(np.all(np.asarray(h) == 0) for h in jax.tree.leaves(hold))


@pytest.mark.parametrize(
    "calls, k_per_call, every_k", [(1, 4, 1), (4, 1, 4), (2, 2, 2)]
)
def test_noise_is_one_draw_however_the_window_is_split(calls, k_per_call, every_k):
    params, x, y = data(rows=16, scale=2.0)
    key = jax.random.key(3)
    noisy, _ = _run(_tx(k=every_k, key=key), params, x, y, calls, k_per_call)
    clean, _ = _run(_tx(k=every_k, key=key, sigma=0.0), params, x, y, calls, k_per_call)
    draw = _noise_draw(key, 0, params)
    for a, b, z in zip(*(jax.tree.leaves(t) for t in (noisy[-1], clean[-1], draw)),
                       strict=True):  # fmt: skip
        # sgd(1.0): the update is minus the gradient
        np.testing.assert_allclose(
            np.asarray(a) - np.asarray(b), -SIGMA * C / B * np.asarray(z),
            rtol=1e-4, atol=1e-6,
        )  # fmt: skip
    for u in noisy[:-1]:  # hold steps: exact zeros, no noise
        assert all(np.all(np.asarray(h) == 0) for h in jax.tree.leaves(u))


def test_each_window_draws_fresh_noise_and_a_key_repeats_a_run():
    params = {"w": jnp.zeros(64)}
    tx = _tx(k=1)
    state = tx.init(params)
    zeros = {"w": jnp.zeros(64)}
    u0, state = tx.update(zeros, state, params)
    u1, state = tx.update(zeros, state, params)
    assert not np.allclose(u0["w"], u1["w"])
    again = tx.init(params)
    v0, _ = tx.update(zeros, again, params)
    np.testing.assert_array_equal(u0["w"], v0["w"])


def test_empirical_std_over_200_keys():
    params = {"w": jnp.zeros(512), "b": jnp.zeros(())}
    tx = _tx(k=1)
    state = tx.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)

    def noise(key_data):
        noise_state, inner = state.inner_state
        s = state._replace(inner_state=(noise_state._replace(key=key_data), inner))
        return -tx.update(zeros, s, params)[0]["w"]  # sgd(1.0)

    keys = jax.vmap(lambda i: jax.random.key_data(jax.random.key(i)))(jnp.arange(200))
    draws = np.asarray(jax.jit(jax.vmap(noise))(keys))
    # one element's 200 draws, and all of them
    target = SIGMA * C / B
    assert abs(draws[:, 0].std() / target - 1) < 0.1
    assert abs(draws.std() / target - 1) < 0.01
    assert abs(draws.mean()) < 0.01 * target


def test_raw_uint32_key_equals_typed_key():
    params = {"w": jnp.zeros(8)}
    g = {"w": jnp.ones(8)}
    typed = _tx(key=jax.random.key(5))
    raw = _tx(key=jax.random.PRNGKey(5))
    a = typed.update(g, typed.init(params), params)[0]["w"]
    b = raw.update(g, raw.init(params), params)[0]["w"]
    np.testing.assert_array_equal(a, b)


def test_close_window_noises_a_partial_window_once():
    params, x, y = data(rows=8)
    key = jax.random.key(1)
    vg = privacy.clipped_value_and_grad(loss, C, 1, batch_argnums=(1, 2))
    for sigma in (SIGMA, 0.0):
        tx = _tx(k=4, key=key, sigma=sigma)
        state = tx.init(params)
        _, state = tx.update(vg(params, x[:4], y[:4])[1], state, params)
        u, state = tx.update(vg(params, x[4:], y[4:])[1], state, params,
                             close_window=True)  # fmt: skip
        if sigma:
            noisy = u
    _, ref = clipped_sum(params, x, y, C)
    draw = _noise_draw(key, 0, params)
    for a, r, z in zip(*(jax.tree.leaves(t) for t in (noisy, ref, draw)), strict=True):
        np.testing.assert_allclose(
            -np.asarray(a), (r + SIGMA * C * np.asarray(z)) / B, rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"l2_clip_norm": 0.0}, ValueError, "`l2_clip_norm` must be finite and > 0"),
        ({"l2_clip_norm": -1}, ValueError, "`l2_clip_norm`.*-1"),
        ({"noise_multiplier": -0.5}, ValueError, "`noise_multiplier`.*-0.5"),
        ({"noise_multiplier": float("nan")}, ValueError, "`noise_multiplier`"),
        ({"expected_batch_size": 0.5}, ValueError, "`expected_batch_size`.*0.5"),
        ({"expected_batch_size": 0}, ValueError, "`expected_batch_size`.*got 0"),
        ({"key": 0}, TypeError, "`key` must be a PRNG key.*got 0"),
        ({"key": np.zeros(2, np.int32)}, TypeError, "`key` must be a PRNG key"),
        ({"key": np.zeros(3, np.uint32)}, TypeError, "`key` must be a PRNG key"),
        ({"noise_multiplier": "1"}, TypeError, "`noise_multiplier`"),
        ({"inner": optax.adam}, TypeError, "`inner` is the function `adam`"),
        ({"every_k": 0}, ValueError, "`every_k`"),
    ],
)
def test_errors(kwargs, error, match):
    args = dict(
        inner=optax.sgd(1.0), every_k=2, l2_clip_norm=C, noise_multiplier=SIGMA,
        expected_batch_size=B, key=jax.random.key(0),
    )  # fmt: skip
    args.update(kwargs)
    inner, every_k = args.pop("inner"), args.pop("every_k")
    with pytest.raises(error, match=match):
        privacy.dp_accumulate(inner, every_k, **args)


def test_batch_of_keys_and_weight_are_refused():
    with pytest.raises(ValueError, match="`key` must be a single PRNG key"):
        _tx(key=jax.random.split(jax.random.key(0), 2))
    tx = _tx()
    params = {"w": jnp.zeros(2)}
    with pytest.raises(ValueError, match=r"takes no `weight`.*got weight=0.5"):
        tx.update(params, tx.init(params), params, weight=0.5)


def _window_sum(params, x, y, calls, k_per_call, real=None):
    """The pre-noise window sum of ``calls`` calls: sigma = 0, B = 1 and
    sgd(1) emit minus it. Rows where ``real`` is False are padding."""
    tx = privacy.dp_accumulate(
        optax.sgd(1.0), calls, l2_clip_norm=C, noise_multiplier=0.0,
        expected_batch_size=1, key=jax.random.key(0),
    )  # fmt: skip
    real = np.ones(len(y), bool) if real is None else real
    vg = privacy.clipped_value_and_grad(
        lambda p, x, y, m: loss(p, x, y), C, k_per_call, batch_argnums=(1, 2, 3),
        example_mask_fn=lambda x, y, m: m,
    )  # fmt: skip
    state = tx.init(params)
    step = jax.jit(lambda p, s, *b: tx.update(vg(p, *b)[1], s, p))
    for b in zip(*(np.split(a, calls) for a in (x, y, real)), strict=True):
        u, state = step(params, state, *b)
    return -np.concatenate([np.ravel(a) for a in jax.tree.leaves(u)])


def test_window_sum_does_not_depend_on_the_split():
    params, x, y = data(rows=16, scale=2.0)
    ref = np.concatenate(
        [np.ravel(g) for g in jax.tree.leaves(clipped_sum(params, x, y, C)[1])]
    )
    for calls, k in [(1, 1), (1, 16), (2, 4), (4, 2), (8, 1), (16, 1)]:
        np.testing.assert_allclose(
            _window_sum(params, x, y, calls, k), ref, rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("row", [0, 9, 15])
@pytest.mark.parametrize("scale", [1.0, 1e6])
def test_one_example_moves_the_window_sum_by_at_most_c(row, scale):
    # Neighbouring datasets: the same window with one example present or
    # absent (padding), whatever its gradient, in whichever call it lands.
    params, x, y = data(rows=16, scale=2.0)
    x[row], y[row] = scale, -scale
    absent = np.arange(16) != row
    with_it = _window_sum(params, x, y, calls=4, k_per_call=2)
    without = _window_sum(params, x, y, calls=4, k_per_call=2, real=absent)
    moved = np.linalg.norm(with_it - without)
    assert moved <= C * (1 + 1e-5)
    if scale > 1:
        assert moved >= 0.99 * C  # clipped to C, not dropped


@pytest.mark.parametrize(
    "dtype, rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2), (jnp.float16, 2e-3)]
)
def test_dtypes(dtype, rtol):
    params, x, y = data(rows=16, scale=2.0)
    p = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
    xd, yd = jnp.asarray(x, dtype), jnp.asarray(y, dtype)
    key = jax.random.key(2)
    noisy, _ = _run(_tx(k=2, key=key), p, xd, yd, calls=2, k_per_call=2)
    clean, state = _run(_tx(k=2, key=key, sigma=0.0), p, xd, yd, 2, 2)
    # the clipped sums are float32 for every parameter dtype, and so is all
    # that follows: the noise is never rounded to bf16 before it is added
    assert state.accumulator["w"].dtype == jnp.float32
    assert noisy[-1]["w"].dtype == jnp.float32
    draw = _noise_draw(key, 0, params)
    for n, cl, z in zip(*(jax.tree.leaves(t) for t in (noisy[-1], clean[-1], draw)),
                        strict=True):  # fmt: skip
        np.testing.assert_allclose(
            np.asarray(n) - np.asarray(cl), -SIGMA * C / B * np.asarray(z),
            rtol=1e-4, atol=1e-6,
        )  # fmt: skip
    ref_params = jax.tree.map(lambda a: np.asarray(jnp.asarray(a, dtype)), params)
    _, ref = clipped_sum(ref_params, np.asarray(xd), np.asarray(yd), C)
    for u, r in zip(jax.tree.leaves(clean[-1]), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(-np.asarray(u), r / B, rtol=rtol, atol=rtol)


def test_more_bad_options():
    with pytest.raises(TypeError, match="`expected_batch_size` must be a real"):
        privacy.dp_accumulate(
            optax.sgd(1.0), 1, l2_clip_norm=C, noise_multiplier=1.0,
            expected_batch_size=True, key=jax.random.key(0),
        )  # fmt: skip

    @jax.jit
    def traced(c):
        return privacy.dp_accumulate(
            optax.sgd(1.0), 1, l2_clip_norm=c, noise_multiplier=1.0,
            expected_batch_size=4, key=jax.random.key(0),
        )  # fmt: skip

    with pytest.raises(TypeError, match="`l2_clip_norm` must be a Python or NumPy"):
        traced(1.0)
    with pytest.raises(TypeError, match="`has_aux` must be a bool"):
        privacy.clipped_value_and_grad(loss, 1.0, has_aux=1)


@pytest.mark.parametrize("num_real", [16, 10, 3, 0])
def test_divides_by_the_expected_batch_size_not_the_realised_one(num_real):
    # Poisson sampling: the realised batch varies; dividing by it would leak it.
    params, x, y = data(rows=16, scale=2.0)
    real = np.arange(16) < num_real
    tx = _tx(k=2, sigma=0.0)
    vg = privacy.clipped_value_and_grad(
        lambda p, x, y, m: loss(p, x, y), C, 2, batch_argnums=(1, 2, 3),
        example_mask_fn=lambda x, y, m: m,
    )  # fmt: skip
    state = tx.init(params)
    for b in zip(*(np.split(a, 2) for a in (x, y, real)), strict=True):
        u, state = tx.update(vg(params, *b)[1], state, params)
    _, ref = clipped_sum(params, x, y, C, real)
    for a, r in zip(jax.tree.leaves(u), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(-np.asarray(a), r / B, rtol=1e-5, atol=1e-7)
    assert bool(optax_accum.has_updated(state))  # an empty window still steps


def test_no_recompile_across_windows_and_steps():
    params, x, y = data(rows=16)
    params = jax.tree.map(jnp.asarray, params)  # as the step returns them
    tx = _tx(optax.adam(0.1), k=2)
    vg = privacy.clipped_value_and_grad(loss, C, 2, batch_argnums=(1, 2))

    @jax.jit
    def step(p, s, x, y):
        u, s = tx.update(vg(p, x, y)[1], s, p)
        return optax.apply_updates(p, u), s

    state = tx.init(params)
    for xs, ys in zip(np.split(x, 4), np.split(y, 4), strict=True):
        params, state = step(params, state, xs, ys)
    assert step._cache_size() == 1
    assert int(state.inner_state[0].windows) == 2


def test_complex_noise_has_sigma_c_on_each_real_coordinate():
    # Issue 39, finding 1: the clip measures a complex entry as two real
    # coordinates, so its real and imaginary parts each need std sigma * C
    # (jax.random.normal in complex64 gives each part std 1/sqrt(2)).
    c, sigma, n = 1.0, 2.0, 50_000
    tx = privacy.dp_accumulate(
        optax.sgd(1.0), 1, l2_clip_norm=c, noise_multiplier=sigma,
        expected_batch_size=1.0, key=jax.random.key(0),
    )  # fmt: skip
    params = {"w": jnp.zeros(n, jnp.complex64)}
    u, _ = tx.update({"w": jnp.zeros(n, jnp.complex64)}, tx.init(params), params)
    noise = -np.asarray(u["w"])
    assert noise.dtype == np.complex64
    # std error of a std over 50,000 draws: 0.3%
    assert abs(noise.real.std() / (sigma * c) - 1) < 0.02
    assert abs(noise.imag.std() / (sigma * c) - 1) < 0.02
    assert abs(np.corrcoef(noise.real, noise.imag)[0, 1]) < 0.02


@pytest.mark.parametrize(
    "grad_dtype, accumulator_dtype",
    [
        (jnp.float32, jnp.bfloat16),
        (jnp.bfloat16, "promote"),
        (jnp.bfloat16, jnp.bfloat16),
        (jnp.float16, None),
        (jnp.float32, {"w": jnp.float16}),
    ],
)
def test_narrow_dtypes_do_not_raise_the_sensitivity(grad_dtype, accumulator_dtype):
    # Issue 39, finding 2: two windows of 9 calls whose exact sums differ by
    # 0.25 (512 + 256 + ... + 4, then 2.0 or 1.75). Summed or handed to the
    # noise in bf16 they were 1024 and 1020: a difference of 4 against C = 1.
    tx = privacy.dp_accumulate(
        optax.sgd(1.0), 9, l2_clip_norm=1.0, noise_multiplier=0.0,
        expected_batch_size=1.0, key=jax.random.key(0),
        accumulator_dtype=accumulator_dtype,
    )  # fmt: skip
    params = {"w": jnp.zeros((), grad_dtype)}

    def window(last):
        state = tx.init(params)
        for g in [2.0**e for e in range(9, 1, -1)] + [last]:
            u, state = tx.update({"w": jnp.asarray(g, grad_dtype)}, state, params)
        assert u["w"].dtype == jnp.float32
        return float(-u["w"])

    a, b = window(2.0), window(1.75)
    assert (a, b) == (1022.0, 1021.75)
    assert abs(a - b) <= 1.0 + 1e-4


@pytest.mark.parametrize(
    "wrap",
    [
        lambda tx: optax.MultiSteps(tx, 2),
        lambda tx: optax.MultiSteps(tx, 2).gradient_transformation(),
        lambda tx: optax_accum.accumulate(tx, 2),
        lambda tx: optax_accum.MultiSteps(tx, 2),
        lambda tx: optax_accum.accumulate(optax.chain(optax.identity(), tx), 2),
    ],
)
def test_an_accumulator_around_dp_accumulate_is_refused_at_init(wrap):
    # Issue 39, finding 8: it would average or sum noised windows.
    params = {"w": jnp.zeros(3)}
    outer = wrap(_tx(k=1))
    with pytest.raises(ValueError, match="`dp_accumulate` must not be wrapped in"):
        outer.init(params)
    with pytest.raises(ValueError, match="must not be wrapped"):
        jax.jit(outer.init)(params)


def test_dp_accumulate_alone_or_in_a_chain_inits():
    params = {"w": jnp.zeros(3)}
    for tx in [
        _tx(k=2),
        optax.chain(_tx(k=2)),
        _tx(optax.MultiSteps(optax.sgd(1.0), 1)),
    ]:
        u, _ = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
        assert u["w"].shape == (3,)


def test_no_clipped_sum_outlives_its_window():
    # Issue 39, finding 4: after the boundary the accumulator still held the
    # window's exact clipped sum (and so did a checkpoint of the state).
    params, x, y = data(rows=16, scale=2.0)
    updates, state = _run(_tx(k=2, sigma=0.0), params, x, y, calls=4, k_per_call=2)
    for a in jax.tree.leaves(state.accumulator):
        np.testing.assert_array_equal(a, np.zeros_like(a))
    for t, (lo, hi) in enumerate([(0, 8), (8, 16)]):  # the reference, unchanged
        _, ref = clipped_sum(params, x[lo:hi], y[lo:hi], C)
        for u, r in zip(jax.tree.leaves(updates[2 * t + 1]), jax.tree.leaves(ref),
                        strict=True):  # fmt: skip
            np.testing.assert_allclose(-np.asarray(u), r / B, rtol=1e-5, atol=1e-7)
    # mid-window the sum is there (it is needed), and a plain accumulate keeps
    # its stale buffer after a boundary (no pass of its own to clear it)
    _, mid = _run(_tx(k=4, sigma=0.0), params, x, y, calls=2, k_per_call=2)
    assert all(np.any(np.asarray(a) != 0) for a in jax.tree.leaves(mid.accumulator))
    plain = optax_accum.accumulate(optax.sgd(1.0), 2, reduction="sum")
    _, kept = _run(plain, params, x, y, calls=4, k_per_call=2)
    assert all(np.any(np.asarray(a) != 0) for a in jax.tree.leaves(kept.accumulator))


def test_an_empty_poisson_batch_draws_its_noise_per_call_as_fused():
    # Issue 39, finding 7: a per-call loop over the real micro-batches made no
    # call on an empty batch: no noise, the parameters exactly unchanged.
    params, x, y = data(rows=40, scale=2.0)
    sampler = privacy.poisson_microbatches(40, 0.02, 4, seed=0)
    batch = next(b for b in sampler if b.size == 0)
    assert batch.num_real_microbatches == 0 and batch.num_calls == 1
    k = sampler.num_microbatches

    def masked(num_microbatches):
        return privacy.clipped_value_and_grad(
            lambda p, x, y, m: loss(p, x, y), C, num_microbatches,
            batch_argnums=(1, 2, 3), example_mask_fn=lambda x, y, m: m,
        )  # fmt: skip

    fused_tx, per_call_tx = _tx(k=1), _tx(k=k)
    fused, _ = fused_tx.update(
        masked(k)(params, *batch.take(x, y))[1], fused_tx.init(params), params
    )
    state = per_call_tx.init(params)
    xs, ys, masks = batch.take(x, y, fused=False)
    for j in range(batch.num_calls):
        grads = masked(1)(params, xs[j], ys[j], masks[j])[1]
        last = j == batch.num_calls - 1
        u, state = per_call_tx.update(grads, state, params, close_window=last)
    assert bool(optax_accum.has_updated(state))
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(u), strict=True):
        np.testing.assert_array_equal(a, b)
    draw = _noise_draw(jax.random.key(7), 0, params)  # the noise alone
    for a, z in zip(jax.tree.leaves(u), jax.tree.leaves(draw), strict=True):
        np.testing.assert_allclose(-np.asarray(a), SIGMA * C / B * np.asarray(z),
                                   rtol=1e-5, atol=1e-7)  # fmt: skip


def test_an_inner_that_reads_value_is_refused_at_init():
    """The loss would reach the inner optimizer without noise (review of
    issue 39): the released parameters would depend on the un-noised loss."""
    inner = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau())
    with pytest.raises(ValueError, match=r"`inner` reads `value`.*without noise"):
        _tx(inner, k=2).init({"w": jnp.zeros(2)})
    _tx(optax.adam(1.0), k=2).init({"w": jnp.zeros(2)})  # gradients only: fine


def test_donating_the_state_keeps_the_callers_key():
    """The state's key is a copy: a step that donates the state deletes
    neither the caller's key nor the one a later ``init`` reads."""
    key = jax.random.key(3)
    tx = _tx(k=2, key=key)
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    step = jax.jit(tx.update, donate_argnums=1)
    for _ in range(2):
        _, state = step({"w": jnp.ones(2)}, state, params)
    jax.random.normal(key)  # raised "Array has been deleted" before
    again = jax.jit(tx.init)(params)
    np.testing.assert_array_equal(
        jax.tree.leaves(again)[-2:], jax.tree.leaves(tx.init(params))[-2:]
    )


def test_injected_mechanism_parameters_under_jit_name_the_fix():
    tx = optax.inject_hyperparams(privacy.dp_accumulate)(
        inner=optax.sgd(1.0), every_k=1, l2_clip_norm=1.0, noise_multiplier=1.0,
        expected_batch_size=4.0, key=jax.random.key(0),
    )  # fmt: skip
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    with pytest.raises(TypeError, match=r"inject the inner optimizer's instead"):
        jax.jit(tx.update)({"w": jnp.ones(2)}, state, params)
    inner_only = optax.inject_hyperparams(
        lambda learning_rate: _tx(optax.sgd(learning_rate), k=1)
    )(learning_rate=1.0)
    state = inner_only.init(params)
    _, state = jax.jit(inner_only.update)({"w": jnp.ones(2)}, state, params)
    assert "key" not in state.hyperparams


def test_vmap_over_members_sharing_one_key_is_refused():
    """Issue 39, finding 8: an ensemble under ``jax.vmap`` whose members share
    the state's key would draw the same noise for every member; with a key
    per member it runs, and the members' noise differs."""
    tx = _tx(optax.sgd(1.0), k=1, sigma=1.0)
    params = {"w": jnp.zeros((3, 4))}  # 3 members
    grads = {"w": jnp.zeros((3, 4))}
    state = tx.init({"w": jnp.zeros(4)})
    shared = jax.vmap(lambda g, p: tx.update(g, state, p)[0])
    with pytest.raises(ValueError, match="one noise key for every member"):
        shared(grads, params)
    keys = jax.vmap(jax.random.key_data)(jax.random.split(jax.random.key(5), 3))

    def member(g, p, key):
        noise, inner = state.inner_state
        s = state._replace(inner_state=(noise._replace(key=key), inner))
        return tx.update(g, s, p)[0]

    u = np.asarray(jax.vmap(member)(grads, params, keys)["w"])
    assert not np.allclose(u[0], u[1]) and not np.allclose(u[1], u[2])
