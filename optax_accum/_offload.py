# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The optimizer's state off the device between updates: `offload`.

`offload` wraps an optimizer so that its state lives in another memory of the
device (host memory, ``"pinned_host"``) and comes to the device only for the
update. Inside `accumulate` it runs in the boundary branch, so the state
moves once per window. This module also owns the bytes the planner leaves
out for an offloaded state (`offloaded_bytes`, `device_bytes`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from . import _sharding

# The memory kinds a jitted program can name (``jax.memory.Space``).
_SPACES = {
    "pinned_host": jax.memory.Space.Host,
    "device": jax.memory.Space.Device,
}


def _check_memory_kind(memory_kind: Any) -> str:
    kinds = sorted({m.kind for m in jax.local_devices()[0].addressable_memories()})
    if memory_kind not in kinds:
        raise ValueError(
            f"`memory_kind` must be one of the device's memory kinds {kinds}, "
            f"got {memory_kind!r}."
        )
    if memory_kind not in _SPACES:
        raise ValueError(
            f"`memory_kind`={memory_kind!r} is a memory of the device, but a "
            f"jitted program can only move arrays to {sorted(_SPACES)} "
            "(jax.memory.Space)."
        )
    return memory_kind


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array)


def _move(tree: Any, space: Any) -> Any:
    """Moves every array leaf of ``tree`` to ``space``, keeping its sharding."""
    return jax.tree.map(lambda x: jax.device_put(x, space) if _is_array(x) else x, tree)


def _mesh_of(params: Any) -> Any:
    for x in jax.tree.leaves(params):
        if isinstance(getattr(x, "sharding", None), NamedSharding):
            return x.sharding.mesh
    return None


def _place(inner: Any, state: Any, params: Any, memory_kind: str) -> Any:
    """``state`` in ``memory_kind``, sharded like the parameters it mirrors.

    Concrete arrays get explicit shardings: where the parameters are on a
    mesh, `state_shardings` (each buffer like its parameter, the rest, such as
    a step count, replicated on that mesh); otherwise each leaf's own.
    Traced arrays (``tx.init`` under ``jax.jit``) keep the sharding the
    compiler gives them and change memory only.
    """
    leaves = jax.tree.leaves(state)
    if not all(_is_array(x) for x in leaves) or any(
        isinstance(x, jax.core.Tracer) for x in leaves
    ):
        return _move(state, _SPACES[memory_kind])
    mesh = _mesh_of(params)
    if mesh is not None:
        shardings = _sharding.state_shardings(inner, params)
    else:
        shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.device_put(
        state, jax.tree.map(lambda s: s.with_memory_kind(memory_kind), shardings)
    )


