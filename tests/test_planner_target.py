# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The planners' ``target=``: what they refuse before compiling anything.

These run without the ``compilers`` extra (a fake topology, or the plugins
hidden); tests/compilers/test_planner_targets.py compiles for the targets.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, reshard
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _targets
from optax_accum._planner import _compile


def _loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


STEP = jax.value_and_grad(_loss)
W, EXAMPLE = jnp.zeros((8, 16)), jnp.zeros(8)


def _plan(**kwargs):
    return optax_accum.plan_microbatch(STEP, W, None, EXAMPLE, 16, **kwargs)


def _v5e(n):
    """A fake topology of ``n`` TPU v5e chips (15.75 GiB each)."""
    chip = SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
    return SimpleNamespace(devices=[chip] * n)


@pytest.fixture
def fake_compiler(monkeypatch):
    monkeypatch.setattr(_targets, "compiler", lambda target: "XLA:TPU (fake)")


def test_the_plan_names_this_machines_compiler():
    plan = _plan(memory_budget=10**9)
    assert plan.compiler.startswith(f"XLA:{jax.devices()[0].platform.upper()} ")


def test_an_unknown_target_names_the_known_ones():
    with pytest.raises(
        ValueError, match=r"one of \['h100', 'h100x4', 'h100x8', 'v5e'.*'a100'"
    ):
        _plan(memory_budget=10**9, target="a100")
    with pytest.raises(ValueError, match=r"a topology or its devices, got 3"):
        _plan(memory_budget=10**9, target=3)


def test_a_missing_compiler_names_the_extra(monkeypatch):
    monkeypatch.setattr(_targets, "_find", lambda module: False)
    _targets._devices.cache_clear()
    try:
        for target in ("h100", "v5e"):
            with pytest.raises(ImportError, match=r"optax_accum\[compilers\]"):
                _plan(memory_budget=10**9, target=target)
            with pytest.raises(ImportError, match=r"optax_accum\[compilers\]"):
                optax_accum.plan_fused_step(
                    lambda k: optax_accum.microbatch(STEP, k), W, None, EXAMPLE, 16,
                    target=target,
                )  # fmt: skip
    finally:
        _targets._devices.cache_clear()


def test_a_budget_over_the_targets_memory_gives_both_numbers(fake_compiler):
    with pytest.raises(ValueError, match=r"20,000,000,000 bytes .* 16,911,433,728"):
        _plan(memory_budget=20_000_000_000, target=_v5e(1))


def test_device_and_target_are_one_or_the_other():
    with pytest.raises(ValueError, match=r"`device`.*`target`.*not both"):
        _plan(memory_budget=10**9, device=jax.devices()[0], target="v5e")


def test_the_batch_must_split_over_the_targets_devices(fake_compiler):
    match = r"\(.data.,\) \(4 devices\): `multiple_of` .* of 4, got 2"
    with pytest.raises(ValueError, match=match):
        _plan(memory_budget=10**9, target=_v5e(4), multiple_of=2)


def test_a_topology_of_unknown_memory_needs_a_budget(fake_compiler):
    chip = SimpleNamespace(platform="tpu", device_kind="TPU v9")
    with pytest.raises(ValueError, match="`memory_budget` is required for `target`"):
        _plan(target=[chip])


def test_parameters_on_a_mesh_need_a_target_of_as_many_devices(fake_compiler):
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    w = jax.device_put(
        W, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )
    with pytest.raises(ValueError, match=r"mesh of 8 devices .* has 4: plan"):
        optax_accum.plan_microbatch(
            STEP, w, None, EXAMPLE, 16, memory_budget=10**9, target=_v5e(4),
            multiple_of=4,
        )  # fmt: skip


# `data_axes`: the mesh axes the batch's rows are sharded over.


def _fsdp():
    """``W`` split over the rows of an 8-device Explicit mesh, and a step
    whose loss gathers it (``reshard``, which reads the mesh that is set)."""
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    w = jax.device_put(W, NamedSharding(mesh, P("data", None)))

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ reshard(w, P())) ** 2)

    return mesh, w, jax.value_and_grad(loss)


def test_data_axes_must_be_axes_of_the_parameters_mesh(fake_compiler):
    _, w, step = _fsdp()
    cases = [
        ("model", r"`data_axes`='model' names \['model'\], not axes .*\('data',\)"),
        (("data", "data"), r"`data_axes` has repeated axes: \('data', 'data'\)"),
    ]
    for data_axes, match in cases:
        for target in (None, _v5e(8)):
            with pytest.raises(ValueError, match=match):
                optax_accum.plan_microbatch(
                    step, w, None, EXAMPLE, 16, memory_budget=10**9, multiple_of=8,
                    target=target, data_axes=data_axes,
                )  # fmt: skip
    with pytest.raises(TypeError, match=r"`data_axes` must be None, a mesh axis"):
        _plan(memory_budget=10**9, target=_v5e(1), data_axes=3)


