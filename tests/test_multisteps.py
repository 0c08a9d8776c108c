# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The drop-in `MultiSteps`, tested the way optax tests ``optax.MultiSteps``.

These mirror ``optax/transforms/_accumulation_test.py`` with ``optax`` replaced
by ``optax_accum`` where the drop-in is used, so whatever optax checks for its
``MultiSteps`` holds for ours.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optax_accum import MultiSteps, MultiStepsState
from tests.helpers.models import mlp_loss, mlp_params


def _loss(params, data):
    return mlp_loss(params, data, jnp.zeros((data.shape[0], 3), data.dtype))


def test_multi_steps():
    k_steps = 4
    data = jnp.ones([32, 6])
    params = mlp_params()
    ms_opt = MultiSteps(
        # A non-trivial inner optimizer: it has a state and needs the params.
        optax.chain(
            optax.scale_by_adam(), optax.add_decayed_weights(1e-2), optax.scale(-1e-4)
        ),
        k_steps,
    )
    opt_init, opt_update = ms_opt.gradient_transformation()

    def train_step(data, opt_state, params):
        grad = jax.grad(_loss)(params, data)
        return opt_update(grad, opt_state, params)

    opt_state = opt_init(params)
    prev_loss = _loss(params, data)
    for idx in range(5 * k_steps):
        updates, opt_state = jax.jit(train_step)(data, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        new_loss = _loss(new_params, data)
        if idx % k_steps < k_steps - 1:
            jax.tree.map(np.testing.assert_array_equal, new_params, params)
            np.testing.assert_equal(new_loss, prev_loss)
            assert not ms_opt.has_updated(opt_state)
        else:
            np.testing.assert_array_less(new_loss, prev_loss)
            prev_loss = new_loss
            assert ms_opt.has_updated(opt_state)
        params = new_params


def test_multi_steps_every_k_schedule():
    ms_opt = MultiSteps(
        optax.sgd(1e-4), lambda grad_step: jnp.where(grad_step < 2, 1, 3)
    )
    opt_init, opt_update = ms_opt.gradient_transformation()
    params = {"a": jnp.zeros([])}
    opt_state = opt_init(params)
    grad = {"a": jnp.zeros([])}
    assert not ms_opt.has_updated(opt_state)
    for _ in range(2):
        _, opt_state = opt_update(grad, opt_state, params)
        assert ms_opt.has_updated(opt_state)
    for _ in range(5):
        for _ in range(2):
            _, opt_state = opt_update(grad, opt_state, params)
            assert not ms_opt.has_updated(opt_state)
        _, opt_state = opt_update(grad, opt_state, params)
        assert ms_opt.has_updated(opt_state)


def test_multi_steps_scan_dtype_stability():
    ms_opt = MultiSteps(optax.sgd(1e-4), 2, accumulator_dtype=jnp.float32)
    opt_init, opt_update = ms_opt.gradient_transformation()
    params = {"a": jnp.zeros([], dtype=jnp.bfloat16)}

    def train_step(state, _):
        grad = {"a": jnp.ones([], dtype=jnp.bfloat16)}
        updates, opt_state = opt_update(grad, state, params)
        return opt_state, updates

    final_state, _ = jax.lax.scan(train_step, opt_init(params), jnp.arange(4))
    assert final_state.acc_grads["a"].dtype == jnp.float32


def test_multi_steps_zero_nans():
    # https://github.com/google-deepmind/optax/issues/828
    ms_opt = MultiSteps(
        optax.chain(optax.zero_nans(), optax.sgd(1e-4)), every_k_schedule=2
    )
    opt_init, opt_update = ms_opt.gradient_transformation()
    params = {"a": jnp.zeros([])}
    updates, _ = opt_update({"a": jnp.zeros([])}, opt_init(params), params)
    np.testing.assert_array_equal(updates["a"], 0.0)


@pytest.mark.parametrize("use_grad_mean", [True, False])
def test_multi_steps_computes_mean(use_grad_mean):
    k_steps = 4
    ms_opt = MultiSteps(optax.scale(1.0), k_steps, use_grad_mean=use_grad_mean)
    opt_init, opt_update = ms_opt.gradient_transformation()
    params = {"a": jnp.zeros([])}
    opt_state = opt_init(params)
    grads = [{"a": jnp.ones([]) * i} for i in [1, 2, 3, 4]]
    assert not ms_opt.has_updated(opt_state)
    for grad in grads[:-1]:
        _, opt_state = opt_update(grad, opt_state, params)
        assert not ms_opt.has_updated(opt_state)
    new_params, opt_state = opt_update(grads[-1], opt_state, params)
    assert ms_opt.has_updated(opt_state)
    np.testing.assert_array_equal(new_params["a"], 2.5 if use_grad_mean else 10.0)


@pytest.mark.parametrize("skip_fn", ["optax", "optax_accum"])
def test_multi_steps_skip_not_finite(skip_fn):
    import optax_accum

    fn = optax.skip_not_finite if skip_fn == "optax" else optax_accum.skip_not_finite
    ms_opt = MultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=fn)
    opt_init, opt_update = ms_opt.gradient_transformation()
    opt_init, opt_update = jax.jit(opt_init), jax.jit(opt_update)
    params = {"a": jnp.zeros([])}
    opt_state = opt_init(params)

    # Good updates.
    updates, opt_state = opt_update({"a": jnp.ones([])}, opt_state, params)
    assert int(opt_state.mini_step) == 1
    params = optax.apply_updates(params, updates)
    updates, opt_state = opt_update({"a": jnp.ones([])}, opt_state, params)
    assert int(opt_state.mini_step) == 0
    params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(params["a"], -1.0)
    # Inf and NaN updates are ignored.
    for bad in (float("inf"), float("nan")):
        updates, opt_state = opt_update({"a": jnp.array(bad)}, opt_state, params)
        assert int(opt_state.mini_step) == 0
        assert bool(opt_state.skip_state["should_skip"])
        params = optax.apply_updates(params, updates)
        np.testing.assert_array_equal(params["a"], -1.0)
    # Final good updates.
    updates, opt_state = opt_update({"a": jnp.ones([])}, opt_state, params)
    assert int(opt_state.mini_step) == 1
    params = optax.apply_updates(params, updates)
    updates, opt_state = opt_update({"a": jnp.ones([])}, opt_state, params)
    assert int(opt_state.mini_step) == 0
    params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(params["a"], -2.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("opt_name", "opt_kwargs"),
    [
        ("sgd", {"learning_rate": 0.1}),
        ("adam", {"learning_rate": 0.1}),
        ("adamw", {"learning_rate": 0.1}),
    ],
)
def test_multi_steps_mixed_precision(opt_name, opt_kwargs):
    # Dtypes are a property of the trace: the 9 dtype pairs run abstractly.
    k_steps = 4
    opt = getattr(optax, opt_name)(**opt_kwargs)
    ms_opt = MultiSteps(opt, k_steps)
    ms_init, ms_update = ms_opt.gradient_transformation()
    dtypes = [jnp.float32, jnp.float16, jnp.bfloat16]

    def steps(params, data, upd_dtype):
        opt_state, ms_state = opt.init(params), ms_init(params)
        for _ in range(k_steps + 1):
            grad = jax.tree.map(
                lambda x: x.astype(upd_dtype), jax.grad(_loss)(params, data)
            )
            updates, opt_state = opt.update(grad, opt_state, params)
            ms_updates, ms_state = ms_update(grad, ms_state, params)
            chex.assert_trees_all_equal_dtypes(updates, ms_updates)
            new_params = optax.apply_updates(params, ms_updates)
            chex.assert_trees_all_equal_dtypes(params, new_params)
            params = new_params

    for upd_dtype in dtypes:
        for param_dtype in dtypes:
            data = jax.ShapeDtypeStruct((8, 6), param_dtype)
            params = jax.tree.map(
                lambda p, t=param_dtype: jax.ShapeDtypeStruct(p.shape, t),
                mlp_params(),
            )
            jax.eval_shape(functools.partial(steps, upd_dtype=upd_dtype), params, data)


