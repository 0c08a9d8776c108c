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
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from . import _compiler, _sharding

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


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(getattr(x, "dtype", None) or np.float32, jax.dtypes.extended)


def _moves(x: Any) -> bool:
    """Whether `offload` keeps ``x`` off the device: every array but PRNG
    keys. A key in host memory reaches a jitted program typed as device
    memory (JAX 0.10 drops the memory kind of extended dtypes there), so a
    program that returned it in host memory would change its own type (a
    ``lax.scan`` carry, a ``lax.cond`` branch); a key is a few bytes."""
    return _is_array(x) and not _is_key(x)


def _move(tree: Any, space: Any) -> Any:
    """Moves every array leaf of ``tree`` to ``space``, keeping its sharding."""
    return jax.tree.map(lambda x: jax.device_put(x, space) if _moves(x) else x, tree)


def _on_mesh(params: Any) -> bool:
    leaves = jax.tree.leaves(params)
    return any(isinstance(getattr(x, "sharding", None), NamedSharding) for x in leaves)


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
    if _on_mesh(params):
        shardings = _sharding.state_shardings(inner, params)
    else:
        shardings = jax.tree.map(lambda x: x.sharding, state)
    # Two puts: JAX (0.10) cannot move a buffer to other devices and to
    # another memory at once ("Memory kind mismatch with xla::PjRtBuffers"),
    # as a step count made on one device and replicated on the mesh would.
    state = jax.device_put(state, shardings)
    kinds = jax.tree.map(
        lambda x, s: s.with_memory_kind(memory_kind) if _moves(x) else s,
        state,
        shardings,
    )
    return jax.device_put(state, kinds)


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
    (`microbatch_value_and_grad` then ``tx.update``) once per step, and
    only once the gradients are made: XLA:GPU would otherwise bring it in
    before the micro-batch loop (`_compiler.after`).
    ``optax.MultiSteps`` cannot hold it: it picks the new or the old state
    with ``jnp.where``, on the device, and its ``lax.cond`` then rejects a
    branch that returns the state in device memory next to one that keeps
    it in host memory.

    Wherever a leaf of the state arrives (restored by Orbax into
    ``jax.eval_shape(tx.init, params)``, so in device memory; a
    hyperparameter written by hand), ``update`` and the steps of
    `accumulate` and `MultiSteps` return it in ``memory_kind``: those put
    every leaf there on entry. PRNG keys in the state stay in
    device memory: a jitted program types a key in host memory as device
    memory (JAX 0.10), and a key is a few bytes. A ``lax.scan`` (or
    ``fori_loop``) carry must keep its type, memory kind included, so a state
    that arrives in device memory cannot enter a scanned training loop as it
    is: the first update returns it in ``memory_kind`` and the scan refuses
    the carry ("carry input and carry output must have equal types ...
    float32<host>"). Put it where ``offload`` keeps it before the loop:
    ``jax.device_put(state, optax_accum.state_shardings(tx, params))``.

    Donating the state: under an Auto mesh ``jax.jit`` aliases each state
    buffer with its own output. Under an Explicit mesh it pairs donated
    buffers with outputs by shape alone unless every output's memory kind is
    known, so give the step ``out_shardings`` (`state_shardings` gives the
    state's, memory kinds included). On one device, without a mesh, JAX
    (0.10) pairs them by shape alone unless the inputs' and the outputs'
    memory kinds are both known, and a host buffer paired with a device
    output aborts the process: give the step ``in_shardings`` and
    ``out_shardings`` (`state_shardings` works on one device), or do not
    donate the state there.

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
            # The move waits for the gradients (XLA:GPU would start it
            # before a fused step's micro-batch loop: `_compiler.after`).
            state, updates = _compiler.after(state, updates)
            state = _move(state, jax.memory.Space.Device)
            updates, state = inner.update(updates, state, params, **extra_args)
            return updates, _move(state, space)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def settle(
    inner: optax.GradientTransformation, state: optax.OptState, params: Any
) -> optax.OptState:
    """``state`` where ``inner.init`` puts it: the invariant a step starts from.

    A state leaf may arrive in any memory: restored by Orbax into
    ``jax.eval_shape(tx.init, params)`` (device memory), written by the user
    (``state.hyperparams["learning_rate"] = jnp.float32(1e-3)``), or picked
    by a ``jnp.where`` outside `offload`. `accumulate` and `MultiSteps` call
    this on entry, so that the ``lax.cond`` that runs ``inner`` only at a
    boundary holds the same state in both branches (the boundary keeps it
    there with `keep`): each leaf moves to the memory kind of the same leaf
    of ``inner.init(params)``, traced, not run. The move is a no-op for a
    leaf already there.

    Args:
      inner: the inner optimizer (`offload`, or a chain that holds one).
      state: its state, as it arrived.
      params: what ``inner.init`` takes (the gradients where ``update`` got
        no parameters: only their shapes and dtypes are read).

    Returns:
      ``state``, each leaf in the memory kind ``inner.init`` gives it.

    Raises:
      ValueError: naming `offload` and the leaf, where ``inner.init`` keeps
        some of its state off the device but ``state`` has other leaves, or a
        leaf cannot be moved there.
    """
    init = _init_spaces(inner, params)
    if init is None:
        return state
    init_paths, spaces = init
    if jax.memory.Space.Host not in spaces and not any(
        map(_off_device, jax.tree.leaves(state))
    ):
        return state  # nothing offloaded, nothing arrived off the device
    paths, treedef = jax.tree_util.tree_flatten_with_path(state)
    if len(spaces) != len(paths):
        names = [jax.tree_util.keystr(p) for p, _ in paths]
        first = next(
            (
                i
                for i, (a, b) in enumerate(zip(names, init_paths, strict=False))
                if a != b
            ),
            min(len(names), len(init_paths)),
        )
        got = names[first] if first < len(names) else "(no more leaves)"
        want = init_paths[first] if first < len(init_paths) else "(no more leaves)"
        raise ValueError(
            "`offload`: the inner optimizer's state has "
            f"{len(paths)} leaves, but `inner.init` gives {len(spaces)}: at "
            f"leaf {first}, the state has {got} where `inner.init` has "
            f"{want}, so where each leaf lives cannot be told. Restore it into "
            "a target with the state's own structure "
            "(`jax.eval_shape(tx.init, params)` or "
            "`optax_accum.state_shardings(tx, params)`)."
        )
    leaves = [
        _to(x, space, jax.tree_util.keystr(path))
        for (path, x), space in zip(paths, spaces, strict=True)
    ]
    return jax.tree.unflatten(treedef, leaves)


def keep(new_state: optax.OptState, state: optax.OptState) -> optax.OptState:
    """``new_state`` in the memory kinds of ``state`` (as `settle` left it):
    the boundary branch of a ``lax.cond`` returns what its hold branch
    returns, even where a ``jnp.where`` outside `offload` (``optax.
    apply_if_finite``, for one) gave the new state in device memory."""

    def put(path, x, like):
        if not _is_array(x):
            return x
        return _to(x, jax.typeof(like).memory_space, jax.tree_util.keystr(path))

    return jax.tree_util.tree_map_with_path(put, new_state, state)


def _init_spaces(inner: Any, params: Any) -> tuple[list, list] | None:
    """The path and memory space of each leaf of ``inner.init(params)``,
    traced.

    None where ``init`` cannot be traced on these (e.g. integer parameters'
    float0 gradients stand in for absent parameters): the state then stays
    as it came.
    """
    try:
        closed, shapes = jax.make_jaxpr(inner.init, return_shape=True)(params)
    except Exception:  # any failure: leave the state as it is
        return None
    paths = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]
    ]
    return paths, [a.memory_space for a in closed.out_avals]


