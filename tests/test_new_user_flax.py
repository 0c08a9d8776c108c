# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Issue 10, Flax side: the helpers forward optimizer extra args, accept a
plain linen ``TrainState``; each test failed before the fix."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("flax")
import flax.linen as nn
from flax import nnx
from flax.training import train_state

from optax_accum.flax import linen_train_step, nnx_train_step

K, STEPS = 4, 6


def _data(seed=0, n=K * 4):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(n, 1)) * 3 + 5 * rng.normal(size=(n, 1)) ** 2)
    return x, y.astype(jnp.float32)


def _plateau():
    return optax.chain(
        optax.sgd(0.5),
        optax.contrib.reduce_on_plateau(factor=0.5, patience=1, accumulation_size=1),
    )


def _nnx_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _nnx_large_batch(x, y):
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, _plateau(), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(_nnx_loss)(model, x, y)
        opt.update(model, grads, value=loss)

    for _ in range(STEPS):
        step(model, opt, x, y)
    return nnx.state(model, nnx.Param)


@pytest.mark.parametrize("explicit", [False, True])
def test_nnx_train_step_feeds_reduce_on_plateau(explicit):
    # Before: `update_fn() missing ... 'value'`, and `value=` was rejected.
    x, y = _data()
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, _plateau(), wrt=nnx.Param)
    step = nnx.jit(nnx_train_step(_nnx_loss, K))
    for _ in range(STEPS):
        if explicit:  # the large-batch loss, computed by the user
            step(model, opt, x, y, value=_nnx_loss(model, x, y))
        else:  # the step passes its own loss, the mean over the k micro-batches
            step(model, opt, x, y)
    chex.assert_trees_all_close(
        nnx.state(model, nnx.Param), _nnx_large_batch(x, y), rtol=1e-5, atol=1e-6
    )


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(x)


def _plain_state(tx):
    net = _Dense()
    params = net.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    return train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)


def _linen_loss(params, rng, x, y):
    del rng
    return jnp.mean((_Dense().apply({"params": params}, x) - y) ** 2)


@pytest.mark.parametrize("plateau", [False, True])
def test_linen_train_step_takes_a_plain_train_state(plateau):
    # Before: AttributeError on `state.batch_stats`.
    x, y = _data(1)
    make = _plateau if plateau else (lambda: optax.adam(0.05))
    state = _plain_state(make())
    step = jax.jit(linen_train_step(_linen_loss, K))
    ref = _plain_state(make())
    for _ in range(STEPS):
        state, loss = step(state, x, y)
        value, grads = jax.value_and_grad(_linen_loss)(ref.params, None, x, y)
        updates, opt_state = ref.tx.update(
            grads, ref.opt_state, ref.params, value=value
        )
        ref = ref.replace(
            step=ref.step + 1,
            params=optax.apply_updates(ref.params, updates),
            opt_state=opt_state,
        )
        np.testing.assert_allclose(loss, value, rtol=1e-5)
    chex.assert_trees_all_close(state.params, ref.params, rtol=1e-5, atol=1e-6)
    assert int(state.step) == STEPS
