# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Renamed public names: each old spelling still works for one release, and
warns with a DeprecationWarning that names its successor."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import distributed


@pytest.mark.parametrize(
    "old, new",
    [
        ("plan_micro_batch", optax_accum.plan_microbatch),
        ("MicroBatchPlan", optax_accum.MicrobatchPlan),
        ("MultiStepsNoiseState", optax_accum.MultiStepsState),
        ("initialize_distributed", distributed.initialize_distributed),
        ("launch_local", distributed.launch_local),
        ("LocalRun", distributed.LocalRun),
    ],
)
def test_old_top_level_names_warn_and_are_the_new_objects(old, new):
    with pytest.warns(DeprecationWarning, match=old):
        assert getattr(optax_accum, old) is new
    assert old not in optax_accum.__all__


def test_unknown_attribute_still_raises():
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        optax_accum.nonexistent  # noqa: B018


def _grad_fn():
    return jax.value_and_grad(lambda w, x: jnp.mean((x * w) ** 2))


def test_microbatch_old_keywords():
    x = jnp.arange(8.0)
    new = optax_accum.microbatch(_grad_fn(), 4)(jnp.float32(1.0), x)
    with pytest.warns(DeprecationWarning, match="`num_microbatches=`"):
        old = optax_accum.microbatch(_grad_fn(), num_micro_batches=4)
    np.testing.assert_allclose(old(jnp.float32(1.0), x), new)
    with pytest.warns(DeprecationWarning, match="`data_axes=`"):
        old = optax_accum.microbatch(_grad_fn(), 4, mesh_axes=None)
    np.testing.assert_allclose(old(jnp.float32(1.0), x), new)
    for spelling in ({"mesh_axes": "auto"}, {"data_axes": "auto"}):
        with pytest.warns(DeprecationWarning, match="data_axes=None"):
            old = optax_accum.microbatch(_grad_fn(), 4, **spelling)
        np.testing.assert_allclose(old(jnp.float32(1.0), x), new)


@pytest.mark.parametrize(
    "face",
    [
        lambda **kw: optax_accum.microbatch(_grad_fn(), 4, **kw),
        lambda **kw: optax_accum.microbatch_value_and_grad(
            lambda w, x: jnp.mean((x * w) ** 2), 4, **kw
        ),
    ],
    ids=["microbatch", "microbatch_value_and_grad"],
)
def test_param_gather_per_micro_batch_is_per_microbatch(face):
    x = jnp.arange(8.0)
    new = face(param_gather="per_microbatch")(jnp.float32(1.0), x)
    with pytest.warns(DeprecationWarning, match='`param_gather="per_microbatch"`'):
        old = face(param_gather="per_micro_batch")
    np.testing.assert_allclose(old(jnp.float32(1.0), x), new)


def test_passing_both_spellings_is_an_error():
    with pytest.raises(TypeError, match="both `num_micro_batches`"):
        optax_accum.microbatch(_grad_fn(), num_microbatches=4, num_micro_batches=4)


def test_defer_axes_is_data_axes():
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        params = jax.device_put(jnp.ones(3), P())
        for make in (
            lambda **kw: optax_accum.accumulate(optax.sgd(1.0), 2, **kw),
            lambda **kw: optax_accum.MultiSteps(optax.sgd(1.0), 2, **kw),
        ):
            new = jax.eval_shape(make(data_axes="data").init, params)
            with pytest.warns(DeprecationWarning, match="`data_axes=`"):
                old = jax.eval_shape(make(defer_axes="data").init, params)
            assert jax.tree.structure(old) == jax.tree.structure(new)
            leaf = jax.tree.leaves(old)[2]
            assert (
                jax.typeof(leaf).sharding.spec
                == jax.typeof(jax.tree.leaves(new)[2]).sharding.spec
            )
        with pytest.warns(DeprecationWarning, match="`data_axes=`"):
            marked = optax_accum.defer_reduction(params, axes="data")
        assert jax.typeof(marked).sharding.spec.reduced == frozenset({"data"})


def test_schedule_keywords():
    with pytest.warns(DeprecationWarning, match="`min_k=`"):
        old = optax_accum.adaptive_every_k(k_min=2, k_max=8)
    assert old == optax_accum.adaptive_every_k(2, 8)
    with pytest.warns(DeprecationWarning, match="`min_k`"):
        assert old.k_min == 2
    with pytest.warns(DeprecationWarning, match="`max_k`"):
        assert old.k_max == 8
    with pytest.warns(DeprecationWarning, match="`warmup_steps=`"):
        old = optax_accum.batch_size_warmup(
            micro_batch_size=8, init_batch_size=8, batch_size=32, warmup_updates=3
        )
    new = optax_accum.batch_size_warmup(8, 8, 32, warmup_steps=3)
    assert [int(old(t)) for t in range(5)] == [int(new(t)) for t in range(5)]


def test_noise_scale_and_planner_keywords():
    tx = optax_accum.accumulate(optax.sgd(0.1), 2, noise_scale_decay=0.5)
    params = jnp.zeros(2)
    state = tx.init(params)
    for g in ([1.0, 1.0], [3.0, 1.0]):
        _, state = tx.update(jnp.array(g), state, params)
    with pytest.warns(DeprecationWarning, match="`microbatch_size=`"):
        old = optax_accum.noise_scale(state, micro_batch_size=8)
    assert old == optax_accum.noise_scale(state, microbatch_size=8)

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    kwargs = dict(target_batch_size=64, memory_budget=10**9)
    args = (jax.value_and_grad(loss), jnp.zeros((8, 8)), None, jnp.zeros(8))
    with pytest.warns(DeprecationWarning, match="`max_microbatch_size=`"):
        old = optax_accum.plan_microbatch(*args, max_micro_batch_size=16, **kwargs)
    assert old == optax_accum.plan_microbatch(*args, max_microbatch_size=16, **kwargs)
    with pytest.warns(DeprecationWarning, match="`microbatch_size`"):
        assert old.micro_batch_size == old.microbatch_size == 16
    with pytest.warns(DeprecationWarning, match="`num_microbatches`"):
        assert old.num_micro_batches == old.num_microbatches == 4


def test_accumulate_state_weight_sum():
    tx = optax_accum.accumulate(optax.sgd(1.0), 4)
    params = jnp.zeros(2)
    state = tx.init(params)
    for w in (1.0, 3.0):
        _, state = tx.update(jnp.ones(2), state, params, weight=w)
    with pytest.warns(DeprecationWarning, match="mean_weight"):
        assert float(state.weight_sum) == 4.0


def test_flax_helpers_old_keywords():
    pytest.importorskip("flax")
    from flax import nnx

    from optax_accum.flax import linen_train_step, nnx_train_step

    def loss_fn(model, x):
        return jnp.mean(model(x) ** 2)

    for helper in (nnx_train_step, linen_train_step):
        with pytest.warns(DeprecationWarning, match="`num_microbatches=`"):
            helper(loss_fn, num_micro_batches=2)
        with pytest.warns(DeprecationWarning, match="`data_axes=`"):
            helper(loss_fn, 2, mesh_axes=None)
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.warns(DeprecationWarning):
        step = nnx_train_step(loss_fn, num_micro_batches=2)
    assert step(model, optimizer, jnp.ones((4, 2))).shape == ()