def _off_device(x: Any) -> bool:
    return _is_array(x) and jax.typeof(x).memory_space != jax.memory.Space.Device


def _to(x: Any, space: Any, path: str) -> Any:
    """``x`` in ``space`` (a no-op where it is there), or an error naming it."""
    if not _is_array(x) or _is_key(x):
        return x
    if jax.typeof(x).memory_space == space:
        return x
    try:
        return jax.device_put(x, space)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"`offload`: the inner optimizer's state leaf {path} "
            f"({jax.typeof(x)}) cannot be moved to {space} memory, where "
            f"`offload` keeps it: {e}"
        ) from e


def _kind(x: Any) -> str | None:
    sharding = getattr(x, "sharding", None)
    return getattr(sharding, "memory_kind", None)


def offloaded_bytes(tree: Any) -> int:
    """Bytes per device of ``tree``'s leaves that live outside device memory."""
    leaves = jax.tree.leaves(tree)
    return sum(_per_device(x) for x in leaves if hasattr(x, "shape") and _in_host(x))


def abstract(x: Any) -> jax.ShapeDtypeStruct:
    """``x`` as a ``ShapeDtypeStruct`` that keeps its sharding and memory kind.

    A ``SingleDeviceSharding``'s memory kind does not reach the traced type
    of a ``ShapeDtypeStruct`` (JAX 0.10), a ``NamedSharding``'s does; so a
    leaf in host memory on one device gets a one-device mesh.
    """
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, SingleDeviceSharding) and _in_host(x):
        mesh = Mesh(np.array(list(sharding.device_set)), ("device",))
        sharding = NamedSharding(mesh, P(), memory_kind=sharding.memory_kind)
    elif isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(
        np.shape(x), jax.dtypes.result_type(x), sharding=sharding
    )