def offload(
    inner: optax.GradientTransformation, memory_kind: str = "pinned_host"
) -> optax.GradientTransformationExtraArgs:
    """Keeps ``inner``'s state in ``memory_kind`` between updates.

    ``init`` places ``inner``'s state in ``memory_kind`` (host memory by
    default), sharded like the parameters it mirrors. ``update`` brings the
    state to device memory, runs ``inner``, and puts the new state back. The
    state is ``inner``'s own (no wrapper), so checkpoints and state readers
    see the same tree as without `offload`.

    Inside `accumulate` or `MultiSteps`, ``inner`` runs only in the boundary
    branch, so the state moves once per window; in a fused step
    (`microbatch_value_and_grad` then ``tx.update``) once per step.
    ``optax.MultiSteps`` cannot hold it: it picks the new or the old state
    with ``jnp.where``, on the device, and its ``lax.cond`` then rejects a
    branch that returns the state in device memory next to one that keeps
    it in host memory.

    Donating the state: under an Auto mesh ``jax.jit`` aliases each state
    buffer with its own output. Under an Explicit mesh it pairs donated
    buffers with outputs by shape alone unless every output's memory kind is
    known, so give the step ``out_shardings`` (`state_shardings` gives the
    state's, memory kinds included). On one device, without a mesh, JAX (0.10)
    leaves that pairing to XLA, which can hand a host buffer to a device
    output: do not donate the state there.

    Args:
      inner: the optimizer whose state to keep off the device.
      memory_kind: where the state lives between updates: ``"pinned_host"``,
        or ``"device"`` (no move: the same program as ``inner``).

    Returns:
      An ``optax.GradientTransformationExtraArgs``; ``update`` forwards extra
      arguments to ``inner``.

    Raises:
      ValueError: if ``memory_kind`` is not a memory kind of the device that
        a jitted program can move arrays to.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, optax_accum
      >>> sgd = optax.sgd(0.1, momentum=0.9)
      >>> tx = optax_accum.accumulate(optax_accum.offload(sgd), 2)
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> state.inner_state[0].trace["w"].sharding.memory_kind
      'pinned_host'
      >>> step = jax.jit(tx.update)
      >>> for g in (1.0, 3.0):
      ...     updates, state = step({"w": jnp.full(3, g)}, state, params)
      >>> updates["w"], state.inner_state[0].trace["w"].sharding.memory_kind
      (Array([-0.2, -0.2, -0.2], dtype=float32), 'pinned_host')
    """
    memory_kind = _check_memory_kind(memory_kind)
    inner = optax.with_extra_args_support(inner)
    if memory_kind == "device":
        return inner
    space = _SPACES[memory_kind]

    def init_fn(params: optax.Params) -> optax.OptState:
        with jax.named_scope("optax_accum/offload"):
            return _place(inner, inner.init(params), params, memory_kind)

    def update_fn(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        with jax.named_scope("optax_accum/offload"):
            state = _move(state, jax.memory.Space.Device)
            updates, state = inner.update(updates, state, params, **extra_args)
            return updates, _move(state, space)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _kind(x: Any) -> str | None:
    sharding = getattr(x, "sharding", None)
    return getattr(sharding, "memory_kind", None)


def offloaded_bytes(tree: Any) -> int:
    """Bytes per device of ``tree``'s leaves that live outside device memory."""
    total = 0
    for x in jax.tree.leaves(tree):
        kind = _kind(x)
        if kind is None or kind == "device" or not hasattr(x, "shape"):
            continue
        shape = x.sharding.shard_shape(tuple(np.shape(x)))
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def abstract(x: Any) -> jax.ShapeDtypeStruct:
    """``x`` as a ``ShapeDtypeStruct`` that keeps its sharding and memory kind.

    A ``SingleDeviceSharding``'s memory kind does not reach the traced type
    of a ``ShapeDtypeStruct`` (JAX 0.10), a ``NamedSharding``'s does; so a
    leaf in host memory on one device gets a one-device mesh.
    """
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, SingleDeviceSharding) and sharding.memory_kind not in (
        None,
        "device",
    ):
        mesh = Mesh(np.array(list(sharding.device_set)), ("device",))
        sharding = NamedSharding(mesh, P(), memory_kind=sharding.memory_kind)
    elif isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(
        np.shape(x), jax.dtypes.result_type(x), sharding=sharding
    )


def device_bytes(stats: Any, host_state: int) -> tuple[int, str]:
    """Peak device bytes from a memory analysis, less an offloaded state.

    Where the backend splits host from device memory (``host_*`` sizes), its
    device sizes already leave the state out. Where it does not (CPU, where
    host and device share memory), the state's own bytes, ``host_state``,
    are taken out of the arguments and outputs (once, if donated).

    Returns:
      The bytes, and a note saying which of the two it did.
    """
    arg, out = stats.argument_size_in_bytes, stats.output_size_in_bytes
    alias, temp = stats.alias_size_in_bytes, stats.temp_size_in_bytes
    split = stats.host_argument_size_in_bytes + stats.host_output_size_in_bytes
    if not host_state:
        return int(arg + out - alias + temp), ""
    if split:
        return int(arg + out - alias + temp), "memory_analysis splits host memory"
    device = (arg - host_state) + (out - host_state) - max(alias - host_state, 0)
    return int(device + temp), (
        f"no host split in memory_analysis: the offloaded state's own "
        f"{host_state:,} bytes left out"
    )
