# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`plan_fused_step` and `plan_microbatch` with ``target=``: the pick is the
largest candidate whose peak, compiled for that target by `compile_for` on
its own, fits; the planned bytes are those bytes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
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


def _make_step(k):
    grad_fn = optax_accum.microbatch(jax.value_and_grad(_loss), k)

    def step(params, opt_state, batch):
        value, grads = grad_fn(params, batch)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


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


def test_sharded_parameters_keep_their_layout_on_the_target():
    """Parameters sharded over 8 CPU devices: planned for 8 H100s on a mesh
    of that shape, each device holding its shard of them and of Adam's
    moments; a topology's devices plan as its name does."""
    require("h100x8")
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices("cpu")[:8])
    spec = {"w1": P(None, "data"), "w2": P("data", None)}
    params = jax.device_put(
        PARAMS, jax.tree.map(lambda s: NamedSharding(mesh, s), spec)
    )
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
    state_specs = jax.tree.map(
        lambda x: x.sharding.spec if isinstance(x.sharding, NamedSharding) else P(),
        opt_state,
    )

    def peak(specs):
        compiled = _targets.compile_for(
            _make_step(1), params, opt_state, _batch(TARGET), target="h100x8",
            specs=(*specs, P("data")),
        )  # fmt: skip
        return compiled.memory().peak

    assert plans[0].microbatch_size == TARGET
    assert plans[0].memory_bytes == plans[1].memory_bytes
    assert plans[0].memory_bytes == peak((spec, state_specs)) < peak((None, None))


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
