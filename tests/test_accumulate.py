# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`accumulate` against full-batch references, optax.MultiSteps and exact values."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from tests.helpers.lanes import sweep
from tests.helpers.models import mlp_loss, mlp_params, regression_data

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "clip_adamw": lambda: optax.chain(
        optax.clip_by_global_norm(0.05), optax.adamw(1e-2, weight_decay=0.1)
    ),
}


def _train_step(tx):
    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(mlp_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    return step


@pytest.mark.parametrize("name", sweep(OPTIMIZERS, fast=["clip_adamw"]))
def test_k_micro_steps_equal_one_full_batch_step(name):
    k, micro, windows = 4, 5, 3
    x, y = regression_data(k * micro * windows)
    params = mlp_params()
    ref_tx, tx = OPTIMIZERS[name](), optax_accum.accumulate(OPTIMIZERS[name](), k)
    ref_state, state = ref_tx.init(params), tx.init(params)
    ref_params = params
    step = _train_step(tx)
    for w in range(windows):
        xb = x[w * k * micro : (w + 1) * k * micro]
        yb = y[w * k * micro : (w + 1) * k * micro]
        grads = jax.grad(mlp_loss)(ref_params, xb, yb)
        updates, ref_state = ref_tx.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        for i in range(k):
            sl = slice(i * micro, (i + 1) * micro)
            params, state, _ = step(params, state, xb[sl], yb[sl])
        chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)
        assert int(state.update_step) == w + 1
    chex.assert_trees_all_close(state.inner_state, ref_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_drop_in", sweep([False, True], fast=[True]))
def test_matches_optax_multisteps_step_by_step(use_drop_in):
    k = 3
    x, y = regression_data(4 * 4 * k, seed=1)
    params = mlp_params(1)
    inner = optax.chain(
        optax.scale_by_adam(), optax.add_decayed_weights(1e-2), optax.scale(-1e-2)
    )
    ref_ms, ms = optax.MultiSteps(inner, k), optax_accum.MultiSteps(inner, k)
    ref = ref_ms.gradient_transformation()
    if use_drop_in:
        tx = ms.gradient_transformation()
    else:
        tx = optax_accum.accumulate(inner, k)
    ref_params, ref_state, state = params, ref.init(params), tx.init(params)
    ref_step, step = _train_step(ref), _train_step(tx)
    for i in range(4 * k):
        sl = slice(4 * i, 4 * i + 4)
        ref_params, ref_state, ref_u = ref_step(ref_params, ref_state, x[sl], y[sl])
        params, state, u = step(params, state, x[sl], y[sl])
        # Adam's m / sqrt(v) amplifies fp32 rounding of tiny gradients.
        chex.assert_trees_all_close(u, ref_u, rtol=1e-5, atol=1e-8)
        chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-7)
        ours = ms.has_updated(state) if use_drop_in else optax_accum.has_updated(state)
        assert bool(ref_ms.has_updated(ref_state)) == bool(ours)


def test_hold_steps_emit_exact_zeros_and_leave_inner_state_untouched():
    k = 4
    tx = optax_accum.accumulate(optax.adam(1e-1), k)
    params = mlp_params()
    x, y = regression_data(8 * k)
    state = tx.init(params)
    step = _train_step(tx)
    for i in range(2 * k):
        prev_params, prev_inner = params, state.inner_state
        params, state, updates = step(
            params, state, x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]
        )
        if (i + 1) % k:
            for u in jax.tree.leaves(updates):
                np.testing.assert_array_equal(u, np.zeros_like(u))
            chex.assert_trees_all_equal(params, prev_params)
            chex.assert_trees_all_equal(state.inner_state, prev_inner)
            assert not bool(optax_accum.has_updated(state))
            assert int(state.micro_step) == (i + 1) % k
        else:
            assert bool(optax_accum.has_updated(state))
            assert int(state.micro_step) == 0
            assert int(state.inner_state[0].count) == (i + 1) // k
            assert any(
                not np.array_equal(a, b)
                for a, b in zip(
                    jax.tree.leaves(params), jax.tree.leaves(prev_params), strict=True
                )
            )


