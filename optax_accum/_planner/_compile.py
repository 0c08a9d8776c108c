# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Where the planner compiles its candidates: this machine, or a target.

`plan_microbatch` and `plan_fused_step` compile the step once per candidate
micro-batch size and read its device memory. `Compiler` is that choice made
once: `here` compiles for one of this machine's devices, whose free memory is
the default budget; `for_target` compiles for a GPU or TPU this machine does
not have (`_targets`), with the arguments placed on a mesh over the target's
devices, host-memory arguments (`offload`) kept in host memory, and that
device's memory as the default budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import re
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .. import _checks, _offload, _sharding, _targets


@dataclasses.dataclass(frozen=True)
class Compiler:
    """How the planner compiles and measures a candidate, and its budget.

    Attributes:
      name: the compiler, as the plan names it.
      measure: ``(step, args) -> (device bytes, note)``; ``args`` end with the
        batch.
      memory: the default budget in bytes, or None where it is unknown.
      missing: the error when ``memory`` is None and no budget is given.
      target: the target, or None for this machine.
      batch_axes: the mesh axes the batch's rows are sharded over, or None
        where the step places the batch.
      batch_devices: the devices the batch's rows are split over.
    """

    name: str
    measure: Callable[[Any, tuple[Any, ...]], tuple[int, str]]
    memory: int | None
    missing: str
    target: Any = None
    batch_axes: tuple[str, ...] | None = None
    batch_devices: int = 1

    def budget(self, memory_budget: int | None) -> int:
        """``memory_budget``, checked against the target's memory, or the
        default."""
        if memory_budget is None:
            if self.memory is None:
                raise ValueError(self.missing)
            return self.memory
        budget = _checks.positive_int(memory_budget, "memory_budget")
        over = self.memory is not None and budget > self.memory
        if self.target is not None and over:
            raise ValueError(
                f"`memory_budget`={budget:,} bytes is more than the "
                f"{self.memory:,} bytes of memory of a device of "
                f"`target`={self.target!r}."
            )
        return budget

    def check_multiple(self, multiple_of: int) -> None:
        """``multiple_of`` splits evenly over the batch's devices."""
        if multiple_of % self.batch_devices:
            raise ValueError(
                f"The batch's rows are sharded over the mesh axes "
                f"{self.batch_axes} ({self.batch_devices} devices): "
                f"`multiple_of` must be a multiple of {self.batch_devices}, "
                f"got {multiple_of}."
            )


def analysed(compiled: Any) -> Any:
    """``compiled.memory_analysis()``, or a RuntimeError where there is none."""
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(
            "This backend reports no memory analysis for compiled executables, "
            "so the micro-batch size cannot be planned ahead of time."
        )
    return stats


