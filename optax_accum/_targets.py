# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Compiling a step for a GPU or TPU this machine does not have.

JAX compiles for a topology without its devices (deviceless AOT): XLA:GPU
from the CUDA plugin and a target description, XLA:TPU from libtpu. The
library's claims about the compiled program (which branch runs, the copies,
the temporary memory) are claims per compiler; this module lets a test check
them on each compiler from shape structs, with the ``compilers`` extra.

`compile_for` places each argument on a mesh over the target's devices,
compiles, and returns the program with the compiler that made it and its
device memory read the same way on every compiler (`Memory`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._extras import install_command

_CONFIGS = Path(__file__).parent / "_target_configs"


class Target(NamedTuple):
    """A named target: its platform, topology and what it is."""

    platform: str  # "cuda" or "tpu"
    topology: str
    about: str
    config: str | None = None  # a GPU's target description, in _CONFIGS
    chips_per_host: tuple[int, ...] | None = None  # a TPU smaller than a host


TARGETS = {
    "h100": Target("cuda", "1x1x1", "one H100 80GB", "h100_80gb.txtpb"),
    "h100x8": Target("cuda", "1x8x1", "an 8-GPU H100 80GB host", "h100_80gb.txtpb"),
    "v5e": Target("tpu", "v5e:1x1", "one TPU v5e chip", chips_per_host=(1, 1, 1)),
    "v5e:2x2": Target("tpu", "v5e:2x2", "a TPU v5e 2x2 slice (4 chips)"),
    # Colab's TPU runtime is a v5e-1, one chip (the v2-8 is retired).
    "colab_tpu": Target(
        "tpu", "v5e:1x1", "Colab's TPU runtime (v5e-1)", chips_per_host=(1, 1, 1)
    ),
}

# The packages of the `compilers` extra, by platform.
_PLUGINS = {
    "cuda": ("jax_plugins.xla_cuda12", "jax-cuda12-plugin"),
    "tpu": ("libtpu", "libtpu"),
}


class Memory(NamedTuple):
    """Device bytes of a compiled program, the same quantities on every compiler.

    XLA:GPU's ``peak_memory_in_bytes`` also counts host buffers, and XLA:TPU
    reports ``temp_size_in_bytes = 0`` with its working memory in the peak
    only; here ``peak = argument + output - alias + temp`` on both.
    """

    argument: int
    output: int
    alias: int
    temp: int
    peak: int


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A program compiled for a target, and which compiler made it."""

    program: jax.stages.Compiled
    target: str
    compiler: str
    mesh: Mesh

    def as_text(self) -> str:
        """The optimized HLO."""
        return self.program.as_text()

    def memory(self) -> Memory:
        stats = self.program.memory_analysis()
        arg, out = stats.argument_size_in_bytes, stats.output_size_in_bytes
        alias, temp = stats.alias_size_in_bytes, stats.temp_size_in_bytes
        if TARGETS[self.target].platform == "tpu":
            temp = max(temp, stats.peak_memory_in_bytes - (arg + out - alias))
        return Memory(arg, out, alias, temp, arg + out - alias + temp)


def compile_for(
    fn: Callable[..., Any],
    *args: Any,
    target: str,
    specs: Sequence[Any] | None = None,
    axis_names: tuple[str, ...] = ("data",),
    mesh_shape: tuple[int, ...] | None = None,
    donate_argnums: int | tuple[int, ...] = (),
) -> Compiled:
    """Compiles ``jax.jit(fn)(*args)`` for ``target``, without its devices.

    Args:
      fn: the function (a training step).
      *args: its arguments: pytrees of ``jax.ShapeDtypeStruct`` or arrays
        (their shapes and dtypes).
      target: a name of `TARGETS`: ``"h100"``, ``"h100x8"``, ``"v5e"``,
        ``"v5e:2x2"`` or ``"colab_tpu"``.
      specs: one ``PartitionSpec`` (or a pytree prefix of them) per argument
        over the mesh; ``None`` (the default) replicates every argument.
      axis_names: the mesh's axis names.
      mesh_shape: the mesh's shape (default: every device on one axis).
      donate_argnums: as for ``jax.jit``.

    Returns:
      A `Compiled`: the program, the compiler that made it and the mesh.

    Raises:
      ValueError: for an unknown ``target``, naming the known ones.
      ImportError: where the target's compiler (the ``compilers`` extra) is
        not installed.
    """
    mesh = target_mesh(target, axis_names, mesh_shape)
    specs = (None,) * len(args) if specs is None else tuple(specs)
    if len(specs) != len(args):
        raise ValueError(
            f"`specs` must have one entry per argument: got {len(specs)} for "
            f"{len(args)} arguments."
        )
    placed = [_place(a, s, mesh) for a, s in zip(args, specs, strict=True)]
    jitted = jax.jit(fn, donate_argnums=donate_argnums)
    with warnings.catch_warnings():
        # JAX's persistent cache (where on) stores the program but cannot
        # load a program compiled without its devices: it compiles again.
        warnings.filterwarnings(
            "ignore", "Error reading persistent compilation cache", UserWarning
        )
        program = jitted.trace(*placed).lower().compile()
    return Compiled(program, target, compiler(target), mesh)


def target_mesh(
    target: str,
    axis_names: tuple[str, ...] = ("data",),
    mesh_shape: tuple[int, ...] | None = None,
) -> Mesh:
    """A mesh over ``target``'s devices (default: all on one axis)."""
    devices = _devices(_checked(target))
    shape = (len(devices),) if mesh_shape is None else tuple(mesh_shape)
    return Mesh(_reshape(devices, shape), axis_names)


def compiler(target: str) -> str:
    """Which compiler `compile_for` uses for ``target``, and its version."""
    spec = TARGETS[_checked(target)]
    kind = _devices(target)[0].device_kind
    n = len(_devices(target))
    package = _PLUGINS[spec.platform][1]
    name = "XLA:GPU" if spec.platform == "cuda" else "XLA:TPU"
    version = importlib.metadata.version(package)
    return f"{name} ({package} {version}) for {n} x {kind}"


def available(target: str) -> bool:
    """Whether ``target``'s compiler is installed."""
    module = _PLUGINS[TARGETS[_checked(target)].platform][0]
    return _find(module)


def _checked(target: str) -> str:
    if target not in TARGETS:
        raise ValueError(f"`target` must be one of {list(TARGETS)}, got {target!r}.")
    return target


def _find(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


@functools.cache
def _devices(target: str) -> tuple[Any, ...]:
    spec = TARGETS[target]
    module, package = _PLUGINS[spec.platform]
    if not _find(module):
        raise ImportError(
            f"Compiling for {target!r} needs {package}, in the `compilers` "
            f"extra: {install_command('compilers')}"
        )
    _prepare(spec.platform)
    from jax.experimental import topologies

    if spec.platform == "tpu":
        kwargs = {}
        if spec.chips_per_host is not None:
            kwargs["chips_per_host_bounds"] = list(spec.chips_per_host)
        topology = topologies.get_topology_desc(
            topology_name=spec.topology, platform="tpu", **kwargs
        )
        return tuple(topology.devices)
    config = (_CONFIGS / spec.config).read_text()
    get = functools.partial(
        topologies.get_topology_desc,
        platform="cuda",
        target_config=config,
        topology=spec.topology,
    )
    try:
        topology = get()
    except NotImplementedError:
        # JAX started before `_prepare`: without a GPU the plugin failed its
        # check of the CUDA libraries and did not register. It can register
        # late, as no CUDA backend was made.
        importlib.import_module(module).initialize()
        topology = get()
    return tuple(topology.devices)


def _prepare(platform: str) -> None:
    """Environment for loading a plugin on a machine without its devices.

    Read when the plugin loads, so each is a default a caller may override.
    """
    if platform == "cuda":
        # The plugin's check of the CUDA libraries, which compiling needs not.
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
        return
    # No metadata server to ask for the TPU's type and hosts (off Cloud it
    # times out), and other processes (test workers) may load libtpu too.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _reshape(devices: Sequence[Any], shape: tuple[int, ...]) -> Any:
    import numpy as np

    if int(np.prod(shape)) != len(devices):
        raise ValueError(
            f"`mesh_shape` {shape} must hold the target's {len(devices)} devices."
        )
    return np.asarray(devices, dtype=object).reshape(shape)


def _place(arg: Any, spec: Any, mesh: Mesh) -> Any:
    """``arg`` as shape structs on ``mesh``, with ``spec`` (a prefix)."""
    spec = PartitionSpec() if spec is None else spec
    is_spec = lambda x: x is None or isinstance(x, PartitionSpec)
    specs = jax.tree.map(
        lambda s, a: jax.tree.map(lambda _: s or PartitionSpec(), a),
        spec,
        arg,
        is_leaf=is_spec,
    )
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, s)
        ),
        arg,
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
