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

import dataclasses
import importlib.metadata
import re
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .. import _checks, _offload, _targets


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
      batch_devices: the devices the batch is sharded over.
    """

    name: str
    measure: Callable[[Any, tuple[Any, ...]], tuple[int, str]]
    memory: int | None
    missing: str
    target: Any = None
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


def analysed(compiled: Any) -> Any:
    """``compiled.memory_analysis()``, or a RuntimeError where there is none."""
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(
            "This backend reports no memory analysis for compiled executables, "
            "so the micro-batch size cannot be planned ahead of time."
        )
    return stats


def here(device: Any = None) -> Compiler:
    """Compiles for ``device`` (default ``jax.devices()[0]``); its free memory,
    ``bytes_limit - bytes_in_use``, is the default budget."""
    device = device if device is not None else jax.devices()[0]
    stats = device.memory_stats()
    memory = None
    if stats and "bytes_limit" in stats:
        memory = int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))

    def measure(step: Any, args: tuple[Any, ...]) -> tuple[int, str]:
        compiled = step.lower(*args).compile()
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
    )


def for_target(target: Any, state: Any) -> Compiler:
    """Compiles for ``target`` (a name of `_targets.TARGETS` or a topology).

    The mesh is over the target's devices, shaped like the mesh of the
    parameters and state (``state``, abstract) where they have one, else all
    on one ``"data"`` axis. Each leaf keeps its ``PartitionSpec`` and memory
    kind; the batch's leading axis is sharded over every mesh axis.

    Raises:
      ValueError: for an unknown target, or a mesh of another size.
      ImportError: where the target's compiler is not installed.
    """
    devices = _targets.target_devices(target)
    mesh = _mesh_of(state)
    axis_names, shape = ("data",), None
    if mesh is not None:
        axis_names, shape = mesh.axis_names, mesh.devices.shape
        if mesh.devices.size != len(devices):
            raise ValueError(
                f"The parameters are on a mesh of {mesh.devices.size} devices "
                f"{dict(mesh.shape)}, and `target`={target!r} has "
                f"{len(devices)}: plan for a target of as many devices."
            )

    def measure(step: Any, args: tuple[Any, ...]) -> tuple[int, str]:
        specs = [jax.tree.map(_spec, a) for a in args[:-1]]
        kinds = [jax.tree.map(_host_kind, a) for a in args[:-1]]
        host = any("pinned_host" in jax.tree.leaves(k) for k in kinds)
        note = "memory_analysis splits host memory off" if host else ""
        try:
            compiled = _targets.compile_for(
                step, *args, target=target, axis_names=axis_names,
                mesh_shape=shape, specs=[*specs, PartitionSpec(axis_names)],
                memory_kinds=[*kinds, None] if host else None,
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
        batch_devices=len(devices),
    )


def _refused(error: Exception, memory: int | None) -> int:
    """The bytes a program needs that XLA:TPU refused to compile, as too large
    for the device: the temporaries its error names (a lower bound)."""
    text = str(error)
    if not text.startswith("RESOURCE_EXHAUSTED"):
        raise error
    found = re.search(r"required for HLO temporaries \(([\d.]+)G\)", text)
    needed = int(float(found.group(1)) * 2**30) if found else 0
    return max(needed, (memory or 0) + 1)


def _mesh_of(tree: Any) -> Any:
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        # One device's mesh (`_offload.abstract`'s, for a host leaf) is none.
        if isinstance(sharding, NamedSharding) and sharding.mesh.devices.size > 1:
            return sharding.mesh
    return None


def _spec(x: Any) -> PartitionSpec:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    return PartitionSpec()


def _host_kind(x: Any) -> str | None:
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    return "pinned_host" if kind not in (None, "device") else None