def test_hold_zeros_are_not_nan_for_infinite_gradients():
    # 0 * inf would be NaN: hold steps must emit zeros whatever the gradient.
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    params = {"a": jnp.zeros(3)}
    u, _ = tx.update({"a": jnp.array([jnp.inf, -jnp.inf, jnp.nan])}, tx.init(params))
    np.testing.assert_array_equal(u["a"], np.zeros(3))


def _run(tx, grads, weights=None, **kwargs):
    params = {"a": jnp.zeros([])}
    state = tx.init(params)
    updates = []
    for i, g in enumerate(grads):
        w = None if weights is None else weights[i]
        u, state = tx.update(
            {"a": jnp.asarray(g, jnp.float32)}, state, params, weight=w, **kwargs
        )
        updates.append(float(u["a"]))
    return updates, state


@pytest.mark.parametrize(
    ("reduction", "weights", "expected"),
    [
        ("mean", None, 2.5),
        ("sum", None, 10.0),
        ("mean", [1.0, 2.0, 3.0, 4.0], 3.0),
        ("sum", [1.0, 2.0, 3.0, 4.0], 30.0),
        ("mean", [0, 0, 5, 0], 3.0),
        ("mean", [2, 2, 2, 2], 2.5),
    ],
)
def test_exact_mean_sum_and_weighted_values(reduction, weights, expected):
    tx = optax_accum.accumulate(optax.identity(), 4, reduction=reduction)
    updates, _ = _run(tx, [1.0, 2.0, 3.0, 4.0], weights)
    assert updates == [0.0, 0.0, 0.0, expected]


def test_all_zero_weights_give_a_zero_update():
    tx = optax_accum.accumulate(optax.identity(), 2)
    updates, _ = _run(tx, [7.0, 9.0], [0.0, 0.0])
    assert updates == [0.0, 0.0]


def test_windows_do_not_leak_into_each_other():
    # The accumulator is not zeroed at a boundary; the next window overwrites it.
    tx = optax_accum.accumulate(optax.identity(), 2)
    updates, _ = _run(tx, [1e8, 3e8, 1.0, 2.0, -4.0, 6.0])
    assert updates == [0.0, 2e8, 0.0, 1.5, 0.0, 1.0]
    tx = optax_accum.accumulate(optax.identity(), 2, reduction="sum")
    updates, _ = _run(tx, [1e8, 3e8, 1.0, 2.0])
    assert updates == [0.0, 4e8, 0.0, 3.0]


def test_token_weighted_micro_batches_equal_full_batch_token_mean():
    k, b, t, d = 4, 3, 7, 5
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(k * b, t, d)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(k * b, t)), jnp.float32)
    lengths = rng.integers(1, t + 1, size=k * b)
    lengths[:b] = 1  # a very short micro-batch makes mean-of-means visibly wrong
    mask = jnp.asarray(np.arange(t)[None, :] < lengths[:, None], jnp.float32)
    params = {"w": jnp.asarray(rng.normal(size=(d,)), jnp.float32)}

    def token_mean_loss(p, x, target, mask):
        err = (x @ p["w"] - target) ** 2
        return jnp.sum(err * mask) / jnp.sum(mask)

    full = jax.grad(token_mean_loss)(params, x, target, mask)
    tx = optax_accum.accumulate(optax.identity(), k)
    naive = optax_accum.accumulate(optax.identity(), k)
    state, naive_state = tx.init(params), naive.init(params)
    for i in range(k):
        sl = slice(i * b, (i + 1) * b)
        g = jax.grad(token_mean_loss)(params, x[sl], target[sl], mask[sl])
        u, state = tx.update(g, state, params, weight=jnp.sum(mask[sl]))
        nu, naive_state = naive.update(g, naive_state, params)
    chex.assert_trees_all_close(u, full, rtol=1e-5, atol=1e-7)
    # Mean of means is not the full-batch token mean: the test can fail.
    assert not np.allclose(nu["w"], full["w"], rtol=1e-3)


