# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Tests for `optax_accum.flax`: nnx and linen fused steps vs explicit loops.

Also: the steps forward optimizer extra args (``reduce_on_plateau`` gets the
window's loss as ``value``), `linen_train_step` takes a plain ``TrainState``
(no ``batch_stats``), and both helpers check their arguments when built.
"""

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

import optax_accum  # noqa: E402
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

    steps = 2
    for _ in range(steps):
        loss = step(model, optimizer, x, y)
        ref_loss = ref_step(ref_model, ref_optimizer, x, y)
        _close(loss, ref_loss)
    # `l1.bias` feeds a BatchNorm, so its exact gradient is 0: Adam turns the
    # float32 rounding of either side into steps of up to the learning rate
    # (issue 33, section 4). That leaf gets a tolerance scaled to lr * steps;
    # every other leaf is held to the usual fp32 tolerance.
    state, ref_state = nnx.state(model), nnx.state(ref_model)
    bias, ref_bias = state["l1"]["bias"][...], ref_state["l1"]["bias"][...]
    np.testing.assert_allclose(bias, ref_bias, rtol=0, atol=1e-2 * steps)
    state["l1"]["bias"][...] = ref_bias
    _close(state, ref_state)
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


# ------------------------------------------- extra args, plain TrainState

STEPS = 6


def _regression_data(seed=0, n=K * 4):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(n, 1)) * 3 + 5 * rng.normal(size=(n, 1)) ** 2)
    return x, y.astype(jnp.float32)


def _plateau():
    return optax.chain(
        optax.sgd(0.5),
        optax.contrib.reduce_on_plateau(factor=0.5, patience=1, accumulation_size=1),
    )


def _nnx_mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _nnx_plateau_large_batch(x, y):
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, _plateau(), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(_nnx_mse)(model, x, y)
        opt.update(model, grads, value=loss)

    for _ in range(STEPS):
        step(model, opt, x, y)
    return nnx.state(model, nnx.Param)


@pytest.mark.parametrize("explicit", [False, True])
def test_nnx_train_step_feeds_reduce_on_plateau(explicit):
    x, y = _regression_data()
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, _plateau(), wrt=nnx.Param)
    step = nnx.jit(nnx_train_step(_nnx_mse, K))
    for _ in range(STEPS):
        if explicit:  # the large-batch loss, computed by the caller
            step(model, opt, x, y, value=_nnx_mse(model, x, y))
        else:  # the step passes its own loss, the mean over the k micro-batches
            step(model, opt, x, y)
    chex.assert_trees_all_close(
        nnx.state(model, nnx.Param),
        _nnx_plateau_large_batch(x, y),
        rtol=1e-5,
        atol=1e-6,
    )


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(x)


def _plain_state(tx):
    net = _Dense()
    params = net.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    return train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)


def _linen_mse(params, rng, x, y):
    del rng
    return jnp.mean((_Dense().apply({"params": params}, x) - y) ** 2)


@pytest.mark.slow
@pytest.mark.parametrize("plateau", [False, True])
def test_linen_train_step_takes_a_plain_train_state(plateau):
    x, y = _regression_data(1)
    make = _plateau if plateau else (lambda: optax.adam(0.05))
    state = _plain_state(make())
    step = jax.jit(linen_train_step(_linen_mse, K))
    ref = _plain_state(make())
    for _ in range(STEPS):
        state, loss = step(state, x, y)
        value, grads = jax.value_and_grad(_linen_mse)(ref.params, None, x, y)
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


# ------------------------------------------------------------ construction


@pytest.mark.parametrize(
    ("k", "error", "match"),
    [
        (0, ValueError, "`num_microbatches` must be >= 1, got 0"),
        (2.0, TypeError, "`num_microbatches` must be an integer, got 2.0"),
    ],
)
def test_flax_helpers_validate_at_construction(k, error, match):
    loss = lambda *a: 0.0
    for helper in (nnx_train_step, linen_train_step):
        with pytest.raises(error, match=match):
            helper(loss, k)
    with pytest.raises(ValueError, match="`reduction` must be one of"):
        nnx_train_step(loss, 2, reduction="avg")
    with pytest.raises(TypeError, match="`batch_argnums` is set by nnx_train_step"):
        nnx_train_step(loss, 2, batch_argnums=1)


# ------------------------------------------------ aux in the batch's row order


def _tutorial_loss(model, batch):
    # The Flax NNX MNIST tutorial's loss_fn: it returns the logits as aux.
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return loss.mean(), logits


def test_nnx_aux_order_batch_feeds_the_tutorials_metrics_line():
    x, y = _data(24)
    batch = {"image": x, "label": y}
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    want_logits = model(x)  # the plain per-row output, before the update
    want = nnx.MultiMetric(
        accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss")
    )
    want.update(loss=_tutorial_loss(model, batch)[0], logits=want_logits, labels=y)

    step = nnx.jit(nnx_train_step(_tutorial_loss, K, has_aux=True, aux_order="batch"))
    loss, logits = step(model, optimizer, batch)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-6)
    metrics = nnx.MultiMetric(
        accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss")
    )
    metrics.update(loss=loss, logits=logits, labels=batch["label"])  # as written
    _close(metrics.compute(), want.compute())
    # The default stays stacked per micro-batch, rows i::k.
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    _, stacked = nnx.jit(nnx_train_step(_tutorial_loss, K, has_aux=True))(
        model, optimizer, batch
    )
    assert stacked.shape == (K, 24 // K, 2)
    _close(stacked.swapaxes(0, 1).reshape(24, 2), want_logits)


def test_linen_aux_order_batch_equals_the_whole_batch_logits():
    x, y = _data(24)
    state = _plain_state(optax.sgd(0.1))

    def loss_fn(params, rng, x, y):
        logits = state.apply_fn({"params": params}, x)
        return jnp.mean((logits[:, 0] - y.astype(jnp.float32)) ** 2), logits

    step = jax.jit(linen_train_step(loss_fn, K, has_aux=True, aux_order="batch"))
    _, (_, logits) = step(state, x, y)
    want = state.apply_fn({"params": state.params}, x)
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------- call-time Rngs, as the tutorial has


class _CallRngsNet(nnx.Module):
    # As the Flax NNX MNIST tutorial's CNN: Dropout holds no Rngs, the model
    # takes them at call time.
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(3, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5)
        self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x, rngs):
        return self.l2(self.drop(nnx.relu(self.l1(x)), rngs=rngs))


def _rngs_loss(model, rngs, batch):
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return loss.mean(), logits


def _rngs_setup():
    model = _CallRngsNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    return model, optimizer, nnx.Rngs(dropout=5)


def test_nnx_step_takes_call_time_rngs_as_k_small_steps_would():
    x, y = _data()
    batch = {"image": x, "label": y}
    model, optimizer, rngs = _rngs_setup()
    step = nnx.jit(nnx_train_step(_rngs_loss, K, has_aux=True))
    ref_model, ref_optimizer, ref_rngs = _rngs_setup()

    @nnx.jit
    def ref_step(model, optimizer, rngs, batch):
        # K plain nnx steps' forward passes with the same Rngs, one update.
        grad_fn = nnx.value_and_grad(_rngs_loss, has_aux=True)
        losses, grads = [], []
        for i in range(K):
            (loss, _), g = grad_fn(
                model, rngs, jax.tree.map(lambda a, i=i: a[i::K], batch)
            )
            losses.append(loss)
            grads.append(g)
        optimizer.update(model, jax.tree.map(lambda *g: sum(g) / K, *grads))
        return sum(losses) / K

    for n in (1, 2):
        loss, _ = step(model, optimizer, rngs, batch)
        _close(loss, ref_step(ref_model, ref_optimizer, ref_rngs, batch))
        # The counter advanced as over K plain steps: one draw a micro-batch.
        assert int(rngs.dropout.count[...]) == int(ref_rngs.dropout.count[...])
        assert int(rngs.dropout.count[...]) == n * K
    _close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))


def test_nnx_step_refuses_rng_argnums_saying_what_to_pass():
    with pytest.raises(TypeError, match=r"no `rng_argnums`.*nnx\.Rngs.*step\(model"):
        nnx_train_step(_rngs_loss, K, rng_argnums=1)


@pytest.mark.filterwarnings(
    "ignore:Using 'Module.sow\\(\\)' outside of 'nnx.capture\\(\\)'"
)
def test_nnx_aux_order_batch_orders_sown_rows_as_aux():
    class Sowing(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.Linear(3, 2, rngs=rngs)

        def __call__(self, x):
            h = self.l(x)
            self.sow(nnx.Intermediate, "h", h)
            return h

    def loss_fn(model, x):
        h = model(x)
        return jnp.mean(h**2), h

    model = Sowing(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x = _data(24)[0]
    want = model.l(x)
    step = nnx.jit(nnx_train_step(loss_fn, K, has_aux=True, aux_order="batch"))
    _, aux = step(model, optimizer, x)
    (sown,) = jax.tree.leaves(nnx.pop(model, nnx.Intermediate))
    _close(aux, want)
    _close(sown, want)


def test_microbatch_refuses_an_nnx_rngs_saying_what_to_pass():
    # Before: "batch argument 1 has a scalar leaf at .default.count.value".
    grad_fn = optax_accum.microbatch(
        jax.value_and_grad(lambda w, rngs, x: jnp.mean(x * w)), 2, batch_argnums=2
    )
    with pytest.raises(TypeError, match=r"nnx Rngs.*`rng_argnums`.*nnx_train_step"):
        grad_fn(jnp.float32(1.0), nnx.Rngs(0), jnp.ones(4))
