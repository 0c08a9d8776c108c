# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Compiling a step for a GPU or TPU this machine does not have.

JAX compiles for a topology without its devices (deviceless AOT): XLA:GPU
from the CUDA plugin and a target description, XLA:TPU from libtpu. The
library's claims about the compiled program (which branch runs, the copies,
the temporary memory) are claims per compiler; this module lets a test check
them on each compiler from shape structs, with the ``compilers`` extra.

`compile_for` places each argument on a mesh over the target's devices (or,
for host-memory arguments, lowers on a CPU mesh of that shape for the
target's platform), compiles, and returns the program with the compiler that
made it and its device memory read the same way on every compiler (`Memory`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import re
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
    "h100x4": Target("cuda", "1x4x1", "4 H100 80GB GPUs", "h100_80gb.txtpb"),
    "h100x8": Target("cuda", "1x8x1", "an 8-GPU H100 80GB host", "h100_80gb.txtpb"),
    "v5e": Target("tpu", "v5e:1x1", "one TPU v5e chip", chips_per_host=(1, 1, 1)),
    "v5e:2x2": Target("tpu", "v5e:2x2", "a TPU v5e 2x2 slice (4 chips)"),
    "v5e:2x4": Target("tpu", "v5e:2x4", "a TPU v5e 2x4 slice (8 chips)"),
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

# A TPU device's HBM by its ``device_kind`` (a topology's devices report no
# memory statistics): what XLA:TPU gives a program on one device of each
# generation's topology, in GiB to the two decimals its out-of-memory error
# gives ("available HBM (15.75G)"; a real v5e's ``bytes_limit`` is the same
# 15.75 GiB). A v2, v3 or v4 topology's devices are TensorCores, two per
# chip, each with half of it. tests/compilers/test_targets.py checks each
# against the installed libtpu.
_TPU_HBM_GIB = {
    "TPU v2": 7.48,
    "TPU v3": 15.48,
    "TPU v4": 15.25,
    "TPU v5 lite": 15.75,  # v5e
    "TPU v5": 95.74,  # v5p
    "TPU v6 lite": 31.25,  # v6e
}
_TPU_MEMORY = {kind: round(gib * 2**30) for kind, gib in _TPU_HBM_GIB.items()}

# A target is a name of `TARGETS`, or a topology (``jax.experimental.
# topologies.get_topology_desc(...)``, or its devices).
TargetLike = Any


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
    """A program compiled for a target, and which compiler made it.

    ``program`` is a ``jax.stages.Compiled``, or, for host-memory arguments
    (compiled from the StableHLO lowered on a CPU mesh), XLA's executable.
    """

    program: Any
    target: TargetLike
    compiler: str
    mesh: Mesh

    def as_text(self) -> str:
        """The optimized HLO."""
        if hasattr(self.program, "as_text"):
            return self.program.as_text()
        return self.program.hlo_modules()[0].to_string()

    def memory(self) -> Memory:
        """Device memory (host buffers are left out on every compiler)."""
        if hasattr(self.program, "memory_analysis"):
            stats = self.program.memory_analysis()
        else:
            stats = self.program.get_compiled_memory_stats()
        arg, out = stats.argument_size_in_bytes, stats.output_size_in_bytes
        alias, temp = stats.alias_size_in_bytes, stats.temp_size_in_bytes
        if self.mesh.devices.flat[0].platform == "tpu":
            temp = max(temp, stats.peak_memory_in_bytes - (arg + out - alias))
        return Memory(arg, out, alias, temp, arg + out - alias + temp)


def compile_for(
    fn: Callable[..., Any],
    *args: Any,
    target: TargetLike,
    specs: Sequence[Any] | None = None,
    axis_names: tuple[str, ...] = ("data",),
    mesh_shape: tuple[int, ...] | None = None,
    donate_argnums: int | tuple[int, ...] = (),
    memory_kinds: Sequence[Any] | None = None,
    axis_types: tuple[Any, ...] | None = None,
) -> Compiled:
    """Compiles ``jax.jit(fn)(*args)`` for ``target``, without its devices.

    Args:
      fn: the function (a training step); a ``jax.jit``-wrapped one keeps
        its own settings (donation) where ``donate_argnums`` is not given.
      *args: its arguments: pytrees of ``jax.ShapeDtypeStruct`` or arrays
        (their shapes and dtypes).
      target: a name of `TARGETS`: ``"h100"``, ``"h100x4"``, ``"h100x8"``,
        ``"v5e"``, ``"v5e:2x2"``, ``"v5e:2x4"`` or ``"colab_tpu"``; or a topology
        (``jax.experimental.topologies.get_topology_desc(...)``) or its
        devices.
      specs: one ``PartitionSpec`` (or a pytree prefix of them) per argument
        over the mesh; ``None`` (the default) replicates every argument.
      axis_names: the mesh's axis names.
      mesh_shape: the mesh's shape (default: every device on one axis).
      donate_argnums: as for ``jax.jit``.
      memory_kinds: one memory kind (``"device"``, ``"pinned_host"``; or a
        pytree prefix of them) per argument; ``None``, the device's. The
        target's devices have no memories to place an argument in, so with a
        host-memory argument the step is lowered on a mesh of as many CPU
        devices (``jax_num_cpu_devices``) for the target's platform and that
        program compiled by the target's compiler.
      axis_types: the mesh's ``jax.sharding.AxisType`` per axis (default:
        ``Auto``). The mesh is set (``jax.set_mesh``) while the step is
        traced, whatever mesh the caller has set: a step that reads the mesh
        (an Explicit ``reshard``, a bare ``PartitionSpec``) reads the
        target's.

    Returns:
      A `Compiled`: the program, the compiler that made it and the mesh.

    Raises:
      ValueError: for an unknown ``target``, naming the known ones.
      ImportError: where the target's compiler (the ``compilers`` extra) is
        not installed.
    """
    mesh = target_mesh(target, axis_names, mesh_shape, axis_types)
    specs = _per_argument(specs, args, "specs")
    kinds = _per_argument(memory_kinds, args, "memory_kinds")
    jitted = jitted_with(fn, donate_argnums)
    if any("pinned_host" in jax.tree.leaves(k) for k in kinds if k is not None):
        program = _compile_via_cpu(jitted, args, specs, kinds, mesh, target)
        return Compiled(program, target, compiler(target), mesh)
    placed = [_place(a, s, mesh) for a, s in zip(args, specs, strict=True)]
    with warnings.catch_warnings():
        # JAX's persistent cache (where on) stores the program but cannot
        # load a program compiled without its devices: it compiles again.
        warnings.filterwarnings(
            "ignore", "Error reading persistent compilation cache", UserWarning
        )
        with jax.set_mesh(mesh):  # a step that reads the mesh reads this one
            program = jitted.trace(*placed).lower().compile()
    return Compiled(program, target, compiler(target), mesh)


def jitted_with(fn: Callable[..., Any], donate_argnums: Any = ()) -> Any:
    """``fn`` as `compile_for` lowers it: a ``jax.jit`` function keeps its own
    settings (donation) where ``donate_argnums`` is not given; anything else
    is jitted with it."""
    if hasattr(fn, "trace") and donate_argnums == ():
        return fn
    return jax.jit(fn, donate_argnums=donate_argnums)


def target_mesh(
    target: TargetLike,
    axis_names: tuple[str, ...] = ("data",),
    mesh_shape: tuple[int, ...] | None = None,
    axis_types: tuple[Any, ...] | None = None,
) -> Mesh:
    """A mesh over ``target``'s devices (default: all on one axis, ``Auto``)."""
    devices = target_devices(target)
    shape = (len(devices),) if mesh_shape is None else tuple(mesh_shape)
    return Mesh(_reshape(devices, shape), axis_names, axis_types=axis_types)


def compiler(target: TargetLike) -> str:
    """Which compiler `compile_for` uses for ``target``, and its version."""
    devices = target_devices(target)
    platform = _platform(devices)
    package = _PLUGINS[platform][1]
    name = "XLA:GPU" if platform == "cuda" else "XLA:TPU"
    version = importlib.metadata.version(package)
    return f"{name} ({package} {version}) for {len(devices)} x {devices[0].device_kind}"


def available(target: TargetLike) -> bool:
    """Whether ``target``'s compiler is installed."""
    if not isinstance(target, str):
        return True  # a topology's compiler made it
    module = _PLUGINS[TARGETS[_checked(target)].platform][0]
    return _find(module)


def device_memory(target: TargetLike) -> int | None:
    """The bytes of memory of one of ``target``'s devices, or None if unknown.

    A topology's devices report no memory statistics: a GPU's comes from its
    target description (``device_memory_size``), a TPU's from its kind.
    """
    devices = target_devices(target)
    if _platform(devices) == "tpu":
        return _TPU_MEMORY.get(devices[0].device_kind)
    spec = TARGETS.get(target) if isinstance(target, str) else None
    if spec is None:
        return None
    config = (_CONFIGS / spec.config).read_text()
    found = re.search(r"device_memory_size: (\d+)", config)
    return int(found.group(1)) if found else None


def target_devices(target: TargetLike) -> tuple[Any, ...]:
    """``target``'s devices: a name's (loading its compiler) or a topology's."""
    if isinstance(target, str):
        return _devices(_checked(target))
    devices = getattr(target, "devices", target)
    try:
        devices = tuple(devices)
    except TypeError:
        devices = ()
    if not devices or not all(hasattr(d, "device_kind") for d in devices):
        raise ValueError(
            f"`target` must be one of {list(TARGETS)}, a topology or its devices, "
            f"got {target!r}."
        )
    return devices


def _platform(devices: Sequence[Any]) -> str:
    """The `_PLUGINS` platform of ``devices``: a GPU topology's is ``"gpu"``."""
    platform = devices[0].platform
    return "cuda" if platform in ("gpu", "cuda") else platform


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


def _per_argument(values: Any, args: Sequence[Any], name: str) -> tuple[Any, ...]:
    values = (None,) * len(args) if values is None else tuple(values)
    if len(values) != len(args):
        raise ValueError(
            f"`{name}` must have one entry per argument: got {len(values)} for "
            f"{len(args)} arguments."
        )
    return values


def _place(arg: Any, spec: Any, mesh: Mesh, kind: Any = None) -> Any:
    """``arg`` as shape structs on ``mesh``, with ``spec`` and the memory
    ``kind`` (each a prefix of ``arg``)."""
    specs = _broadcast(PartitionSpec() if spec is None else spec, arg)
    kinds = _broadcast(kind, arg)
    return jax.tree.map(
        lambda a, s, k: jax.ShapeDtypeStruct(
            a.shape,
            a.dtype,
            sharding=NamedSharding(mesh, s or PartitionSpec(), memory_kind=k),
        ),
        arg,
        specs,
        kinds,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def _broadcast(prefix: Any, tree: Any) -> Any:
    """``prefix`` (a pytree prefix of ``tree``) repeated to ``tree``'s leaves."""
    is_leaf = lambda x: x is None or isinstance(x, (PartitionSpec, str))
    return jax.tree.map(
        lambda p, sub: jax.tree.map(lambda _: p, sub),
        prefix,
        tree,
        is_leaf=is_leaf,
    )


def _compile_via_cpu(jitted, args, specs, kinds, mesh, target) -> Any:
    """Host-memory arguments: lowered on a CPU mesh shaped like ``mesh`` for
    the target's platform, then compiled by the target's compiler."""
    import numpy as np
    from jax._src import compiler as jax_compiler  # the options jit would use

    cpus = jax.devices("cpu")
    n = mesh.devices.size
    if len(cpus) < n:
        raise ValueError(
            f"A host-memory argument for {target!r} ({n} devices) is lowered "
            f"on {n} CPU devices; there are {len(cpus)}: set "
            f'jax.config.update("jax_num_cpu_devices", {n}) before JAX starts.'
        )
    cpu_mesh = Mesh(
        np.asarray(cpus[:n]).reshape(mesh.devices.shape),
        mesh.axis_names,
        axis_types=mesh.axis_types,
    )
    placed = [
        _place(a, s, cpu_mesh, k) for a, s, k in zip(args, specs, kinds, strict=True)
    ]
    platform = _platform(list(mesh.devices.flat))
    with jax.set_mesh(cpu_mesh):
        lowered = jitted.trace(*placed).lower(lowering_platforms=(platform,))
    options = jax_compiler.get_compile_options(
        num_replicas=1,
        num_partitions=n,
        device_assignment=np.arange(n).reshape(1, n),
    )
    build = options.executable_build_options
    build.use_spmd_partitioning = n > 1
    build.use_shardy_partitioner = True
    devices = list(mesh.devices.flat)
    client = devices[0].client
    from jax._src.lib import xla_client

    return client.compile(
        lowered.compiler_ir("stablehlo"),
        executable_devices=xla_client.DeviceList(tuple(devices)),
        compile_options=options,
    )
