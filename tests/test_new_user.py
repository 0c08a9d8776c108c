# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""What a new user ran into (issue 10), each reduced to an assertion.

Every test here failed before the fix: silent wrong results first (extra args
over a window, weight checks, accumulator dtypes, NaN in a zero-weight
micro-batch), then crashes and errors that named nothing.
"""

from __future__ import annotations

import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

K = 4


def _data(seed=0, n=K * 8):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(n,)) * 3 + 5 * rng.normal(size=(n,)) ** 2)
    return x, y.astype(jnp.float32)


def _loss(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


P0 = {"w": jnp.ones(3), "b": jnp.zeros([])}


def _plateau():
    return optax.chain(
        optax.sgd(0.9),
        optax.contrib.reduce_on_plateau(factor=0.5, patience=1, accumulation_size=1),
    )


def _accumulated(tx, steps, x, y, **update_kwargs):
    """``steps`` updates of k micro-batches (rows i, i+k, ...), value passed."""
    update = jax.jit(functools.partial(tx.update, **update_kwargs))
    params, state = P0, tx.init(P0)
    for _ in range(steps):
        for i in range(K):
            value, grad = jax.value_and_grad(_loss)(params, x[i::K], y[i::K])
            u, state = update(grad, state, params, value=value)
        params = optax.apply_updates(params, u)
    return params, state


def _large_batch(tx, steps, x, y, **update_kwargs):
    params, state = P0, tx.init(P0)
    for _ in range(steps):
        value, grad = jax.value_and_grad(_loss)(params, x, y)
        u, state = tx.update(grad, state, params, value=value, **update_kwargs)
        params = optax.apply_updates(params, u)
    return params


# 1. Extra args over a window ------------------------------------------------


@pytest.mark.parametrize("face", ["accumulate", "MultiSteps"])
def test_reduce_on_plateau_sees_the_windows_loss(face):
    x, y = _data()
    if face == "accumulate":
        tx = optax_accum.accumulate(_plateau(), K)
    else:
        tx = optax_accum.MultiSteps(_plateau(), K).gradient_transformation()
    params, _ = _accumulated(tx, 8, x, y)
    # Fed the last micro-batch's loss, the plateau logic ends 0.04 off.
    chex.assert_trees_all_close(params, _large_batch(_plateau(), 8, x, y), rtol=1e-5)


def test_value_is_accumulated_with_the_weights_and_reduction():
    def inner_update(updates, state, params=None, *, value, **extra):
        return jax.tree.map(lambda u: jnp.zeros_like(u) + value, updates), state

    inner = optax.GradientTransformationExtraArgs(
        lambda p: optax.EmptyState(), inner_update
    )
    params = {"a": jnp.zeros([])}
    for reduction, expected in [("mean", (1 * 2 + 3 * 6) / 4), ("sum", 2 + 18)]:
        tx = optax_accum.accumulate(inner, 2, reduction=reduction)
        state = tx.init(params)
        assert state.value_accumulator.shape == ()
        _, state = tx.update(params, state, params, value=2.0, weight=1)
        u, state = tx.update(params, state, params, value=6.0, weight=3)
        assert float(u["a"]) == expected


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_value_is_reduced_over_devices_with_the_weights(reduction):
    def inner_update(updates, state, params=None, *, value, **extra):
        return jax.tree.map(lambda u: jnp.zeros_like(u) + value, updates), state

    inner = optax.GradientTransformationExtraArgs(
        lambda p: optax.EmptyState(), inner_update
    )
    n = 8
    tx = optax_accum.accumulate(inner, 2, axis_name="d", reduction=reduction)
    params = {"a": jnp.zeros((n,))}
    state = jax.pmap(tx.init, axis_name="d")(params)
    update = jax.pmap(
        lambda g, s, p, v, w: tx.update(g, s, p, value=v, weight=w), axis_name="d"
    )
    rng = np.random.default_rng(0)
    values = rng.normal(size=(2, n)).astype(np.float32)
    weights = rng.uniform(0.5, 2, size=(2, n)).astype(np.float32)
    values[0, 3], weights[0, 3] = np.nan, 0.0  # an all-padding micro-batch
    for i in range(2):
        u, state = update(params, state, params, values[i], weights[i])
    total = np.nansum(values * weights)
    expected = total / weights.sum() if reduction == "mean" else total
    np.testing.assert_allclose(u["a"], expected, rtol=1e-5)


def test_optimizers_that_ignore_value_keep_todays_state():
    tx = optax_accum.accumulate(optax.adam(1e-3), 2)
    assert tx.init(P0).value_accumulator == ()
    assert optax_accum.MultiSteps(optax.adam(1e-3), 2).init(P0).acc_value == ()


@pytest.mark.parametrize("face", ["accumulate", "MultiSteps"])
def test_lbfgs_gets_the_windows_value_and_grad(face):
    # The user passes each micro-batch's value and grad, and a value_fn for the
    # whole window's data (opted in): the step is the large batch's L-BFGS step.
    x, y = _data(1)
    value_fn = lambda p: _loss(p, x, y)
    if face == "accumulate":
        tx = optax_accum.accumulate(optax.lbfgs(), K, allow_value_fn=True)
    else:
        ms = optax_accum.MultiSteps(optax.lbfgs(), K, allow_value_fn=True)
        tx = ms.gradient_transformation()
    update = jax.jit(functools.partial(tx.update, value_fn=value_fn))
    params, state = P0, tx.init(P0)
    for _ in range(3):
        for i in range(K):
            value, grad = jax.value_and_grad(_loss)(params, x[i::K], y[i::K])
            u, state = update(grad, state, params, value=value, grad=grad)
        params = optax.apply_updates(params, u)
    ref = _large_batch_lbfgs(3, x, y, value_fn)
    chex.assert_trees_all_close(params, ref, rtol=1e-5, atol=1e-6)


def _large_batch_lbfgs(steps, x, y, value_fn):
    tx = optax.lbfgs()
    params, state = P0, tx.init(P0)
    for _ in range(steps):
        value, grad = jax.value_and_grad(_loss)(params, x, y)
        u, state = tx.update(
            grad, state, params, value=value, grad=grad, value_fn=value_fn
        )
        params = optax.apply_updates(params, u)
    return params


def test_value_fn_needs_an_explicit_opt_in():
    x, y = _data()
    value_fn = lambda p: _loss(p, x[::K], y[::K])  # one micro-batch's loss
    v, g = jax.value_and_grad(_loss)(P0, x[::K], y[::K])
    for tx, owner in [
        (optax_accum.accumulate(optax.lbfgs(), K), "accumulate"),
        (optax_accum.MultiSteps(optax.lbfgs(), K), "MultiSteps"),
    ]:
        with pytest.raises(ValueError, match=f"`value_fn` was passed to {owner}"):
            tx.update(g, tx.init(P0), P0, value=v, grad=g, value_fn=value_fn)


# 2. Weight checks -----------------------------------------------------------


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -1.0])
def test_bad_traced_weight_rejects_the_micro_batch(bad):
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    update = jax.jit(tx.update)
    params = {"a": jnp.zeros([])}
    state = tx.init(params)
    u, state = update({"a": jnp.float32(1.0)}, state, params, weight=1.0)
    u, state = update({"a": jnp.float32(5.0)}, state, params, weight=bad)
    assert float(u["a"]) == 0.0 and not optax_accum.has_updated(state)
    u, state = update({"a": jnp.float32(3.0)}, state, params, weight=1.0)
    assert float(u["a"]) == -2.0  # the mean of 1 and 3
    assert int(state.num_skipped) == 1


@pytest.mark.parametrize("bad", [float("nan"), -2.0, np.float32(np.inf)])
def test_constant_bad_weight_raises(bad):
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    params = {"a": jnp.zeros([])}
    with pytest.raises(ValueError, match="`weight` must be finite and >= 0"):
        tx.update({"a": jnp.float32(1.0)}, tx.init(params), params, weight=bad)


def test_all_padding_window_does_not_step_the_inner_optimizer():
    tx = optax_accum.accumulate(optax.adam(0.1), 2)
    update = jax.jit(tx.update)
    params = {"a": jnp.zeros(2)}
    state = tx.init(params)
    for w in (1.0, 1.0):
        u, state = update({"a": jnp.ones(2)}, state, params, weight=w)
    inner_before = state.inner_state
    for w in (0.0, 0.0):
        u, state = update({"a": jnp.ones(2)}, state, params, weight=w)
    # Adam's momentum would still move the parameters on a zero gradient.
    np.testing.assert_array_equal(u["a"], 0.0)
    chex.assert_trees_all_equal(state.inner_state, inner_before)
    assert int(state.update_step) == 1 and not optax_accum.has_updated(state)
    assert int(state.micro_step) == 0  # the window closed


def test_all_padding_window_on_every_device_steps_nothing():
    n = 8
    tx = optax_accum.accumulate(optax.adam(0.1), 2, axis_name="d")
    params = {"a": jnp.zeros((n, 2))}
    state = jax.pmap(tx.init, axis_name="d")(params)
    update = jax.pmap(lambda g, s, p, w: tx.update(g, s, p, weight=w), axis_name="d")
    grads = {"a": jnp.ones((n, 2))}
    for w in (1.0, 1.0):
        u, state = update(grads, state, params, jnp.full(n, w))
    inner_before = state.inner_state
    for w in (0.0, 0.0):
        u, state = update(grads, state, params, jnp.full(n, w))
    np.testing.assert_array_equal(u["a"], 0.0)
    chex.assert_trees_all_equal(state.inner_state, inner_before)
    assert int(state.update_step[0]) == 1


# 3. Accumulator dtype: promote, never demote ---------------------------------


def test_complex_gradients_keep_their_imaginary_part():
    params = {"z": jnp.array([1 + 2j, -1j], jnp.complex64)}
    grads = {"z": jnp.array([0.5 - 1j, 2 + 3j], jnp.complex64)}
    tx, ref = optax_accum.accumulate(optax.adam(0.1), 1), optax.adam(0.1)
    u, _ = tx.update(grads, tx.init(params), params)
    ref_u, _ = ref.update(grads, ref.init(params), params)
    chex.assert_trees_all_close(u, ref_u, rtol=1e-6)
    assert tx.init(params).accumulator["z"].dtype == jnp.complex64


def test_float64_gradients_accumulate_in_float64():
    with jax.enable_x64(True):
        params = {"a": jnp.array([1.0, 2.0], jnp.float64)}
        tx = optax_accum.accumulate(optax.sgd(1.0), 2)
        state = tx.init(params)
        assert state.accumulator["a"].dtype == jnp.float64
        g1, g2 = 1.0 + 1e-12, 1.0 - 3e-12
        _, state = tx.update({"a": jnp.full(2, g1)}, state, params)
        u, _ = tx.update({"a": jnp.full(2, g2)}, state, params)
        np.testing.assert_array_equal(u["a"], -(g1 + g2) / 2)


def test_explicit_complex_accumulator_is_accepted_and_real_one_refused():
    params = {"z": jnp.zeros(2, jnp.complex64)}
    tx = optax_accum.accumulate(optax.sgd(1.0), 2, accumulator_dtype=jnp.complex128)
    with jax.enable_x64(True):
        assert tx.init(params).accumulator["z"].dtype == jnp.complex128
    tx = optax_accum.accumulate(optax.sgd(1.0), 2, accumulator_dtype=jnp.float32)
    with pytest.raises(TypeError, match="would drop the imaginary part"):
        tx.init(params)


# 4. A zero-weight micro-batch contributes nothing ---------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_zero_weight_nan_micro_batch_after_a_weighted_one(reduction):
    tx = optax_accum.accumulate(optax.sgd(1.0), 3, reduction=reduction)
    update = jax.jit(tx.update)
    params = {"a": jnp.zeros([])}
    state = tx.init(params)
    # An all-padding micro-batch: token mean 0/0 = NaN, weight 0.
    for g, w in [(2.0, 2.0), (jnp.nan, 0.0), (5.0, 1.0)]:
        u, state = update({"a": jnp.float32(g)}, state, params, weight=w)
    expected = (2 * 2 + 5) / 3 if reduction == "mean" else 2 * 2 + 5
    assert float(u["a"]) == pytest.approx(-expected)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("position", [0, 1, 3])
def test_microbatch_all_padding_micro_batch_contributes_nothing(position, sharded):
    def loss(w, batch):
        mask = batch["mask"]
        return jnp.sum(mask * (batch["x"] * w - 1.0) ** 2) / jnp.sum(mask)

    n = 64  # 16 rows per micro-batch: 2 per device when sharded over 8
    x = jnp.arange(1.0, n + 1.0) / n
    mask = jnp.ones(n).at[position::K].set(0.0)  # micro-batch `position`: padding
    batch = {"x": x, "mask": mask}
    ref_value, ref_grad = jax.value_and_grad(loss)(jnp.float32(0.5), batch)
    fun = optax_accum.microbatch(
        jax.value_and_grad(loss),
        K,
        weight_fn=lambda b: b["mask"].sum(),
        mesh_axes="auto" if sharded else None,
    )
    if sharded:  # the device-local loop: each device's part is all padding
        mesh = jax.make_mesh((8,), ("data",))
        batch = jax.device_put(batch, jax.NamedSharding(mesh, jax.P("data")))
        with jax.set_mesh(mesh):
            value, grad = jax.jit(fun)(jnp.float32(0.5), batch)
    else:
        value, grad = jax.jit(fun)(jnp.float32(0.5), batch)
    np.testing.assert_allclose([value, grad], [ref_value, ref_grad], rtol=1e-5)


# Crashes --------------------------------------------------------------------


def test_noisy_sgd_state_survives_disable_jit():
    tx = optax_accum.accumulate(optax.noisy_sgd(0.1, key=jax.random.key(0)), 2)
    params = {"a": jnp.ones(2)}
    with jax.disable_jit():
        state = tx.init(params)
        for _ in range(2):
            u, state = tx.update({"a": jnp.ones(2)}, state, params)
    assert jnp.all(u["a"] != 0)


def test_has_updated_reads_multisteps_and_nnx_states():
    nnx = pytest.importorskip("flax.nnx")
    ms = optax_accum.MultiSteps(optax.sgd(0.1), 2)
    params = {"a": jnp.zeros(2)}
    state = ms.init(params)
    flags = []
    for _ in range(2):
        _, state = ms.update({"a": jnp.ones(2)}, state, params)
        flags.append(bool(optax_accum.has_updated(state)))
    assert flags == [False, True]

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    grads = nnx.state(model, nnx.Param)
    for tx in (ms.gradient_transformation(), optax_accum.accumulate(optax.sgd(1), 2)):
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        flags = []
        for _ in range(2):
            opt.update(model, grads)
            flags.append(bool(optax_accum.has_updated(opt.opt_state)))
        assert flags == [False, True]
    opt = nnx.Optimizer(model, ms.gradient_transformation(), wrt=nnx.Param)
    for _ in range(2):
        opt.update(model, grads)
    assert bool(ms.has_updated(opt.opt_state))  # nnx's wrapped arrays


def test_schedule_free_eval_params_through_find_state():
    from optax.contrib import ScheduleFreeState, schedule_free_eval_params

    x, y = _data(2)
    make = lambda: optax.contrib.schedule_free_adamw(0.05, warmup_steps=2)
    tx, ref = optax_accum.accumulate(make(), K), make()
    params, state = _accumulated(tx, 5, x, y)
    ref_params, ref_state = P0, ref.init(P0)
    for _ in range(5):
        grad = jax.grad(_loss)(ref_params, x, y)
        u, ref_state = ref.update(grad, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, u)
    with pytest.raises(AttributeError, match="b1"):  # what the user first saw
        schedule_free_eval_params(state, params)
    sf_state = optax_accum.find_state(state, ScheduleFreeState)
    chex.assert_trees_all_close(
        schedule_free_eval_params(sf_state, params),
        schedule_free_eval_params(ref_state, ref_params),
        rtol=1e-5,
    )


def test_find_state_names_what_it_did_not_find():
    state = optax_accum.accumulate(optax.adam(1.0), 2).init(P0)
    with pytest.raises(ValueError, match="exactly one ScaleByLionState, found 0"):
        optax_accum.find_state(state, optax.ScaleByLionState)


def test_microbatch_with_an_nnx_module_points_to_nnx_train_step():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    loss = lambda m, x: jnp.mean(m(x) ** 2)
    fun = optax_accum.microbatch(nnx.value_and_grad(loss), 2)
    with pytest.raises(TypeError, match="nnx_train_step"):
        nnx.jit(fun)(model, jnp.ones((4, 2)))


# Errors that name the argument ----------------------------------------------


@pytest.mark.parametrize(
    ("make_fun", "has_aux", "match"),
    [
        # has_aux=True on a plain value_and_grad: "iteration over a 0-d array".
        (lambda f: jax.value_and_grad(f), True, "pass has_aux=False"),
        # has_aux=False on ((value, aux), grads): "Too many indices".
        (
            lambda f: jax.value_and_grad(lambda w, x: (f(w, x), x), has_aux=True),
            False,
            "pass has_aux=True",
        ),
        # a plain loss: "IndexError".
        (lambda f: f, False, "not the loss"),
        # jax.grad with dict params: "KeyError: 0".
        (lambda f: jax.grad(f), False, r"not jax.grad\(loss\)"),
    ],
)
def test_fun_output_structure_is_checked(make_fun, has_aux, match):
    loss = lambda w, x: jnp.mean((x * w["a"]) ** 2)
    fun = optax_accum.microbatch(make_fun(loss), 2, has_aux=has_aux)
    with pytest.raises(TypeError, match=match):
        fun({"a": jnp.float32(1.0)}, jnp.ones(4))


def test_weight_string_and_close_window_shape_name_the_argument():
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    params = {"a": jnp.zeros([])}
    state = tx.init(params)
    with pytest.raises(TypeError, match="`weight` must be a real number, got '3'"):
        tx.update(params, state, params, weight="3")
    with pytest.raises(ValueError, match=r"`close_window` must be a boolean scalar"):
        tx.update(params, state, params, close_window=jnp.array([True]))
    with pytest.raises(TypeError, match=r"`close_window` must be a boolean scalar"):
        tx.update(params, state, params, close_window=1.0)


@pytest.mark.parametrize(
    ("k", "error", "match"),
    [
        (0, ValueError, "`num_micro_batches` must be >= 1, got 0"),
        (2.0, TypeError, "`num_micro_batches` must be an integer, got 2.0"),
    ],
)
def test_flax_helpers_validate_at_construction(k, error, match):
    pytest.importorskip("flax")
    from optax_accum.flax import linen_train_step, nnx_train_step

    loss = lambda *a: 0.0
    for helper in (nnx_train_step, linen_train_step):
        with pytest.raises(error, match=match):
            helper(loss, k)
    with pytest.raises(ValueError, match="`reduction` must be one of"):
        nnx_train_step(loss, 2, reduction="avg")
    with pytest.raises(TypeError, match="`batch_argnums` is set by nnx_train_step"):
        nnx_train_step(loss, 2, batch_argnums=1)


def test_uncalled_skip_large_updates_says_call_it():
    for make in (
        lambda f: optax_accum.accumulate(optax.sgd(1.0), 2, skip_fn=f),
        lambda f: optax_accum.MultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=f),
    ):
        with pytest.raises(TypeError, match=r"call it: skip_large_updates\(max_norm\)"):
            make(optax_accum.skip_large_updates)
    with pytest.raises(TypeError, match=r"`skip_fn` must take \(grads, step, params\)"):
        optax_accum.accumulate(optax.sgd(1.0), 2, skip_fn=lambda g: g)


# optax's alias tests, wrapped ------------------------------------------------

# A fast subset of optax's `alias_test._OPTIMIZERS_UNDER_TEST`; the whole list
# (40 complex and 66 float64 cases) ran clean once, see the issue 10 report.
_ALIAS_SUBSET = [
    ("adam", {"learning_rate": 1e-1}, True),
    ("adafactor", {"learning_rate": 5e-3}, True),
    ("lamb", {"learning_rate": 1e-3}, True),
    ("lars", {"learning_rate": 1.0}, True),
    ("rmsprop", {"learning_rate": 5e-3, "momentum": 0.9}, True),
    ("noisy_sgd", {"learning_rate": 1e-3, "eta": 1e-4, "key": 0}, False),
    ("polyak_sgd", {"max_learning_rate": 1.0}, False),
]


def _parabola_run(tx, dtype, steps=10):
    params = jnp.array([-1.0, 10.0, 1.0], dtype)
    target = jnp.array([1.0, -1.0, 1.0], dtype)
    if jnp.iscomplexobj(params):
        target = target * (1 + 1j)
    objective = lambda p: jnp.sum(jnp.abs(p - target) ** 2)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        value, grad = jax.value_and_grad(objective)(params)
        updates, state = tx.update(jnp.conj(grad), state, params, value=value)
        return optax.apply_updates(params, updates), state

    for _ in range(steps):
        params, state = step(params, state)
    return params


@pytest.mark.parametrize(("name", "kwargs", "complex_ok"), _ALIAS_SUBSET)
@pytest.mark.parametrize("dtype", ["complex64", "float64"])
def test_alias_optimizers_wrapped_with_k_1(name, kwargs, complex_ok, dtype):
    if dtype == "complex64" and not complex_ok:
        pytest.skip(f"optax's {name} does not support complex parameters")
    with jax.enable_x64(dtype == "float64"):
        make = lambda: getattr(optax, name)(**kwargs)
        ours = _parabola_run(optax_accum.accumulate(make(), 1), jnp.dtype(dtype))
        ref = _parabola_run(make(), jnp.dtype(dtype))
        assert ours.dtype == ref.dtype
        # Before: complex lost its imaginary part (errors of 0.1 to 1); float64
        # was rounded through float32 (1e-10 to 1e-6).
        np.testing.assert_allclose(
            ours, ref, rtol=1e-6 if dtype == "complex64" else 1e-10
        )


# Docs: clipping before the accumulator ---------------------------------------


def test_clipping_before_accumulate_warns_once(monkeypatch):
    from optax_accum import _mistakes

    params = {"a": jnp.zeros(2)}
    grads = {"a": jnp.full(2, 3.0)}
    for good in (
        optax_accum.accumulate(
            optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)), 2
        ),
        optax.chain(optax.scale(0.5), optax_accum.accumulate(optax.adam(0.1), 2)),
    ):
        monkeypatch.setattr(_mistakes, "_warned", False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            good.update(grads, good.init(params), params)
    for bad in (
        optax.chain(
            optax.clip_by_global_norm(1.0), optax_accum.accumulate(optax.adam(0.1), 2)
        ),
        optax.chain(
            optax.clip(1.0),
            optax_accum.MultiSteps(optax.adam(0.1), 2).gradient_transformation(),
        ),
    ):
        monkeypatch.setattr(_mistakes, "_warned", False)
        state = bad.init(params)
        with pytest.warns(UserWarning, match="clips every micro-batch"):
            _, state = bad.update(grads, state, params)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process
            bad.update(grads, state, params)
