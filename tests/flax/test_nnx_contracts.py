# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`nnx_train_step` keeps its optimizer's and its model's contracts.

Each test compares with an independent reference: a hand-written nnx step
(``nnx.grad`` over the full batch, or per micro-batch) or the model's state
before the step. Regression tests for issue 20 (defects 3, 7) and issue 23
(the Flax steps' contracts, items 1, 3, 4).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_accum  # noqa: E402
from optax_accum.flax import linen_train_step, nnx_train_step  # noqa: E402

K = 2
SOW_WARNING = "ignore:Using 'Module.sow\\(\\)' outside of 'nnx.capture\\(\\)'"


def _close(a, b):
    chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-6)


def _pure(tree):
    def array(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return np.asarray(jax.random.key_data(x))
        return np.asarray(x)

    return jax.tree.map(array, nnx.as_pure(tree))


def _x(n=8, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(n, 3)), jnp.float32)


# ------------------------------------------------- issue 23, item 1: `wrt`


class Lora(nnx.Variable):
    """A custom Variable type: the only one the optimizer trains."""


class Frozen(nnx.Module):
    """A frozen base layer, a trained head, a Lora delta and, for the
    ``float_params`` case, an int32 Param (a table)."""

    def __init__(self, trained: str):
        rngs = nnx.Rngs(0)
        self.base = nnx.Linear(3, 4, rngs=rngs)
        self.head = nnx.Linear(4, 1, rngs=rngs)
        self.delta = Lora(jnp.full((4,), 0.1))
        table = nnx.Param(jnp.arange(4, dtype=jnp.int32))
        self.table = nnx.data(table if trained == "float_params" else None)

    def __call__(self, x):
        h = jnp.tanh(self.base(x)) * (1.0 + self.delta[...])
        if self.table is not None:
            h = h + self.table[...].astype(h.dtype)
        return self.head(h)


def _frozen_loss(model, x):
    return jnp.mean((model(x) - 1.0) ** 2)


WRT = {
    # a custom Variable subclass
    "lora": Lora,
    # Params but the int32 table
    "float_params": nnx.All(nnx.Param, nnx.Not(nnx.PathContains("table"))),
    # frozen base: only the head trains
    "head": nnx.All(nnx.Param, nnx.PathContains("head")),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WRT))
def test_nnx_train_step_differentiates_what_the_optimizer_trains(name):
    wrt = WRT[name]
    x = _x()
    model = Frozen(name)
    opt = nnx.Optimizer(model, optax.adam(0.05), wrt=wrt)
    ref = Frozen(name)
    ref_opt = nnx.Optimizer(ref, optax.adam(0.05), wrt=wrt)

    @nnx.jit
    def ref_step(model, opt, x):
        grad_fn = nnx.value_and_grad(_frozen_loss, argnums=nnx.DiffState(0, wrt))
        loss, grads = grad_fn(model, x)
        opt.update(model, grads)
        return loss

    step = nnx.jit(nnx_train_step(_frozen_loss, K))
    for _ in range(2):
        _close(step(model, opt, x), ref_step(ref, ref_opt, x))
    _close(_pure(nnx.state(model)), _pure(nnx.state(ref)))
    _close(_pure(opt.opt_state), _pure(ref_opt.opt_state))


def test_nnx_noise_scale_counts_only_the_trained_parameters():
    # The reference: `microbatch` on a function of the head's parameters alone.
    wrt = WRT["head"]
    x = _x(16)
    model = Frozen("head")
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=wrt)
    step = nnx.jit(nnx_train_step(_frozen_loss, K, noise_scale_decay=0.5))
    graphdef, head, rest = nnx.split(Frozen("head"), wrt, ...)

    def head_loss(head, x):
        return _frozen_loss(nnx.merge(graphdef, head, rest), x)

    fun = optax_accum.microbatch(
        jax.value_and_grad(head_loss), K, noise_scale_decay=0.5
    )
    (_, grads), ref = jax.jit(fun)(head, x)
    _, tracker = step(model, opt, x, noise_scale=None)
    _close(tracker, ref)
    _close(
        _pure(nnx.state(model, wrt)),
        _pure(jax.tree.map(lambda p, g: p - 0.1 * g, head, grads)),
    )


# ----------------------------------- issue 20, defect 3: dropout per device


class DropNet(nnx.Module):
    def __init__(self, key):
        self.w = nnx.Param(jnp.ones((3,)))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=key))

    def __call__(self, x):
        return self.drop(x) * self.w[...]


def _drop_loss(model, x):
    return jnp.mean(model(x))


