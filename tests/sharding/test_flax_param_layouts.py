# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The Flax helpers and `nnx.Optimizer` with sharded parameters.

nnx models carry sharding metadata (``nnx.with_partitioning``) and are built
under ``jax.set_mesh``: tensor parallel and FSDP on Explicit meshes; linen
TrainStates with FSDP / tensor-parallel parameters on an Auto mesh.
"""

from __future__ import annotations

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
from jax.sharding import AxisType, NamedSharding, reshard  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_accum  # noqa: E402
from optax_accum.flax import linen_train_step, nnx_train_step  # noqa: E402
from tests.helpers.lanes import sweep  # noqa: E402

K, ROWS = 4, 32
LAYOUTS = {
    # mesh shape, axes, kernel partitioning of l1 / l2, rows' axes
    "tp": ((4, 2), ("data", "model"), (None, "model"), ("model", None), "data"),
    "fsdp": ((8,), ("data",), ("data", None), ("data", None), "data"),
    "hsdp": (
        (2, 4),
        ("data", "fsdp"),
        ("fsdp", None),
        ("fsdp", None),
        ("data", "fsdp"),
    ),
}


class Mlp(nnx.Module):
    """Two layers; on a mesh, weights are used the way their layout needs."""

    def __init__(self, part1, part2, rows, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        on_mesh = not jax.sharding.get_abstract_mesh().empty
        init1 = nnx.with_partitioning(init, part1) if on_mesh else init
        init2 = nnx.with_partitioning(init, part2) if on_mesh else init
        self.w1 = nnx.Param(init1(rngs.params(), (8, 16)))
        self.w2 = nnx.Param(init2(rngs.params(), (16, 8)))
        self.tp = part1 == (None, "model")
        self.rows = rows

    def __call__(self, x):
        w1, w2 = self.w1[...], self.w2[...]
        if jax.sharding.get_abstract_mesh().empty:
            return jnp.tanh(x @ w1) @ w2
        if self.tp:  # tensor parallel: keep the weights sharded
            h = jnp.tanh(x @ w1)
            return jnp.matmul(h, w2, out_sharding=P(self.rows, None))
        # FSDP: gather each weight where it is used
        return jnp.tanh(x @ reshard(w1, P())) @ reshard(w2, P())


def _loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _data():
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.normal(size=(ROWS, 8)), jnp.float32),
        jnp.asarray(rng.normal(size=(ROWS, 8)), jnp.float32),
    )


def _reference(layout, steps):
    _, _, p1, p2, rows = LAYOUTS[layout]
    model = Mlp(p1, p2, rows, nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x, y = _data()
    for _ in range(steps):
        grads = nnx.grad(_loss)(model, x, y)
        opt.update(model, grads)
    return _weights(model)


def _weights(model):
    return {"w1": np.asarray(model.w1[...]), "w2": np.asarray(model.w2[...])}


@pytest.mark.parametrize("layout", sweep(LAYOUTS, fast=["hsdp"]))
def test_nnx_train_step_on_explicit_mesh(layout):
    shape, axes, p1, p2, rows = LAYOUTS[layout]
    mesh = jax.make_mesh(shape, axes)
    x, y = _data()
    with jax.set_mesh(mesh):
        model = Mlp(p1, p2, rows, nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        step = nnx.jit(nnx_train_step(_loss, K))
        xs, ys = (jax.device_put(a, P(rows)) for a in (x, y))
        for _ in range(2):
            step(model, opt, xs, ys)
        assert model.w1[...].sharding.spec == P(*p1)
        assert opt.opt_state[0].mu["w1"][...].sharding.spec == P(*p1)
    chex.assert_trees_all_close(
        _weights(model),
        _reference(layout, 2),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", sweep(LAYOUTS, fast=["tp"]))
def test_nnx_optimizer_with_accumulate_on_explicit_mesh(layout):
    shape, axes, p1, p2, rows = LAYOUTS[layout]
    mesh = jax.make_mesh(shape, axes)
    x, y = _data()
    with jax.set_mesh(mesh):
        model = Mlp(p1, p2, rows, nnx.Rngs(0))
        tx = optax_accum.accumulate(optax.adam(1e-2), K)
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, x, y):
            opt.update(model, nnx.grad(_loss)(model, x, y))

        for _ in range(2):
            for i in range(K):
                xs, ys = (jax.device_put(a[i::K], P(rows)) for a in (x, y))
                step(model, opt, xs, ys)
        acc = opt.opt_state.accumulator
        assert acc["w1"][...].sharding.spec == P(*p1)
        assert acc["w2"][...].sharding.spec == P(*p2)
    chex.assert_trees_all_close(
        _weights(model),
        _reference(layout, 2),
        rtol=1e-5,
        atol=1e-6,
    )


class LinenMlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, use_bias=False)(jnp.tanh(nn.Dense(16, use_bias=False)(x)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "specs", [(P(None, "model"), P("model", None)), (P("data", None), P("data", None))]
)
def test_linen_train_step_on_auto_mesh(specs):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    net = LinenMlp()
    x, y = _data()
    params = net.init(jax.random.key(0), x)["params"]

    def loss_fn(params, batch_stats, rng, x, y):
        del batch_stats, rng
        return jnp.mean((net.apply({"params": params}, x) - y) ** 2), {}

    class State(train_state.TrainState):
        batch_stats: dict

    def make(params):
        return State.create(
            apply_fn=net.apply, params=params, batch_stats={}, tx=optax.adam(1e-2)
        )

    ref = make(params)
    for _ in range(2):
        ref = ref.apply_gradients(
            grads=jax.grad(lambda p: loss_fn(p, {}, None, x, y)[0])(ref.params)
        )
    with jax.set_mesh(mesh):
        placed = {
            "Dense_0": {
                "kernel": jax.device_put(
                    params["Dense_0"]["kernel"], NamedSharding(mesh, specs[0])
                )
            },
            "Dense_1": {
                "kernel": jax.device_put(
                    params["Dense_1"]["kernel"], NamedSharding(mesh, specs[1])
                )
            },
        }
        state = make(placed)
        step = jax.jit(linen_train_step(loss_fn, K))
        xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
        for _ in range(2):
            state, _ = step(state, xs, ys)
    kernel = state.params["Dense_0"]["kernel"]
    assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, specs[0]), 2)
    chex.assert_trees_all_close(
        jax.device_get(state.params), ref.params, rtol=1e-5, atol=1e-6
    )


class EmbedNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.emb = nnx.Embed(16, 8, rngs=rngs)
        self.out = nnx.Linear(8, 16, rngs=rngs)

    def __call__(self, ids):
        return self.out(self.emb(ids))


def _embed_loss(model, ids, y):
    logits = model(ids)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return ce.mean(), {"logits_mean": logits.mean(), "ce": ce}


@pytest.mark.slow
def test_nnx_embed_has_aux_device_local_on_explicit_mesh():
    # An nnx.Embed lookup cannot run on a whole sharded micro-batch under an
    # Explicit mesh; device-local, it can. The aux layout must be found
    # without calling the loss outside the device-local context.
    ids = jnp.arange(64) % 16
    y = (jnp.arange(64) * 3) % 16
    ref_model = EmbedNet(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref_model, optax.sgd(0.1), wrt=nnx.Param)
    ref_loss, ref_aux = nnx.jit(nnx_train_step(_embed_loss, K, has_aux=True))(
        ref_model, ref_opt, ids, y
    )
    mesh = jax.make_mesh((8,), ("data",))
    with jax.set_mesh(mesh):
        model = EmbedNet(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        step = nnx.jit(
            nnx_train_step(
                _embed_loss,
                K,
                has_aux=True,
                data_axes="data",
                aux_rows={"ce": True, "logits_mean": False},
            )
        )
        loss, aux = step(model, opt, *(jax.device_put(a, P("data")) for a in (ids, y)))
    assert aux["ce"].shape == (K, 64 // K) and aux["logits_mean"].shape == (K,)
    chex.assert_trees_all_close(
        jax.device_get((loss, aux)), (ref_loss, ref_aux), rtol=1e-5, atol=1e-6
    )
    chex.assert_trees_all_close(
        np.asarray(model.out.kernel[...]),
        np.asarray(ref_model.out.kernel[...]),
        rtol=1e-5,
        atol=1e-6,
    )


class FrozenBase(nnx.Module):
    """A frozen base layer and a trained head (the optimizer's `wrt`)."""

    def __init__(self, rngs: nnx.Rngs):
        self.base = nnx.Linear(8, 16, rngs=rngs)
        self.head = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.base(x)))


def test_nnx_train_step_trains_only_wrt_per_device():
    # With `data_axes` the frozen Params enter the device-local loop as
    # inputs; the reference differentiates `wrt` alone over the full batch.
    wrt = nnx.All(nnx.Param, nnx.PathContains("head"))
    x, y = _data()
    ref = FrozenBase(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=wrt)

    @nnx.jit
    def ref_step(model, opt, x, y):
        opt.update(model, nnx.grad(_loss, argnums=nnx.DiffState(0, wrt))(model, x, y))

    for _ in range(2):
        ref_step(ref, ref_opt, x, y)
    with jax.set_mesh(jax.make_mesh((8,), ("data",))):
        model = FrozenBase(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=wrt)
        step = nnx.jit(nnx_train_step(_loss, K, data_axes="data"))
        xs, ys = (jax.device_put(a, P("data")) for a in (x, y))
        for _ in range(2):
            step(model, opt, xs, ys)
    chex.assert_trees_all_close(
        jax.device_get(nnx.as_pure(nnx.state(model, nnx.Param))),
        nnx.as_pure(nnx.state(ref, nnx.Param)),
        rtol=1e-5,
        atol=1e-6,
    )
