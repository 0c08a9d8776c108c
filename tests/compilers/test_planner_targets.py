# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`plan_fused_step` and `plan_microbatch` with ``target=``: the pick is the
largest candidate whose peak, compiled for that target by `compile_for` on
its own, fits; the planned bytes are those bytes."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, reshard
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _targets

from .conftest import require

TARGET = 256
PARAMS = {"w1": jnp.zeros((128, 512)), "w2": jnp.zeros((512, 16))}
EXAMPLE = {"x": jnp.zeros(128), "y": jnp.zeros([], jnp.int32)}
TX = optax.adamw(1e-3)


def _loss(params, batch):
    logits = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _fused_step(loss, tx):
    """``k -> step``: `microbatch` over ``loss``'s value and gradient, then
    ``tx``'s update."""

    def make_step(k):
        grad_fn = optax_accum.microbatch(jax.value_and_grad(loss), k)

        def step(params, opt_state, batch):
            value, grads = grad_fn(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        return step

    return make_step


_make_step = _fused_step(_loss, TX)


def _batch(rows):
    return {
        "x": jax.ShapeDtypeStruct((rows, 128), jnp.float32),
        "y": jax.ShapeDtypeStruct((rows,), jnp.int32),
    }


@functools.cache
def _peak(target, m):
    """The fused step at micro-batch ``m``, compiled for ``target`` on its own."""
    compiled = _targets.compile_for(
        _make_step(TARGET // m), PARAMS, TX.init(PARAMS), _batch(TARGET),
        target=target, specs=(None, None, P("data")),
    )  # fmt: skip
    return compiled.memory().peak


@pytest.mark.parametrize("target", ["h100", "v5e"])
def test_the_pick_is_the_largest_size_whose_compiled_peak_fits(target):
    require(target)
    fits, over = _peak(target, 32), _peak(target, 64)
    assert fits < over, (fits, over)
    # At most 128: XLA:TPU compiles the step without its micro-batch loop at
    # k = 1 (256), which needs less than k = 2 here.
    plan = optax_accum.plan_fused_step(
        _make_step, PARAMS, TX.init(PARAMS), EXAMPLE, TARGET,
        memory_budget=(fits + over) // 2, max_microbatch_size=128, target=target,
    )  # fmt: skip
    assert (plan.microbatch_size, plan.num_microbatches) == (32, TARGET // 32)
    assert plan.next_microbatch_size == 64
    # The planned bytes are the target-compiled bytes, not the CPU's.
    assert (plan.memory_bytes, plan.next_memory_bytes) == (fits, over)
    assert plan.compiler == _targets.compiler(target)


def test_an_offloaded_state_stays_in_host_memory_on_the_target():
    """`offload`'s state is lowered in host memory for XLA:GPU, whose memory
    analysis then splits it off; the plan's bytes are `compile_for`'s."""
    require("h100")
    tx = optax_accum.accumulate(optax_accum.offload(optax.adamw(1e-3)), every_k=4)
    opt_state = tx.init(PARAMS)

    def step(params, opt_state, batch):
        grads = jax.grad(_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    plan = optax_accum.plan_microbatch(
        step, PARAMS, opt_state, EXAMPLE, 64, max_microbatch_size=16, target="h100"
    )
    kinds = jax.tree.map(
        lambda x: "pinned_host" if x.sharding.memory_kind == "pinned_host" else None,
        opt_state,
    )
    compiled = _targets.compile_for(
        step, PARAMS, opt_state, _batch(16), target="h100",
        memory_kinds=(None, kinds, None),
    )  # fmt: skip
    host = [x for x in jax.tree.leaves(opt_state) if x.sharding.memory_kind != "device"]
    adam = sum(x.nbytes for x in host)  # mu, nu and the count
    assert adam > 2 * sum(x.nbytes for x in jax.tree.leaves(PARAMS))
    assert plan.microbatch_size == 16
    assert plan.memory_bytes == compiled.memory().peak
    assert plan.offloaded_bytes == adam
    assert plan.memory_note == "memory_analysis splits host memory off"
    stats = compiled.program.get_compiled_memory_stats()
    assert stats.host_argument_size_in_bytes == adam
    # The default budget is the H100's 80 GB, from its target description.
    assert plan.memory_budget == _targets.device_memory("h100") == 84_978_434_048


def test_a_budget_over_the_targets_memory_gives_both_numbers():
    require("v5e")
    with pytest.raises(ValueError, match=r"20,000,000,000 bytes .* 16,911,433,728"):
        optax_accum.plan_fused_step(
            _make_step, PARAMS, TX.init(PARAMS), EXAMPLE, TARGET,
            memory_budget=20_000_000_000, target="v5e",
        )  # fmt: skip


def _on_mesh(params, spec, mesh):
    return jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), spec))


def _specs(tree):
    return jax.tree.map(
        lambda x: x.sharding.spec if isinstance(x.sharding, NamedSharding) else P(),
        tree,
    )


def test_sharded_parameters_keep_their_layout_on_the_target():
    """Parameters sharded over 8 CPU devices of an Auto mesh (the step lets
    the compiler place its products): planned for 8 H100s on a mesh of that
    shape, each device holding its shard of them and of Adam's moments; a
    topology's devices plan as its name does."""
    require("h100x8")
    mesh = jax.make_mesh(
        (8,), ("data",), devices=jax.devices("cpu")[:8], axis_types=(AxisType.Auto,)
    )
    spec = {"w1": P(None, "data"), "w2": P("data", None)}
    params = _on_mesh(PARAMS, spec, mesh)
    opt_state = TX.init(params)
    plans = [
        optax_accum.plan_fused_step(
            _make_step,
            params,
            opt_state,
            EXAMPLE,
            TARGET,
            memory_budget=10**9,
            multiple_of=8,
            target=target,
        )
        for target in ("h100x8", _targets.target_devices("h100x8"))
    ]

    def peak(specs):
        compiled = _targets.compile_for(
            _make_step(1), params, opt_state, _batch(TARGET), target="h100x8",
            specs=(*specs, P("data")),
        )  # fmt: skip
        return compiled.memory().peak

    assert plans[0].microbatch_size == TARGET
    assert plans[0].memory_bytes == plans[1].memory_bytes
    assert plans[0].memory_bytes == peak((spec, _specs(opt_state))) < peak((None, None))


def _explicit_fsdp_step(tx):
    """An Explicit-mesh FSDP step: the loss gathers each weight with
    ``reshard`` (the mesh it reads is the one set while it is traced)."""

    def loss(params, batch):
        w1, w2 = (reshard(params[n], P()) for n in ("w1", "w2"))
        logits = jnp.tanh(batch["x"] @ w1) @ w2
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["y"]
        ).mean()

    return _fused_step(loss, tx)