@pytest.mark.slow
def test_nnx_data_axes_draws_its_own_dropout_mask_on_each_device():
    # Documented: on device d of the data axes the model's Rngs keys are
    # folded with d. Reference: device d's draws, one per micro-batch, from
    # the model's Dropout with its key so folded, on the device's rows.
    n_dev, rows, key = 8, 32, jax.random.key(7)
    x = jnp.ones((rows, 3))
    mesh = jax.make_mesh((n_dev,), ("data",))
    with jax.set_mesh(mesh):
        model = DropNet(key)
        opt = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)
        step = nnx.jit(nnx_train_step(_drop_loss, K, data_axes="data"))
        loss = step(model, opt, jax.device_put(x, P("data")))
    draws = []
    for d in range(n_dev):
        drop = DropNet(key).drop
        drop.rngs.key[...] = jax.random.fold_in(drop.rngs.key[...], d)
        draws.append([np.asarray(drop(x[: rows // n_dev // K])) for _ in range(K)])
    draws = np.asarray(draws)  # (device, micro-batch, rows, 3)
    assert len({d.tobytes() for d in draws}) == n_dev  # every device its own
    grad = draws.mean(axis=(0, 1, 2)) / 3  # d mean(drop(x) * w) / dw
    np.testing.assert_allclose(np.asarray(model.w[...]), 1.0 - grad, rtol=1e-6)
    np.testing.assert_allclose(float(loss), draws.mean(), rtol=1e-6)
    assert int(model.drop.rngs.count[...]) == K
    unchanged = DropNet(key).drop.rngs.key[...]
    assert jax.random.key_data(model.drop.rngs.key[...]).tolist() == (
        jax.random.key_data(unchanged).tolist()
    )


# ------------------------------ issue 20, defect 7: fp16 overflow, BatchNorm


class BnNet(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0, dropout=1)
        self.l1 = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.5, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(self.bn(self.l1(x))))


def _bn_loss(model, x):
    return jnp.mean(model(x) ** 2)


def test_nnx_overflowing_step_leaves_batchnorm_statistics_alone():
    jmp = pytest.importorskip("jmp")
    model = BnNet()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = nnx_train_step(_bn_loss, K, loss_scaling=True)

    @nnx.jit
    def train(model, opt, x, scale):
        loss_scale = jmp.DynamicLossScale(scale, jnp.int32(0))
        _, loss_scale = step(model, opt, x, loss_scale=loss_scale)
        return loss_scale.loss_scale

    before = _pure(nnx.state((model, opt)))
    bad = _x().at[1].set(1e38)  # micro-batch 1 overflows
    assert float(train(model, opt, bad, jnp.float32(2.0**15))) == 2.0**14
    chex.assert_trees_all_equal(_pure(nnx.state((model, opt))), before)
    # A clean step moves them, and counts one update.
    train(model, opt, _x(), jnp.float32(2.0**15))
    assert not np.allclose(model.bn.mean[...], before[0]["bn"]["mean"])
    assert int(opt.step[...]) == 1 and int(model.drop.rngs.count[...]) == K


# -------------------------- issue 23, item 3: self.sow(nnx.Intermediate, ...)


class Sower(nnx.Module):
    def __init__(self):
        self.l = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    def __call__(self, x):
        h = self.l(x)
        self.sow(nnx.Intermediate, "h", h)
        return h


def _sow_loss(model, x):
    return jnp.mean(model(x) ** 2)


@pytest.mark.filterwarnings(SOW_WARNING)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_nnx_sown_intermediates_come_back_stacked_per_micro_batch(k):
    x = _x()
    model = Sower()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ref = Sower()
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    expected = np.stack([np.asarray(ref.l(x[i::k])) for i in range(k)])

    @nnx.jit
    def ref_step(model, opt, x):
        loss, grads = nnx.value_and_grad(_sow_loss)(model, x)
        opt.update(model, grads)
        return loss

    step = nnx.jit(nnx_train_step(_sow_loss, k))
    _close(step(model, opt, x), ref_step(ref, ref_opt, x))
    (h,) = nnx.pop(model, nnx.Intermediate)["h"].get_value()
    _close(h, expected)
    nnx.pop(ref, nnx.Intermediate)
    _close(_pure(nnx.state(model)), _pure(nnx.state(ref)))
    # A model still holding the last step's values is refused, with the fix.
    step(model, opt, x)
    with pytest.raises(ValueError, match=r"nnx\.pop\(model, nnx\.Intermediate\)"):
        step(model, opt, x)


# ------------------------------------ issue 23, item 4: the public function


@pytest.mark.parametrize("helper", [nnx_train_step, linen_train_step])
def test_a_misspelt_keyword_names_the_public_function(helper):
    name = helper.__name__
    with pytest.raises(
        TypeError, match=rf"{name}\(\) got an unexpected keyword argument `reductoin`"
    ):
        helper(_drop_loss, K, reductoin="sum")
