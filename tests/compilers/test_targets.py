# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`_targets`: each named target compiles, says its compiler, and reads its
memory the same way; the extra pins what the installed jax needs."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from optax_accum import _targets

from .conftest import require

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
DEVICES = {
    "h100": 1,
    "h100x4": 4,
    "h100x8": 8,
    "v5e": 1,
    "v5e:2x2": 4,
    "v5e:2x4": 8,
    "colab_tpu": 1,
}


def _matmul(a, b):
    return jnp.tanh(a @ b) @ b.T


@pytest.mark.parametrize("target", list(_targets.TARGETS))
def test_each_target_compiles_and_names_its_compiler(target):
    require(target)
    a = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    compiled = _targets.compile_for(
        _matmul, a, jnp.ones((256, 512)), target=target, specs=(P("data"), None)
    )
    assert compiled.mesh.devices.size == DEVICES[target]
    platform = _targets.TARGETS[target].platform
    name = {"cuda": "XLA:GPU", "tpu": "XLA:TPU"}[platform]
    assert compiled.compiler.startswith(name), compiled.compiler
    assert f"for {DEVICES[target]} x " in compiled.compiler
    kind = compiled.mesh.devices.flat[0].device_kind
    assert ("H100" in kind) if platform == "cuda" else ("v5 lite" in kind), kind
    m = compiled.memory()
    assert m.peak == m.argument + m.output - m.alias + m.temp
    # The tanh(a @ b) intermediate needs working memory on every compiler
    # (XLA:TPU reports it in the peak only).
    assert m.temp > 0, m


def test_an_unknown_target_names_the_known_ones():
    with pytest.raises(ValueError, match=r"one of \['h100', 'h100x4', 'h100x8', 'v5e'"):
        _targets.compile_for(_matmul, jnp.ones((2, 2)), jnp.ones((2, 2)), target="a100")


def test_a_missing_compiler_names_the_extra(monkeypatch):
    monkeypatch.setattr(_targets, "_find", lambda module: False)
    _targets._devices.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"optax_accum\[compilers\]"):
            _targets.compile_for(_matmul, jnp.ones((2, 2)), target="v5e")
        assert not _targets.available("h100")
    finally:
        _targets._devices.cache_clear()


def _extra() -> dict[str, str]:
    """The `compilers` extra's pins, by package (tomllib is 3.11's)."""
    text = PYPROJECT.read_text()
    block = re.search(r"^compilers = \[\n(.*?)^\]", text, re.M | re.S)
    assert block, "no `compilers` extra in pyproject.toml"
    return dict(re.findall(r'"([\w-]+)==([\w.*]+)[;"]', block.group(1)))


def test_the_extra_pins_the_plugins_to_the_installed_jax():
    pins = _extra()
    assert pins["jax-cuda12-plugin"] == pins["jax-cuda12-pjrt"] == jax.__version__
    # libtpu as jax's own `tpu` extra pins it.
    tpu = [r for r in importlib.metadata.requires("jax") or [] if 'extra == "tpu"' in r]
    libtpu = [r for r in tpu if r.startswith("libtpu")]
    assert libtpu and f"libtpu=={pins['libtpu']}" in libtpu[0].replace(" ", ""), tpu


@pytest.mark.parametrize("package", ["jax-cuda12-plugin", "jax-cuda12-pjrt", "libtpu"])
def test_installed_compilers_are_the_pinned_ones(package):
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        require("h100" if package.startswith("jax") else "v5e")
        pytest.skip(f"{package} is not installed")
    pin = _extra()[package]
    assert re.fullmatch(pin.replace(".", r"\.").replace("*", ".*"), version), (
        package,
        version,
        pin,
    )


@pytest.mark.parametrize("target", ["h100", "h100x8", "v5e:2x2"])
def test_host_memory_arguments_stay_on_the_host(target):
    """A pinned_host argument, sharded: lowered on a CPU mesh of the target's
    shape, compiled by the target's compiler, each device's shard in its
    host memory and out of `Memory`."""
    require(target)

    def step(w, s):  # a state kept on the host between steps
        s = jax.device_put(s, jax.memory.Space.Device) * 0.9 + w
        return w - s, jax.device_put(s, jax.memory.Space.Host)

    w = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
    compiled = _targets.compile_for(
        step, w, w, target=target, specs=(P("data"), P("data")),
        memory_kinds=(None, "pinned_host"), donate_argnums=(0, 1),
    )  # fmt: skip
    shard = 1024 * 256 * 4 // DEVICES[target]
    stats = compiled.program.get_compiled_memory_stats()
    assert stats.host_argument_size_in_bytes == shard
    assert compiled.memory().argument == shard  # the device's shard of w
    assert f"f32[{1024 // DEVICES[target]},256]" in compiled.as_text()


@pytest.mark.parametrize(
    "topology, kind",
    [
        ("v2:2x2", "TPU v2"),
        ("v3:2x2", "TPU v3"),
        ("v4:2x2x1", "TPU v4"),
        ("v5e:2x2", "TPU v5 lite"),
        ("v5p:2x2x1", "TPU v5"),
        ("v6e:2x2", "TPU v6 lite"),
    ],
)
def test_each_tpu_generations_memory_is_what_xla_tpu_gives_a_program(topology, kind):
    """The planner's default budget for a TPU topology is the HBM XLA:TPU
    offers a program on one of its devices: the figure its out-of-memory
    error names, for a program of 64 GiB."""
    require("v5e")
    _targets.target_devices("v5e")  # the environment libtpu loads in
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(
        topology_name=topology, platform="tpu"
    ).devices
    assert devices[0].device_kind == kind
    huge = jax.ShapeDtypeStruct((2**18, 2**16), jnp.float32)
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED") as e:
        _targets.compile_for(lambda a: a * 2 + 1, huge, target=devices[:1])
    found = re.search(r"available HBM \(([\d.]+)G\)", str(e.value))
    assert found, str(e.value)
    assert _targets.device_memory(devices[:1]) == round(float(found.group(1)) * 2**30)