def test_data_axes_on_this_machine_need_parameters_on_a_mesh():
    with pytest.raises(ValueError, match=r"`data_axes`='data' .* are on none"):
        _plan(memory_budget=10**9, data_axes="data")


def test_the_batch_must_split_over_the_data_axes_on_this_machine():
    _, w, step = _fsdp()
    with pytest.raises(ValueError, match=r"\(8 devices\): `multiple_of` .* got 4"):
        optax_accum.plan_microbatch(
            step, w, None, EXAMPLE, 16, memory_budget=10**9, multiple_of=4,
            data_axes="data",
        )  # fmt: skip


def test_data_axes_shard_the_batch_on_this_machines_mesh():
    """An Explicit FSDP step planned on this machine's 8 devices, outside
    ``jax.set_mesh``: the parameters' mesh is set while it is traced, and
    the batch is split over "data", so each candidate's bytes are those of
    the step compiled with its rows sharded so; unsharded, they are more."""
    mesh, w, step = _fsdp()
    plan = optax_accum.plan_microbatch(
        step, w, None, EXAMPLE, 64, memory_budget=10**9, multiple_of=8,
        data_axes="data",
    )  # fmt: skip
    assert plan.microbatch_size == 64

    def compiled(sharding):
        batch = jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=sharding)
        with jax.set_mesh(mesh):
            return jax.jit(step).lower(w, batch).compile()

    rows = optax_accum.compiled_memory_bytes(compiled(NamedSharding(mesh, P("data"))))
    whole = optax_accum.compiled_memory_bytes(compiled(NamedSharding(mesh, P())))
    assert plan.memory_bytes == rows < whole
    # Without `data_axes` the step places the batch: here, whole on each device.
    unsharded = optax_accum.plan_microbatch(
        step, w, None, EXAMPLE, 64, memory_budget=10**9, multiple_of=8
    )
    assert unsharded.memory_bytes == whole


def test_an_ill_typed_batch_layout_says_to_name_the_data_axes():
    """Tensor parallel on an Explicit ("data", "model") mesh: the batch
    split over both axes meets a weight split over "model" in one matmul,
    which does not type-check; the error says how the batch was sharded and
    what to pass."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    w = jax.device_put(W, NamedSharding(mesh, P(None, "model")))
    match = r"(?s)rows sharded over \('data', 'model'\) on the parameters' mesh"
    with pytest.raises(ValueError, match=match + r".*`data_axes=`"):
        optax_accum.plan_microbatch(
            STEP, w, None, EXAMPLE, 16, memory_budget=10**9, multiple_of=8,
            data_axes=("data", "model"),
        )  # fmt: skip
    plan = optax_accum.plan_microbatch(
        STEP, w, None, EXAMPLE, 16, memory_budget=10**9, multiple_of=2,
        data_axes="data",
    )  # fmt: skip
    assert plan.microbatch_size == 16


def test_data_axes_is_an_ordered_name_or_tuple_of_names(fake_compiler):
    """A set has no order (the rows' device order would change between
    runs), and a PartitionSpec's entries are per dimension: both refused,
    here and by the faces that share the check."""
    _, w, step = _fsdp()
    for bad in ({"data"}, frozenset({"data"}), P("data")):
        with pytest.raises(TypeError, match=r"`data_axes` must be None, a mesh axis"):
            optax_accum.plan_microbatch(
                step, w, None, EXAMPLE, 16, memory_budget=10**9, multiple_of=8,
                data_axes=bad,
            )  # fmt: skip
        with pytest.raises(TypeError, match=r"`data_axes` must be None, a mesh axis"):
            optax_accum.accumulate(optax.sgd(0.1), 2, data_axes=bad)
    with pytest.raises(ValueError, match=r"not axes of the target's mesh \(the para"):
        _plan(memory_budget=10**9, target=_v5e(1), data_axes="batch")


def test_a_target_needs_data_axes_on_a_mesh_of_several_axes(fake_compiler):
    """On a ("data", "model") mesh the batch may be split over "data" alone
    (tensor parallel) or over both (data parallel): the planner does not
    guess, where a wrong guess on an Auto mesh would plan another program."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    w = jax.device_put(W, NamedSharding(mesh, P(None, "model")))
    match = r"axes \{'data': 2, 'model': 4\}: name the ones .* `data_axes=`"
    with pytest.raises(ValueError, match=match):
        optax_accum.plan_microbatch(
            STEP, w, None, EXAMPLE, 16, memory_budget=10**9, multiple_of=8,
            target=_v5e(8),
        )  # fmt: skip