def _per_device(x: Any) -> int:
    shape = x.sharding.shard_shape(tuple(x.shape))
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def _in_host(x: Any) -> bool:
    return _kind(x) not in (None, "device")


def device_bytes(compiled: Any) -> tuple[int, str]:
    """Peak device bytes of a compiled call, less what it keeps in host memory.

    ``argument + output - alias + temp`` of ``compiled.memory_analysis()``.
    Where the backend splits host from device memory (its ``host_*`` sizes),
    these are device sizes already. Where it does not (the CPU, where host
    and device share memory), the inputs and outputs in host memory (an
    `offload` ed state) are taken out, by their own bytes, and a donated one
    once from the aliased bytes.

    Returns:
      The bytes, and a note saying which of the two it did ("" without
      buffers in host memory).
    """
    stats = compiled.memory_analysis()
    arg, out = stats.argument_size_in_bytes, stats.output_size_in_bytes
    alias, temp = stats.alias_size_in_bytes, stats.temp_size_in_bytes
    total = int(arg + out - alias + temp)
    if stats.host_argument_size_in_bytes + stats.host_output_size_in_bytes:
        return total, "memory_analysis splits host memory off"
    args = jax.tree.leaves(compiled.args_info)
    shardings = jax.tree.leaves(compiled.input_shardings, is_leaf=lambda s: s is None)
    if len(args) != len(shardings):  # no way to pair them: count as on device
        return total, ""
    host_in = host_donated = 0
    for info, sharding in zip(args, shardings, strict=True):
        if sharding is None or not hasattr(info, "shape"):
            continue
        x = jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding)
        if _in_host(x):
            host_in += _per_device(x)
            host_donated += _per_device(x) if info.donated else 0
    host_out = sum(
        _per_device(x) for x in jax.tree.leaves(compiled.out_info) if _in_host(x)
    )
    if not host_in + host_out:
        return total, ""
    aliased = min(host_donated, host_out, alias)
    return total - host_in - host_out + aliased, (
        "no host split in memory_analysis: buffers in host memory left out by "
        f"their own sizes, {host_in:,} bytes of arguments (`offloaded_bytes`) "
        f"and {host_out:,} of outputs, {aliased:,} of them donated"
    )