def test_state_fields_and_inner_opt_match_optax():
    inner = optax.adam(1e-3)
    ours, theirs = MultiSteps(inner, 3), optax.MultiSteps(inner, 3)
    params = {"a": jnp.zeros(2)}
    # optax's fields, in order, then ours: the window's value and the noise
    # scale, both () for Adam without the noise scale: no leaves of their own.
    n = len(optax.MultiStepsState._fields)
    assert MultiStepsState._fields[:n] == optax.MultiStepsState._fields
    assert MultiStepsState._fields[n:] == ("acc_value", "noise_scale", "updated")
    ours_state, theirs_state = ours.init(params), theirs.init(params)
    assert ours_state.acc_value == () and ours_state.noise_scale == ()
    assert ours_state.updated == ()
    assert len(jax.tree.leaves(ours_state)) == len(jax.tree.leaves(theirs_state))
    chex.assert_trees_all_equal_structs(tuple(ours_state)[:n], tuple(theirs_state))
    chex.assert_trees_all_equal_dtypes(tuple(ours_state)[:n], tuple(theirs_state))
    chex.assert_trees_all_equal(
        ours.inner_opt.init(params), theirs.inner_opt.init(params)
    )


def test_restores_an_optax_state_mid_window():
    # An optax.MultiSteps state (e.g. from a checkpoint) continues in ours.
    inner = optax.adam(0.1)
    theirs, ours = optax.MultiSteps(inner, 3), MultiSteps(inner, 3)
    params = {"a": jnp.zeros(2)}
    grads = [{"a": jnp.array([1.0, -2.0]) * (i + 1)} for i in range(6)]
    state = theirs.init(params)
    for g in grads[:2]:
        _, state = theirs.update(g, state, params)
    ref_state, our_state = state, MultiStepsState(*state)
    for g in grads[2:]:
        ref_u, ref_state = theirs.update(g, ref_state, params)
        u, our_state = ours.update(g, our_state, params)
        chex.assert_trees_all_close(u, ref_u, rtol=1e-6)


