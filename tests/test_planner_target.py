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
import pytest

import optax_accum
from optax_accum import _targets


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
    match = r"its 4 devices: `multiple_of` .* of 4, got 2"
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