def test_every_k_schedule_and_no_recompilation():
    tx = optax_accum.accumulate(optax.sgd(1e-4), lambda step: jnp.where(step < 2, 1, 3))
    params = {"a": jnp.zeros([])}
    grads = {"a": jnp.ones([])}

    @jax.jit
    @chex.assert_max_traces(n=1)
    def update(state):
        return tx.update(grads, state, params)[1]

    state = tx.init(params)
    assert not bool(optax_accum.has_updated(state))
    for _ in range(2):
        state = update(state)
        assert bool(optax_accum.has_updated(state))
    for _ in range(5):
        for _ in range(2):
            state = update(state)
            assert not bool(optax_accum.has_updated(state))
        state = update(state)
        assert bool(optax_accum.has_updated(state))
    assert int(state.update_step) == 7


def test_close_window_averages_a_partial_window():
    tx = optax_accum.accumulate(optax.identity(), 4)
    params = {"a": jnp.zeros([])}
    state = tx.init(params)
    update = jax.jit(tx.update)
    out = []
    for g, close in [
        (1.0, False),
        (3.0, True),
        (5.0, False),
        (6.0, False),
        (7.0, False),
        (10.0, False),
    ]:
        u, state = update({"a": jnp.float32(g)}, state, params, close_window=close)
        out.append(float(u["a"]))
    assert out == [0.0, 2.0, 0.0, 0.0, 0.0, 7.0]
    assert int(state.update_step) == 2


def test_skipped_micro_batches_leave_the_state_as_if_never_seen():
    params = {"a": jnp.zeros(2)}
    for skip_fn in (optax_accum.skip_not_finite, optax.skip_not_finite):
        tx = optax_accum.accumulate(optax.adam(0.1), 2, skip_fn=skip_fn)
        clean = optax_accum.accumulate(optax.adam(0.1), 2)
        state, clean_state = tx.init(params), clean.init(params)
        grads = [
            jnp.array([1.0, 2.0]),
            jnp.array([jnp.nan, 1.0]),
            jnp.array([3.0, 1.0]),
        ]
        grads += [
            jnp.array([jnp.inf, 0.0]),
            jnp.array([-1.0, 5.0]),
            jnp.array([2.0, 2.0]),
        ]
        update = jax.jit(tx.update)
        for g in grads:
            u, state = update({"a": g}, state, params)
            if np.all(np.isfinite(g)):
                cu, clean_state = clean.update({"a": g}, clean_state, params)
                chex.assert_trees_all_close(u, cu)
            else:
                np.testing.assert_array_equal(u["a"], np.zeros(2))
        assert int(state.num_skipped) == 2
        chex.assert_trees_all_close(state.inner_state, clean_state.inner_state)
        assert int(state.micro_step) == int(clean_state.micro_step) == 0
        assert int(state.update_step) == 2


def test_skip_large_updates():
    tx = optax_accum.accumulate(
        optax.identity(), 2, skip_fn=optax_accum.skip_large_updates(10.0)
    )
    updates, state = _run(tx, [1.0, 50.0, 3.0])
    assert updates == [0.0, 0.0, 2.0]
    assert int(state.num_skipped) == 1
    assert float(state.skip_state["norm"]) == 3.0


def test_rejected_micro_batch_after_boundary_is_not_an_update():
    tx = optax_accum.accumulate(
        optax.identity(), 1, skip_fn=optax_accum.skip_not_finite
    )
    _, state = _run(tx, [1.0])
    assert bool(optax_accum.has_updated(state))
    _, state = tx.update({"a": jnp.float32(jnp.nan)}, state, {"a": jnp.zeros([])})
    assert not bool(optax_accum.has_updated(state))


def test_inject_hyperparams_schedule_counts_update_steps():
    k = 3
    schedule = optax.linear_schedule(1.0, 0.0, transition_steps=10)
    tx = optax_accum.accumulate(
        optax.inject_hyperparams(optax.sgd)(learning_rate=schedule), k
    )
    params = {"a": jnp.zeros([])}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for i in range(4 * k):
        u, state = update({"a": jnp.ones([])}, state, params)
        if (i + 1) % k == 0:
            n = (i + 1) // k
            # The update used the learning rate of optimizer step n - 1.
            np.testing.assert_allclose(
                float(u["a"]), -float(schedule(n - 1)), rtol=1e-6
            )
            assert int(state.inner_state.count) == n
            np.testing.assert_allclose(
                state.inner_state.hyperparams["learning_rate"],
                schedule(n - 1),
                rtol=1e-6,
            )