def test_a_one_device_mesh_takes_data_axes():
    """Code written for a mesh, run on one device: its 1-device mesh is the
    parameters' mesh, and the batch split over its axis is the whole batch."""
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    w = jax.device_put(W, NamedSharding(mesh, P()))
    plans = [
        optax_accum.plan_microbatch(
            STEP, w, None, EXAMPLE, 16, memory_budget=10**9, data_axes=data_axes
        )
        for data_axes in ("data", None)
    ]
    assert plans[0].memory_bytes == plans[1].memory_bytes


def test_a_restore_targets_abstract_mesh_is_planned_under_the_callers_mesh():
    """Parameters and state from ``jax.eval_shape`` under ``jax.set_mesh``
    (an Orbax restore target) are on an abstract mesh: planned under the
    caller's mesh, with and without ``data_axes``, as the arrays are."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), devices=jax.devices()[:8])
    tx = optax.adam(1e-3)

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ reshard(p["w"], P())) ** 2)

    def step(p, s, x):
        updates, s = tx.update(jax.grad(loss)(p, x), s, p)
        return optax.apply_updates(p, updates), s

    def init():
        return {"w": jnp.zeros((8, 16), out_sharding=P("fsdp", None))}

    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(init)
        abstract_state = jax.eval_shape(tx.init, abstract)
        params = jax.jit(init)()
        state = jax.jit(tx.init)(params)
        assert isinstance(abstract["w"].sharding.mesh, jax.sharding.AbstractMesh)
        for data_axes in (None, ("data", "fsdp")):
            plans = [
                optax_accum.plan_microbatch(
                    step,
                    p,
                    s,
                    EXAMPLE,
                    64,
                    memory_budget=10**9,
                    multiple_of=8,
                    data_axes=data_axes,
                )
                for p, s in ((abstract, abstract_state), (params, state))
            ]
            assert plans[0] == plans[1]


def test_an_uncommitted_count_beside_a_mesh_is_planned_as_jit_runs_it():
    """``opt.init(params)`` outside ``jax.jit`` leaves Adam's count on device
    0, uncommitted: ``jax.jit`` runs the step with it beside the mesh, and
    the planner lowers it so too (not pinned to device 0)."""
    mesh, w, step_fn = _fsdp()
    tx = optax.adam(1e-3)
    opt_state = tx.init(w)
    assert not opt_state[0].count.committed

    def step(w, s, x):
        _, grads = step_fn(w, x)
        updates, s = tx.update(grads, s, w)
        return optax.apply_updates(w, updates), s

    plan = optax_accum.plan_microbatch(
        step, w, opt_state, EXAMPLE, 64, memory_budget=10**9, multiple_of=8,
        data_axes="data",
    )  # fmt: skip
    batch = jax.ShapeDtypeStruct(
        (64, 8), jnp.float32, sharding=NamedSharding(mesh, P("data"))
    )
    with jax.set_mesh(mesh):
        compiled = jax.jit(step).lower(w, opt_state, batch).compile()
    assert plan.memory_bytes == optax_accum.compiled_memory_bytes(compiled)


def test_an_abstract_mesh_outside_set_mesh_says_to_set_it():
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    with jax.set_mesh(mesh):
        w = jax.eval_shape(lambda: jnp.zeros((8, 16), out_sharding=P("data")))
    with pytest.raises(ValueError, match=r"abstract mesh .* plan under `jax.set_m"):
        optax_accum.plan_microbatch(STEP, w, None, EXAMPLE, 16, memory_budget=10**9)


def test_a_one_axis_one_device_mesh_scales_to_the_targets_devices(fake_compiler):
    """Code written for a mesh, run on one device, planned for 8 chips: the
    mesh's one axis spans them, with its name and type."""
    mesh = jax.make_mesh((1,), ("batch",), devices=jax.devices()[:1])
    w = jax.device_put(W, NamedSharding(mesh, P()))
    compiler = _compile.for_target(_v5e(8), w, "batch")
    assert (compiler.batch_axes, compiler.batch_devices) == (("batch",), 8)
    with pytest.raises(ValueError, match=r"`data_axes`='data' names \['data'\], not"):
        _compile.for_target(_v5e(8), w, "data")


def test_an_empty_axis_name_is_refused():
    with pytest.raises(TypeError, match=r"`data_axes` must be None, a mesh axis"):
        optax_accum.accumulate(optax.sgd(0.1), 2, data_axes="")
