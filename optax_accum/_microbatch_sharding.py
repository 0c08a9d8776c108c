# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The device-local path of `microbatch`: per-device loops, one reduction after.

This module owns what `microbatch` does across devices: finding the Explicit
mesh axes that shard the batch, casting inputs to varying so their cotangents
stay local, the `jax.shard_map` wrapper that runs the loop per device, and the
reductions over devices (values, gradients, ``aux`` and state) after the loop.
The loop itself, and the copy-free split it reads, live in `_microbatch`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array)


def spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one `PartitionSpec` entry (or an ``axis_name``)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _explicit_batch_axes(batch: list, others: list) -> tuple[Any, tuple] | None:
    """The mesh and Explicit mesh axes that shard axis 0 of every batch leaf."""
    found = set()
    mesh = None
    for x in batch:
        sharding = getattr(jax.typeof(x), "sharding", None)
        if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
            return None
        axes = spec_axes(sharding.spec[0] if len(sharding.spec) else None)
        types = dict(
            zip(sharding.mesh.axis_names, sharding.mesh.axis_types, strict=True)
        )
        if not axes or any(types[a] != AxisType.Explicit for a in axes):
            return None
        found.add(axes)
        mesh = sharding.mesh
    if len(found) != 1:
        return None
    (axes,) = found
    for x in others:
        spec = getattr(jax.typeof(x).sharding, "spec", ())
        if any(set(spec_axes(e)) & set(axes) for e in spec):
            return None  # e.g. FSDP parameters: leave the layout to the compiler.
    return mesh, axes


def batch_mesh(
    args: list,
    kwargs: dict,
    state: Any,
    batch_idx: tuple[int, ...],
    axes_mode: str | tuple[str, ...],
    mesh_axes: Any,
) -> tuple[Any, tuple] | None:
    """The mesh and axes to run the device-local loop over, or None.

    ``axes_mode`` is ``"auto"`` (read the batch's Explicit sharding) or the
    checked ``mesh_axes`` tuple (take the mesh from ``jax.set_mesh``);
    ``mesh_axes`` is the user's value, for the error message.
    """
    batch = [x for i in batch_idx for x in jax.tree.leaves(args[i])]
    others = [
        x
        for i, a in enumerate(args)
        if i not in batch_idx
        for x in jax.tree.leaves(a)
        if _is_array(x)
    ] + [x for x in jax.tree.leaves((kwargs, state)) if _is_array(x)]
    if axes_mode == "auto":
        return _explicit_batch_axes(batch, others)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError(
            f"`mesh_axes`={mesh_axes!r} needs a mesh: call under `jax.set_mesh(mesh)`."
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


def _reduce_aux(a: jax.Array, spec: P, ws: jax.Array, axes: tuple) -> jax.Array:
    if spec != P():
        return a
    if jnp.issubdtype(a.dtype, jnp.bool_):
        return lax.psum(a.astype(jnp.int32), axes) > 0
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        return lax.psum(a, axes)
    shape = ws.shape + (1,) * (a.ndim - 1)
    wide = a.astype(jnp.promote_types(a.dtype, jnp.float32))
    num = lax.psum(ws.reshape(shape) * wide, axes)
    den = lax.psum(ws, axes).reshape(shape)
    safe = jnp.where(den > 0, den, 1.0)
    return jnp.where(den > 0, num / safe, 0.0).astype(a.dtype)


def device_local(
    run: Callable[..., tuple],
    call: Callable[..., tuple],
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

    ``run(args, kwargs, axes, unit, local, state)`` is `microbatch`'s scan and
    ``call(args, kwargs, state)`` one call of ``fun``; ``mesh`` and ``axes``
    come from `batch_mesh`, ``size`` is the global batch size. Returns
    ``(value, grads, aux, state)``, reduced over ``axes``.
    """
    n_dev = 1
    for a in axes:
        n_dev *= mesh.shape[a]
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

    aux_specs = None
    if has_aux:
        # Global shapes tell which aux leaves carry the micro-batch's rows.
        def global_aux():
            margs = list(args)
            for j in batch_idx:
                margs[j] = jax.tree.map(
                    lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:])[:, 0],
                    args[j],
                )
            return call(margs, kwargs, state)[2]

        aux_shapes = jax.eval_shape(global_aux)
        rows = size // k
        aux_specs = jax.tree.map(
            lambda s: P(None, axes) if s.ndim and s.shape[0] == rows else P(),
            aux_shapes,
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
            aux = jax.tree.map(
                lambda a, spec: _reduce_aux(a, spec, ws, axes), aux, aux_specs
            )
        return value, grads, aux, lstate

    def state_in(leaves):
        full = list(flat)
        for i, x in zip(dyn, leaves, strict=True):
            full[i] = x
        return jax.tree.unflatten(treedef, full)[2]

    out_specs = (P(), P(), aux_specs, P())
    mapped = jax.shard_map(
        inner, mesh=mesh, in_specs=specs, out_specs=out_specs, axis_names=set(axes)
    )
    return mapped(*(flat[i] for i in dyn))