def here(device: Any = None, state: Any = None, data_axes: Any = None) -> Compiler:
    """Compiles for ``device`` (default ``jax.devices()[0]``); its free memory,
    ``bytes_limit - bytes_in_use``, is the default budget.

    With ``data_axes``, the batch's rows are sharded over those axes of the
    mesh of ``state`` (the parameters and optimizer state, abstract); without,
    the step places the batch. The mesh of ``state`` is set while the step is
    traced where the caller has set none (`_targets.compile_for` does the
    same for a target).
    """
    device = device if device is not None else jax.devices()[0]
    stats = device.memory_stats()
    memory = None
    if stats and "bytes_limit" in stats:
        memory = int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    mesh = _mesh_of(state, one_device=True)
    axes, devices, sharding = None, 1, None
    if data_axes is not None:
        if mesh is None:
            raise ValueError(
                f"`data_axes`={data_axes!r} shards the batch over the mesh of the "
                "parameters, and they are on none: place them on a mesh "
                "(`jax.device_put(params, NamedSharding(mesh, spec))`), or leave "
                "`data_axes` out and let the step place the batch."
            )
        axes, devices = _batch_axes(data_axes, mesh, "the parameters' mesh")
        sharding = NamedSharding(mesh, PartitionSpec(axes))
    # A restore target's mesh (`jax.eval_shape` under `jax.set_mesh`) is
    # abstract: the caller's concrete one stays.
    unset = jax.sharding.get_abstract_mesh().empty
    concrete = isinstance(mesh, jax.sharding.Mesh)
    if unset and mesh is not None and not concrete:
        raise ValueError(
            "The parameters are on an abstract mesh (`jax.eval_shape` under "
            f"`jax.set_mesh`: {mesh}): plan under `jax.set_mesh(mesh)` of "
            "the mesh they will be restored onto."
        )
    set_mesh = concrete and unset

    def measure(step: Any, args: tuple[Any, ...]) -> tuple[int, str]:
        batch = args[-1]
        if sharding is not None:
            batch = jax.tree.map(
                lambda b: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=sharding),
                batch,
            )
        with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
            compiled = _typed(
                lambda: step.lower(*args[:-1], batch).compile(), axes, mesh
            )
        analysed(compiled)
        return _offload.device_bytes(compiled)

    jaxlib = importlib.metadata.version("jaxlib")
    return Compiler(
        name=f"XLA:{device.platform.upper()} (jaxlib {jaxlib}) for {device}",
        measure=measure,
        memory=memory,
        missing=(
            f"`memory_budget` is required on {device.platform} device {device}: "
            "it reports no memory statistics, so its free memory is unknown. "
            "Pass the budget in bytes, e.g. memory_budget=4 * 2**30, or plan "
            "for the hardware you will run on with `target=`."
        ),
        batch_axes=axes,
        batch_devices=devices,
    )


def for_target(target: Any, state: Any, data_axes: Any = None) -> Compiler:
    """Compiles for ``target`` (a name of `_targets.TARGETS` or a topology).

    The mesh is over the target's devices, shaped like the mesh of the
    parameters and state (``state``, abstract), with its axis types, where
    they have one, else all on one ``"data"`` axis. Each leaf keeps its
    ``PartitionSpec`` and memory kind; the batch's rows are sharded over
    ``data_axes``, by default the mesh's one axis.

    Raises:
      ValueError: for an unknown target, a mesh of another size,
        ``data_axes`` that are not the mesh's, or none for a mesh of several
        axes (data parallel or tensor parallel: only the caller knows).
      ImportError: where the target's compiler is not installed.
    """
    devices = _targets.target_devices(target)
    mesh = _scaled(_mesh_of(state, one_device=True), len(devices))
    if mesh is None:
        layout = jax.sharding.AbstractMesh((len(devices),), ("data",))
        where = "the target's mesh (the parameters are on none)"
    else:
        layout, where = mesh, "the parameters' mesh"
        if mesh.size != len(devices):
            raise ValueError(
                f"The parameters are on a mesh of {mesh.size} devices "
                f"{dict(mesh.shape)}, and `target`={target!r} has "
                f"{len(devices)}: plan for a target of as many devices."
            )
        if data_axes is None and len(mesh.axis_names) > 1 and mesh.size > 1:
            raise ValueError(
                f"The parameters' mesh has the axes {dict(mesh.shape)}: name "
                "the ones the batch's rows are sharded over with `data_axes=`, "
                "e.g. data_axes='data' under tensor parallelism, or "
                f"data_axes={mesh.axis_names!r} for data parallelism over all."
            )
    axis_names, shape, types = layout.axis_names, layout.axis_sizes, layout.axis_types
    axes, batch_devices = _batch_axes(data_axes, layout, where)

    def measure(step: Any, args: tuple[Any, ...]) -> tuple[int, str]:
        specs = [jax.tree.map(_spec, a) for a in args[:-1]]
        kinds = [jax.tree.map(_host_kind, a) for a in args[:-1]]
        host = any("pinned_host" in jax.tree.leaves(k) for k in kinds)
        note = "memory_analysis splits host memory off" if host else ""
        try:
            compiled = _typed(
                lambda: _targets.compile_for(
                    step, *args, target=target, axis_names=axis_names,
                    mesh_shape=shape, axis_types=types,
                    specs=[*specs, PartitionSpec(axes)],
                    memory_kinds=[*kinds, None] if host else None,
                ),
                axes,
                mesh,
            )  # fmt: skip
        except jax.errors.JaxRuntimeError as e:
            return _refused(e, memory), note
        return compiled.memory().peak, note

    memory = _targets.device_memory(target)
    return Compiler(
        name=_targets.compiler(target),
        measure=measure,
        memory=memory,
        missing=(
            f"`memory_budget` is required for `target`={target!r}: its "
            "devices' memory is unknown. Pass the budget in bytes."
        ),
        target=target,
        batch_axes=axes,
        batch_devices=batch_devices,
    )