@pytest.mark.parametrize("set_mesh", [False, True])
def test_an_explicit_step_that_reshards_is_planned_as_it_runs(set_mesh):
    """FSDP on an Explicit mesh (`jax.make_mesh`'s default), its loss
    gathering the weights with ``reshard``: the target's mesh has the
    parameters' axis types and is set while the step is traced, inside or
    outside the caller's ``jax.set_mesh``; the bytes are `compile_for`'s on
    that Explicit mesh."""
    require("h100x8")
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices("cpu")[:8])
    spec = {"w1": P("data", None), "w2": P("data", None)}
    params = _on_mesh(PARAMS, spec, mesh)
    opt_state = TX.init(params)
    make_step = _explicit_fsdp_step(TX)
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        plan = optax_accum.plan_fused_step(
            make_step, params, opt_state, EXAMPLE, TARGET, memory_budget=10**9,
            multiple_of=8, max_microbatch_size=64, target="h100x8",
        )  # fmt: skip
    compiled = _targets.compile_for(
        make_step(TARGET // 64), params, opt_state, _batch(TARGET),
        target="h100x8", specs=(spec, _specs(opt_state), P("data")),
        axis_types=(AxisType.Explicit,),
    )  # fmt: skip
    assert plan.microbatch_size == 64
    assert plan.memory_bytes == compiled.memory().peak
    # The same step runs on this machine's Explicit mesh: it is not a
    # program only the planner accepts.
    rows = NamedSharding(mesh, P("data"))
    batch = jax.tree.map(
        lambda s: jax.device_put(np.zeros(s.shape, s.dtype), rows), _batch(TARGET)
    )
    with jax.set_mesh(mesh):
        jax.jit(make_step(4))(params, opt_state, batch)


def test_tensor_parallel_shards_the_batch_over_its_data_axes_only():
    """A ("data", "model") Explicit mesh, Megatron's column-then-row split
    over "model": with ``data_axes="data"`` the batch is split over 2 devices
    (``multiple_of`` 2 is enough) and the step type-checks; sharding it over
    both axes does not, and the error says to name the data axes alone."""
    require("h100x8")
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices("cpu")[:8])
    spec = {"w1": P(None, "model"), "w2": P("model", None)}
    params = _on_mesh(PARAMS, spec, mesh)
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)

    def loss(params, batch):
        h = jnp.tanh(batch["x"] @ params["w1"])
        logits = jnp.einsum("bh,hc->bc", h, params["w2"], out_sharding=P("data"))
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["y"]
        ).mean()

    make_step = _fused_step(loss, tx)

    plan = optax_accum.plan_fused_step(
        make_step, params, opt_state, EXAMPLE, TARGET, memory_budget=10**9,
        multiple_of=2, max_microbatch_size=64, target="h100x8", data_axes="data",
    )  # fmt: skip
    compiled = _targets.compile_for(
        make_step(TARGET // 64), params, opt_state, _batch(TARGET),
        target="h100x8", axis_names=("data", "model"), mesh_shape=(2, 4),
        specs=(spec, _specs(opt_state), P("data")),
        axis_types=(AxisType.Explicit,) * 2,
    )  # fmt: skip
    assert plan.microbatch_size == 64
    assert plan.memory_bytes == compiled.memory().peak
    with pytest.raises(
        ValueError, match=r"(?s)rows sharded over \('data', 'model'\).*`data_axes=`"
    ):
        optax_accum.plan_fused_step(
            make_step, params, opt_state, EXAMPLE, TARGET, memory_budget=10**9,
            multiple_of=8, target="h100x8", data_axes=("data", "model"),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"\('data',\) \(2 devices\).*got 1"):
        optax_accum.plan_fused_step(
            make_step, params, opt_state, EXAMPLE, TARGET, memory_budget=10**9,
            target="h100x8", data_axes="data",
        )  # fmt: skip


def test_a_size_xla_tpu_refuses_to_compile_does_not_fit():
    """XLA:TPU refuses a program larger than the chip (RESOURCE_EXHAUSTED):
    the planner counts it as over the budget, at the bytes the error names."""
    require("v5e")

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    w, example = jax.ShapeDtypeStruct((256, 4096), jnp.float32), jnp.zeros(256)
    plan = optax_accum.plan_microbatch(
        jax.value_and_grad(loss), w, None, example, 2**20, target="v5e",
        multiple_of=2**14,
    )  # fmt: skip
    assert plan.memory_budget == 63 * 2**28  # the 15.75 GiB XLA:TPU offers
    assert plan.memory_bytes <= plan.memory_budget < plan.next_memory_bytes
    batch = jax.ShapeDtypeStruct((plan.next_microbatch_size, 256), jnp.float32)
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        _targets.compile_for(jax.value_and_grad(loss), w, batch, target="v5e")


def test_a_restore_target_on_an_abstract_mesh_plans_for_the_target():
    """HSDP parameters and Adam's state from ``jax.eval_shape`` under
    ``jax.set_mesh`` (an Orbax restore target, on an abstract mesh): planned
    for 8 H100s as the arrays are, at `compile_for`'s bytes."""
    require("h100x8")
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), devices=jax.devices("cpu")[:8])
    spec = {"w1": P("fsdp", None), "w2": P("fsdp", None)}
    make_step = _explicit_fsdp_step(TX)

    def init():
        return {n: jnp.zeros(PARAMS[n].shape, out_sharding=spec[n]) for n in spec}

    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(init)
        abstract_state = jax.eval_shape(TX.init, abstract)
        params = jax.jit(init)()
        opt_state = jax.jit(TX.init)(params)
    kwargs = {"memory_budget": 10**9, "multiple_of": 8, "max_microbatch_size": 64}
    plans = [
        optax_accum.plan_fused_step(
            make_step,
            p,
            s,
            EXAMPLE,
            TARGET,
            target="h100x8",
            data_axes=("data", "fsdp"),
            **kwargs,
        )
        for p, s in ((abstract, abstract_state), (params, opt_state))
    ]
    compiled = _targets.compile_for(
        make_step(TARGET // 64), params, opt_state, _batch(TARGET),
        target="h100x8", axis_names=("data", "fsdp"), mesh_shape=(2, 4),
        specs=(spec, _specs(opt_state), P(("data", "fsdp"))),
        axis_types=(AxisType.Explicit,) * 2,
    )  # fmt: skip
    assert plans[0] == plans[1]
    assert plans[0].memory_bytes == compiled.memory().peak


@pytest.mark.parametrize("set_mesh", [False, True])
def test_an_auto_step_with_bare_partition_specs_reads_the_targets_mesh(set_mesh):
    """An Auto-mesh step that constrains its activations with a bare
    ``PartitionSpec`` reads the mesh that is set: the target's while it is
    traced, inside or outside the caller's ``jax.set_mesh`` (whose CPU
    devices the target's program cannot use)."""
    require("v5e:2x4")
    mesh = jax.make_mesh(
        (8,), ("data",), devices=jax.devices("cpu")[:8], axis_types=(AxisType.Auto,)
    )
    params = _on_mesh(PARAMS, {"w1": P(), "w2": P()}, mesh)
    opt_state = TX.init(params)

    def loss(params, batch):
        h = jax.lax.with_sharding_constraint(
            jnp.tanh(batch["x"] @ params["w1"]), P("data")
        )
        logits = h @ params["w2"]
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["y"]
        ).mean()

    make_step = _fused_step(loss, TX)

    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        plan = optax_accum.plan_fused_step(
            make_step, params, opt_state, EXAMPLE, TARGET, memory_budget=10**9,
            multiple_of=8, max_microbatch_size=64, target="v5e:2x4",
        )  # fmt: skip
    compiled = _targets.compile_for(
        make_step(TARGET // 64), params, opt_state, _batch(TARGET),
        target="v5e:2x4", specs=(None, None, P("data")),
    )  # fmt: skip
    assert plan.microbatch_size == 64
    assert plan.memory_bytes == compiled.memory().peak
