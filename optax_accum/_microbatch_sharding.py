# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The device-local path of `microbatch`: per-device loops, one reduction after.

This module owns what `microbatch` does across devices when the user names
the mesh axes (``mesh_axes=``): checking that they shard no parameter,
casting inputs to varying so their cotangents stay local, the
`jax.shard_map` wrapper that runs the loop per device, and the reductions over
devices (values, gradients, ``aux`` and state) after the loop.
The loop itself, and the copy-free split it reads, live in `_microbatch`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _layout


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array)


def batch_mesh(
    args: list,
    kwargs: dict,
    state: Any,
    batch_idx: tuple[int, ...],
    axes_mode: str | tuple[str, ...],
    mesh_axes: Any,
) -> tuple[Any, tuple]:
    """The mesh and the named axes to run the device-local loop over.

    ``axes_mode`` is the checked ``mesh_axes`` tuple; ``mesh_axes`` is the
    user's value, for the error messages. The mesh comes from
    ``jax.set_mesh`` or the batch's sharding. Parameters sharded over the
    named axes (FSDP) are refused: the loop would gather them whole.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        meshes = [
            s.mesh
            for i in batch_idx
            for x in jax.tree.leaves(args[i])
            if isinstance(s := getattr(jax.typeof(x), "sharding", None), NamedSharding)
            and not s.mesh.empty
        ]
        if not meshes:
            raise ValueError(
                f"`mesh_axes`={mesh_axes!r} needs a mesh: call under "
                "`jax.set_mesh(mesh)`."
            )
        mesh = meshes[0]
    missing = [a for a in axes_mode if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"`mesh_axes`={mesh_axes!r} names {missing}, not axes of the mesh "
            f"{mesh.axis_names}."
        )
    others = [a for i, a in enumerate(args) if i not in batch_idx]
    clash = _layout.sharded_over((others, kwargs, state), axes_mode)
    if clash:
        raise ValueError(
            f"`mesh_axes`={mesh_axes!r} must name only mesh axes that shard the "
            "batch but no parameter: the device-local loop would gather these "
            f"whole: {clash}. Name the pure data-parallel axes (HSDP: "
            '`mesh_axes="data"`), or keep the global view (`mesh_axes="auto"`).'
        )
    return mesh, axes_mode


def to_varying(tree: Any, axes: tuple) -> Any:
    """pcast leaves to varying, so their cotangents stay local (no psum)."""

    def cast(x):
        if not _is_array(x):
            return x
        missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def reduce_after_loop(
    acc_v: Any,
    acc_g: Any,
    w_sum: jax.Array,
    axes: tuple,
    *,
    k: int,
    unit: float,
    weighted: bool,
    mean: bool,
) -> tuple[Any, Any]:
    """Reduces the accumulated values and gradients over ``axes``, once.

    Each device's ``acc_v`` / ``acc_g`` are a running weighted mean (weighted
    mean), a weighted sum, or a plain sum of its ``k`` micro-batches; ``unit``
    is the weight of one unweighted micro-batch.
    """
    if weighted and mean:
        total = lax.psum(w_sum, axes)
        share = jnp.where(total > 0, w_sum / jnp.where(total > 0, total, 1.0), 0.0)
        return lax.psum(
            jax.tree.map(lambda a: share.astype(a.dtype) * a, (acc_v, acc_g)), axes
        )
    acc_v, acc_g = lax.psum((acc_v, acc_g), axes)
    if not weighted:
        scale = 1.0 / (k * lax.psum(1, axes)) if mean else unit
        if scale != 1.0:
            acc_v, acc_g = jax.tree.map(lambda a: a * scale, (acc_v, acc_g))
    return acc_v, acc_g


def reduce_single(tree: Any, w: jax.Array, axes: tuple, mean: bool) -> Any:
    """The one weighted reduction over ``axes`` when there is no loop (k = 1)."""
    if mean:
        total = lax.psum(w, axes)
        w = jnp.where(total > 0, w / jnp.where(total > 0, total, 1.0), 0.0)

    def red(x):
        wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        # Select, not multiply: a weight-0 device's NaN must not spread.
        return lax.psum(jnp.where(w > 0, w * wide, 0), axes).astype(x.dtype)

    return jax.tree.map(red, tree)


def _reduce_state(new: jax.Array, old: Any, axes: tuple) -> jax.Array:
    if jnp.issubdtype(new.dtype, jnp.inexact):
        return lax.pmean(new, axes)
    if jnp.issubdtype(new.dtype, jax.dtypes.extended):
        return old  # PRNG keys: the counters that advance are ints.
    if jnp.issubdtype(new.dtype, jnp.bool_):
        return lax.pmax(new.astype(jnp.int32), axes) > 0
    return lax.pmax(new, axes)


def _reduce_aux(a: jax.Array, ws: jax.Array, axes: tuple) -> jax.Array:
    if jnp.issubdtype(a.dtype, jnp.bool_):
        return lax.psum(a.astype(jnp.int32), axes) > 0
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        return lax.psum(a, axes)
    shape = ws.shape + (1,) * (a.ndim - 1)
    wide = a.astype(jnp.promote_types(a.dtype, jnp.float32))
    w = ws.reshape(shape)
    # A weight-0 micro-batch contributes nothing, even a NaN (select, not 0 * x).
    num = lax.psum(jnp.where(w > 0, w * wide, 0.0), axes)
    den = lax.psum(ws, axes).reshape(shape)
    safe = jnp.where(den > 0, den, 1.0)
    return jnp.where(den > 0, num / safe, 0.0).astype(a.dtype)


def device_local(
    run: Callable[..., tuple],
    args: list,
    kwargs: dict,
    state: Any,
    mesh: Any,
    axes: tuple,
    size: int,
    k: int,
    batch_idx: tuple[int, ...],
    has_aux: bool,
) -> tuple:
    """Runs the loop per device in shard_map; one psum after it.

    ``run(args, kwargs, axes, unit, local, state)`` is `microbatch`'s scan;
    ``mesh`` and ``axes`` come from `batch_mesh`, ``size`` is the global batch
    size. Returns
    ``(value, grads, aux, state)``, reduced over ``axes``.
    """
    n_dev = _layout.mesh_size(mesh, axes)
    if (size // n_dev) % k:
        raise ValueError(
            f"each micro-batch must be spread over the {n_dev} devices of "
            f"mesh axes {axes}: the micro-batch size {size // k} (batch "
            f"{size} / `num_micro_batches`={k}) is not divisible by {n_dev}."
        )
    flat, treedef = jax.tree.flatten((args, kwargs, state))
    flags = [jax.tree.map(lambda _, b=i in batch_idx: b, a) for i, a in enumerate(args)]
    no = jax.tree.map(lambda _: False, (kwargs, state))
    is_batch = jax.tree.leaves((flags, *no))
    dyn = [i for i, x in enumerate(flat) if is_batch[i] or _is_array(x)]
    specs = tuple(P(axes) if is_batch[i] else P() for i in dyn)

    # Which aux leaves hold the micro-batch's rows (axis 1, after the stacking
    # axis) is read from the device-local shapes while `inner` is traced, so
    # `fun` never runs outside the device-local context.
    rows_here = size // k // n_dev
    row_leaves: list[bool] = []

    def split_aux(aux, ws):
        leaves, aux_def = jax.tree.flatten(aux)
        row_leaves[:] = [a.ndim >= 2 and a.shape[1] == rows_here for a in leaves]
        # Rows are gathered over devices; other leaves are reduced and gain a
        # device axis of length 1, so one out_spec serves every leaf.
        return jax.tree.unflatten(
            aux_def,
            [
                a if row else _reduce_aux(a, ws, axes)[:, None]
                for a, row in zip(leaves, row_leaves, strict=True)
            ],
        )

    def inner(*leaves):
        full = list(flat)
        for i, x in zip(dyn, leaves, strict=True):
            full[i] = x if is_batch[i] else to_varying(x, axes)
        largs, lkwargs, lstate = jax.tree.unflatten(treedef, full)
        value, grads, aux, ws, lstate = run(
            list(largs), lkwargs, axes, 1.0 / n_dev, True, lstate
        )
        lstate = jax.tree.map(
            lambda new, old: _reduce_state(new, old, axes), lstate, state_in(leaves)
        )
        if has_aux:
            aux = split_aux(aux, ws)
        return value, grads, aux, lstate

    def state_in(leaves):
        full = list(flat)
        for i, x in zip(dyn, leaves, strict=True):
            full[i] = x
        return jax.tree.unflatten(treedef, full)[2]

    out_specs = (P(), P(), P(None, axes), P())
    mapped = jax.shard_map(
        inner, mesh=mesh, in_specs=specs, out_specs=out_specs, axis_names=set(axes)
    )
    value, grads, aux, state = mapped(*(flat[i] for i in dyn))
    if has_aux:
        leaves, aux_def = jax.tree.flatten(aux)
        aux = jax.tree.unflatten(
            aux_def,
            [
                a if row else _layout.replicated(a)[:, 0]
                for a, row in zip(leaves, row_leaves, strict=True)
            ],
        )
    return value, grads, aux, state