def test_nnx_optimizer():
    nnx = pytest.importorskip("flax.nnx")
    k, micro = 3, 4
    x, y = regression_data(k * micro)

    def make():
        return nnx.Linear(6, 3, rngs=nnx.Rngs(0))

    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    model, ref_model = make(), make()
    opt = nnx.Optimizer(
        model, optax_accum.accumulate(optax.adam(1e-2), k), wrt=nnx.Param
    )
    ref_opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        grads = nnx.grad(loss_fn)(model, x, y)
        opt.update(model, grads)

    for _ in range(2):
        for i in range(k):
            step(
                model,
                opt,
                x[i * micro : (i + 1) * micro],
                y[i * micro : (i + 1) * micro],
            )
        step(ref_model, ref_opt, x, y)
    chex.assert_trees_all_close(
        nnx.state(model, nnx.Param),
        nnx.state(ref_model, nnx.Param),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.slow
def test_noisy_sgd_state_survives_disable_jit():
    tx = optax_accum.accumulate(optax.noisy_sgd(0.1, key=jax.random.key(0)), 2)
    params = {"a": jnp.ones(2)}
    with jax.disable_jit():
        state = tx.init(params)
        for _ in range(2):
            u, state = tx.update({"a": jnp.ones(2)}, state, params)
    assert jnp.all(u["a"] != 0)


def test_integer_parameters_gradients_pass_through_as_float0():
    params = {"w": jnp.ones(3), "step": jnp.int32(3)}

    def loss(p):
        return jnp.sum(p["w"] ** 2) * p["step"]

    inner = optax.masked(optax.adam(0.1), {"w": True, "step": False})
    tx = optax_accum.accumulate(inner, 2)
    state, ref_state = tx.init(params), inner.init(params)
    step = jax.jit(tx.update)
    grads = [jax.grad(loss, allow_int=True)(params) for _ in range(2)]
    for g in grads:
        u, state = step(g, state, params)
    assert u["step"].dtype == jax.dtypes.float0
    mean = jax.tree.map(lambda a, b: (a + b) / 2, grads[0]["w"], grads[1]["w"])
    ref, _ = inner.update({"w": mean, "step": grads[0]["step"]}, ref_state, params)
    chex.assert_trees_all_close(u["w"], ref["w"], rtol=1e-6)


@pytest.mark.parametrize(
    "option",
    [
        {"noise_scale_decay": 0.5},
        {"skip_fn": optax_accum.skip_large_updates(100.0)},
        {"skip_fn": optax_accum.skip_not_finite},
    ],
)
def test_integer_parameters_with_noise_scale_and_skip_functions(option):
    params = {"w": jnp.ones(3), "step": jnp.int32(3)}

    def loss(p, x):
        return jnp.sum((x * p["w"]) ** 2) * p["step"]

    inner = optax.masked(optax.sgd(1.0), {"w": True, "step": False})
    tx = optax_accum.accumulate(inner, 2, **option)
    state, step = tx.init(params), jax.jit(tx.update)
    grads = [jax.grad(loss, allow_int=True)(params, x) for x in (1.0, 2.0)]
    for g in grads:
        u, state = step(g, state, params)
    assert u["step"].dtype == jax.dtypes.float0 and int(state.num_skipped) == 0
    np.testing.assert_allclose(u["w"], -(grads[0]["w"] + grads[1]["w"]) / 2)
    if "noise_scale_decay" in option:  # the norms leave the float0 leaf out
        g1, g2 = (np.asarray(g["w"], np.float64) for g in grads)
        small, big = (g1 @ g1 + g2 @ g2) / 2, (g1 + g2) @ (g1 + g2) / 4
        ns = state.noise_scale
        assert int(ns.windows) == 1
        np.testing.assert_allclose(ns.last_grad_sq, 2 * big - small, rtol=1e-6)
        np.testing.assert_allclose(ns.last_trace, 2 * (small - big), rtol=1e-6)