def test_weight_is_refused_and_close_window_is_honoured():
    ms = MultiSteps(optax.sgd(1.0), 4)
    params = jnp.zeros(())
    state = ms.init(params)
    with pytest.raises(TypeError, match=r"`weight`.*accumulate"):
        ms.update(jnp.float32(1.0), state, params, weight=3.0)
    _, state = ms.update(jnp.float32(1.0), state, params)
    u, state = ms.update(jnp.float32(3.0), state, params, close_window=True)
    assert float(u) == -2.0 and int(state.mini_step) == 0
    assert int(state.gradient_step) == 1


def _key_paths(tree):
    return [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


@pytest.mark.parametrize("skip", [None, optax.skip_not_finite])
def test_state_flattens_to_optax_key_paths(skip):
    # What checkpointers (Orbax) match on: the leaves' key paths. Ours off
    # are not part of the pytree; ``updated`` is, with a skip function.
    params = {"a": jnp.zeros(2)}
    ours = MultiSteps(optax.adam(1e-3), 3, should_skip_update_fn=skip)
    theirs = optax.MultiSteps(optax.adam(1e-3), 3, should_skip_update_fn=skip)
    extra = [] if skip is None else [".updated"]
    assert _key_paths(ours.init(params)) == _key_paths(theirs.init(params)) + extra
    on = MultiSteps(optax.adam(1e-3), 3, noise_scale_decay=0.9).init(params)
    assert jax.tree.map(lambda x: x, on) == on  # rebuilds with its fields
    assert ".noise_scale.windows" in _key_paths(on)


@pytest.mark.parametrize("use_grad_mean", [True, False])
def test_our_state_into_optax_needs_to_optax(use_grad_mean):
    # Our buffer is stale, not zero, at an empty window: optax adds to it.
    ours = MultiSteps(optax.sgd(1.0), 2, use_grad_mean=use_grad_mean)
    theirs = optax.MultiSteps(optax.sgd(1.0), 2, use_grad_mean=use_grad_mean)
    params = jnp.zeros(2)
    grads = [jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])]
    state = ours.init(params)
    for g in grads:
        _, state = ours.update(g, state, params)
    second = [jnp.array([5.0, 6.0]), jnp.array([7.0, 8.0])]
    expected = -(second[0] + second[1]) / (2 if use_grad_mean else 1)

    def optax_window(s):
        for g in second:
            u, s = theirs.update(g, s, params)
        return u

    if not use_grad_mean:  # handed over directly: the last window again
        np.testing.assert_array_equal(optax_window(state), [-16.0, -20.0])
    handed = state.to_optax()
    assert type(handed) is optax.MultiStepsState
    np.testing.assert_array_equal(optax_window(handed), expected)


def test_noise_scale_with_data_axes_is_refused():
    # Issue 20, defect 9: accumulate refused the pair; MultiSteps did not
    # check it and failed at trace time with a ShardingTypeError.
    with pytest.raises(ValueError, match=r"`noise_scale_decay`.*`data_axes`"):
        MultiSteps(optax.sgd(1.0), 2, data_axes="data", noise_scale_decay=0.9)


def test_optax_state_mid_window_gives_the_mean_value_since_the_hand_over():
    # Issue 27: optax's state holds no values, so the window's value is the
    # mean of those seen since the hand-over (the first one, counted for the
    # window's unseen values, once weighed 3/4 of it); later windows' whole.
    def value_as_update(updates, state, params=None, *, value, **extra_args):
        return jax.tree.map(lambda u: jnp.zeros_like(u) + value, updates), state

    inner = optax.GradientTransformationExtraArgs(
        lambda p: optax.EmptyState(), value_as_update
    )
    theirs, ours = optax.MultiSteps(inner, 4), MultiSteps(inner, 4)
    params = jnp.zeros(2)
    state = theirs.init(params)
    for value in (1.0, 2.0):
        _, state = theirs.update(params, state, params, value=jnp.float32(value))
    emitted = []
    for value in (4.0, 8.0, 16.0, 32.0, 64.0, 128.0):
        u, state = ours.update(params, state, params, value=jnp.float32(value))
        if int(state.mini_step) == 0:
            emitted.append(float(u[0]))
    assert emitted == [(4 + 8) / 2, (16 + 32 + 64 + 128) / 4]
