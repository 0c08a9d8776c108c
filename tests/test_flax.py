# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Tests for `optax_accum.flax`: nnx and linen fused steps vs explicit loops."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training import train_state  # noqa: E402

from optax_accum.flax import linen_train_step, nnx_train_step  # noqa: E402

K = 4


def _data(n=16):
    kx, ky = jax.random.split(jax.random.key(42))
    return jax.random.normal(kx, (n, 3)) * 2 + 1, jax.random.randint(ky, (n,), 0, 2)


def _micro(x, i):
    return x[i::K]


def _close(a, b):
    def data(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key_data(x)
        return x

    chex.assert_trees_all_close(
        jax.tree.map(data, a), jax.tree.map(data, b), rtol=1e-5, atol=1e-6
    )


# -------------------------------------------------------------------- nnx


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(3, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def _nnx_loss(model, x, y):
    logits = model(x)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _nnx_setup():
    model = NnxNet(nnx.Rngs(0, dropout=1))
    model.train()
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def test_nnx_step_equals_explicit_loop():
    x, y = _data()
    model, optimizer = _nnx_setup()
    step = nnx.jit(nnx_train_step(_nnx_loss, K))
    ref_model, ref_optimizer = _nnx_setup()

    @nnx.jit
    def ref_step(model, optimizer, x, y):
        # k small steps' worth of forward passes, one optimizer update.
        grad_fn = nnx.value_and_grad(_nnx_loss)
        losses, grads = [], []
        for i in range(K):
            loss, g = grad_fn(model, _micro(x, i), _micro(y, i))
            losses.append(loss)
            grads.append(g)
        mean = jax.tree.map(lambda *g: sum(g) / K, *grads)
        optimizer.update(model, mean)
        return sum(losses) / K

    for _ in range(2):
        loss = step(model, optimizer, x, y)
        ref_loss = ref_step(ref_model, ref_optimizer, x, y)
        _close(loss, ref_loss)
    _close(nnx.state(model), nnx.state(ref_model))
    # BatchNorm running stats moved k times per step (momentum 0.9, 2 steps).
    assert not np.allclose(model.bn.mean[...], 0.0)
    assert int(model.drop.rngs.count[...]) == 2 * K


def test_nnx_dropout_differs_per_micro_batch():
    x = jnp.ones((8, 3))
    model, optimizer = _nnx_setup()

    def loss_fn(model, x):
        out = model.drop(x)
        return jnp.mean(out), out

    step = nnx.jit(nnx_train_step(loss_fn, 2, has_aux=True))
    _, masks = step(model, optimizer, x)
    assert masks.shape == (2, 4, 3)
    assert not np.array_equal(masks[0], masks[1])


def test_nnx_batchnorm_uses_each_micro_batch_statistics():
    # Micro-batches with very different means: per-micro-batch normalization
    # makes every normalized micro-batch zero-mean.
    x = jnp.concatenate([jnp.zeros((4, 3)), 10 * jnp.ones((4, 3))])
    x = x.reshape(2, 4, 3).transpose(1, 0, 2).reshape(8, 3)  # rows i::2
    model = nnx.BatchNorm(3, use_bias=False, use_scale=False, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)

    def loss_fn(model, x):
        out = model(x)
        return jnp.mean(out), out

    _, outs = nnx.jit(nnx_train_step(loss_fn, 2, has_aux=True))(model, optimizer, x)
    np.testing.assert_allclose(outs, 0.0, atol=1e-5)
    # Running mean: two momentum steps, 0 then 10: 0.99 * (0.01 * 0) + 0.01 * 10.
    np.testing.assert_allclose(model.mean[...], 0.1, rtol=1e-5)


# ------------------------------------------------------------------ linen


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))
        return nn.Dense(2)(x)


class TrainState(train_state.TrainState):
    batch_stats: Any


def _linen_setup():
    net = LinenNet()
    variables = net.init(jax.random.key(0), jnp.ones((2, 3)), train=False)
    return net, TrainState.create(
        apply_fn=net.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=optax.adam(1e-2),
    )


def _linen_loss(net):
    def loss_fn(params, batch_stats, rng, x, y):
        logits, updates = net.apply(
            {"params": params, "batch_stats": batch_stats},
            x,
            mutable=["batch_stats"],
            rngs={"dropout": rng},
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.mean(ce), updates["batch_stats"]

    return loss_fn


def test_linen_step_equals_explicit_loop():
    x, y = _data()
    net, state = _linen_setup()
    loss_fn = _linen_loss(net)
    step = jax.jit(linen_train_step(loss_fn, K))
    rng = jax.random.key(3)

    @jax.jit
    def ref_step(state, x, y, rng):
        stats, grads, losses = state.batch_stats, [], []
        for i in range(K):
            (loss, stats), g = jax.value_and_grad(loss_fn, has_aux=True)(
                state.params,
                stats,
                jax.random.fold_in(rng, i),
                _micro(x, i),
                _micro(y, i),
            )
            grads.append(g)
            losses.append(loss)
        mean = jax.tree.map(lambda *g: sum(g) / K, *grads)
        return state.apply_gradients(grads=mean, batch_stats=stats), sum(losses) / K

    ref_state = state
    for s in range(2):
        key = jax.random.fold_in(rng, s)
        state, loss = step(state, x, y, rng=key)
        ref_state, ref_loss = ref_step(ref_state, x, y, key)
        _close(loss, ref_loss)
    _close((state.params, state.batch_stats), (ref_state.params, ref_state.batch_stats))
    assert int(state.step) == 2
    assert not np.allclose(state.batch_stats["BatchNorm_0"]["mean"], 0.0)


def test_linen_dropout_key_changes_the_result():
    x, y = _data()
    net, state = _linen_setup()
    step = jax.jit(linen_train_step(_linen_loss(net), K))
    _, a = step(state, x, y, rng=jax.random.key(0))
    _, b = step(state, x, y, rng=jax.random.key(1))
    assert float(a) != float(b)
