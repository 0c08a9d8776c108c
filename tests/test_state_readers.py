# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`has_updated` and `find_state` read a state inside what wraps it.

`has_updated` reads `MultiSteps` states and ``nnx.Optimizer.opt_state`` (whose
arrays Flax wraps in variables); `find_state` hands the inner optimizer's
state to functions that expect it (schedule-free's evaluation parameters) and
names the type it did not find.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optax_accum
from tests.helpers.models import (
    linear_data,
    linear_loss,
    linear_params,
    train_in_micro_batches,
)

K = 4


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


@pytest.mark.slow
def test_schedule_free_eval_params_through_find_state():
    from optax.contrib import ScheduleFreeState, schedule_free_eval_params

    x, y = linear_data(2)
    make = lambda: optax.contrib.schedule_free_adamw(0.05, warmup_steps=2)
    tx, ref = optax_accum.accumulate(make(), K), make()
    params, state = train_in_micro_batches(tx, 5, K, x, y)
    ref_params = linear_params()
    ref_state = ref.init(ref_params)
    for _ in range(5):
        grad = jax.grad(linear_loss)(ref_params, x, y)
        u, ref_state = ref.update(grad, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, u)
    # Handed our state, optax's function looks for ScheduleFreeState's fields.
    with pytest.raises(AttributeError, match="b1"):
        schedule_free_eval_params(state, params)
    sf_state = optax_accum.find_state(state, ScheduleFreeState)
    chex.assert_trees_all_close(
        schedule_free_eval_params(sf_state, params),
        schedule_free_eval_params(ref_state, ref_params),
        rtol=1e-5,
    )


def test_find_state_names_what_it_did_not_find():
    state = optax_accum.accumulate(optax.adam(1.0), 2).init(linear_params())
    with pytest.raises(ValueError, match="exactly one ScaleByLionState, found 0"):
        optax_accum.find_state(state, optax.ScaleByLionState)


def test_has_updated_reads_multisteps_with_noise_scale():
    ms = optax_accum.MultiSteps(optax.sgd(1.0), 2, noise_scale_decay=0.9)
    params = {"w": jnp.zeros(2)}
    state = ms.init(params)
    assert isinstance(state, optax_accum.MultiStepsState)
    assert not bool(optax_accum.has_updated(state))
    for _ in range(2):
        _, state = ms.update({"w": jnp.ones(2)}, state, params)
    assert bool(optax_accum.has_updated(state)) and bool(ms.has_updated(state))
    # Off, the state has exactly optax's leaves.
    off = optax_accum.MultiSteps(optax.sgd(1.0), 2).init(params)
    ref = optax.MultiSteps(optax.sgd(1.0), 2).init(params)
    assert len(jax.tree.leaves(off)) == len(jax.tree.leaves(ref))


@pytest.mark.parametrize("jit", [False, True])
def test_has_updated_is_false_after_a_rejected_mini_step_on_both_faces(jit):
    # Issue 20, defect 11: g, g, NaN, g with k = 2 updates on the second call
    # only. MultiSteps said True after the NaN (the window is still empty).
    params = {"w": jnp.zeros(2)}
    skip = optax_accum.skip_not_finite
    acc = optax_accum.accumulate(optax.sgd(1.0), 2, skip_fn=skip)
    ms = optax_accum.MultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=skip)
    grads = [jnp.ones(2), jnp.ones(2), jnp.full(2, jnp.nan), jnp.ones(2)]
    flags = {"accumulate": [], "MultiSteps": [], "MultiSteps.has_updated": []}
    acc_update, ms_update = (jax.jit(f) if jit else f for f in (acc.update, ms.update))
    acc_state, ms_state = acc.init(params), ms.init(params)
    for g in grads:
        _, acc_state = acc_update({"w": g}, acc_state, params)
        _, ms_state = ms_update({"w": g}, ms_state, params)
        flags["accumulate"].append(bool(optax_accum.has_updated(acc_state)))
        flags["MultiSteps"].append(bool(optax_accum.has_updated(ms_state)))
        flags["MultiSteps.has_updated"].append(bool(ms.has_updated(ms_state)))
    expected = [False, True, False, False]
    assert flags == dict.fromkeys(flags, expected)