def _batch_axes(data_axes: Any, mesh: Any, where: str) -> tuple[tuple[str, ...], int]:
    """``data_axes`` checked against ``mesh`` (``where`` names it; default:
    all its axes), and the devices they split the batch's rows over."""
    axes = _checks.axis_names(data_axes, "data_axes") or tuple(mesh.axis_names)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"`data_axes`={data_axes!r} names {missing}, not axes of {where} "
            f"{tuple(mesh.axis_names)}."
        )
    if len(set(axes)) != len(axes):
        raise ValueError(f"`data_axes` has repeated axes: {data_axes!r}.")
    return axes, _sharding.mesh_size(mesh, axes)


def _typed(compile_: Callable[[], Any], axes: Any, mesh: Any) -> Any:
    """``compile_()``; a step ill-typed against the batch's sharding (an
    Explicit mesh's ``ShardingTypeError``) is a ValueError that says how
    the batch was sharded."""
    try:
        return compile_()
    except Exception as e:
        if type(e).__name__ != "ShardingTypeError":
            raise
        where = "placed by the step" if axes is None else f"sharded over {axes}"
        types = "" if mesh is None else f" {mesh.axis_names}, {mesh.axis_types}"
        raise ValueError(
            f"The step does not type-check with the batch's rows {where} on "
            f"the parameters' mesh{types}: {e}\nName the mesh axes the batch "
            "is sharded over with `data_axes=` (under tensor parallelism, only "
            "the data axes), or make the step's shardings agree (under an "
            "Explicit mesh, `jax.sharding.reshard` what it gathers)."
        ) from e


def _refused(error: Exception, memory: int | None) -> int:
    """The bytes a program needs that XLA:TPU refused to compile, as too large
    for the device: the temporaries its error names (a lower bound)."""
    text = str(error)
    if not text.startswith("RESOURCE_EXHAUSTED"):
        raise error
    found = re.search(r"required for HLO temporaries \(([\d.]+)G\)", text)
    needed = int(float(found.group(1)) * 2**30) if found else 0
    return max(needed, (memory or 0) + 1)


def _mesh_of(tree: Any, one_device: bool = False) -> Any:
    """The mesh of ``tree``'s leaves on several devices, a concrete one before
    an abstract one; with ``one_device``, else a one-device mesh. A host
    leaf's one-device mesh (`_offload.abstract` makes it) is none."""
    meshes = [
        x.sharding.mesh
        for x in jax.tree.leaves(tree)
        if isinstance(getattr(x, "sharding", None), NamedSharding)
        and (x.sharding.mesh.size > 1 or (one_device and _host_kind(x) is None))
    ]
    meshes.sort(key=lambda m: (m.size == 1, not isinstance(m, jax.sharding.Mesh)))
    return meshes[0] if meshes else None


def _scaled(mesh: Any, devices: int) -> Any:
    """A one-device mesh of one axis, code written for a mesh and run on one
    device, as that axis over a target's ``devices``; another one-device
    mesh, where the target has several, is none (all on ``"data"``)."""
    if mesh is None or mesh.size > 1 or devices == 1:
        return mesh
    if len(mesh.axis_names) != 1:
        return None
    return jax.sharding.AbstractMesh(
        (devices,), mesh.axis_names, axis_types=mesh.axis_types
    )


def _spec(x: Any) -> PartitionSpec:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    return PartitionSpec()


def _host_kind(x: Any) -> str | None:
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    return "pinned_host" if kind not in (None, "device") else None
