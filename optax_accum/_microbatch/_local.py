# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`microbatch`'s device-local mode: the loop per device, one reduction after.

With ``data_axes`` the user declares that ``fun`` treats rows independently,
so each device can run the loop on its own rows inside ``jax.shard_map`` over
those axes. This module owns what that takes: the ``shard_map`` around the
loop, which inputs are the batch and which are cast to varying (so their
cotangents stay local), and reducing the threaded state and ``aux`` over the
devices. The mesh, and the check that the axes shard no parameter, are the
layout's (`_sharding.data_mesh`). The loop itself, and its one reduction of
values and gradients, are `_loop`'s.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from .. import _sharding, _weights
from . import _order
from ._loop import Loop, scan
from ._options import Context, Options


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array)


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
    return _weights.ratio(num, den.astype(num.dtype)).astype(a.dtype)


def device_local(
    fun: Any, args: list, kwargs: dict, state: Any, opts: Options, size: int
) -> Loop:
    """The loop per device in ``shard_map`` over ``opts.data_axes``; its one
    reduction runs inside. ``size`` is the global batch size."""
    others = [a for i, a in enumerate(args) if i not in opts.batch_idx]
    batch = [args[i] for i in opts.batch_idx]
    mesh = _sharding.data_mesh(batch, (others, kwargs, state), opts.data_axes)
    axes, k = opts.data_axes, opts.k
    n_dev = _sharding.mesh_size(mesh, axes)
    if (size // n_dev) % k:
        raise ValueError(
            f"each micro-batch must be spread over the {n_dev} devices of "
            f"mesh axes {axes}: the micro-batch size {size // k} (batch "
            f"{size} / `num_microbatches`={k}) is not divisible by {n_dev}."
        )
    flat, treedef = jax.tree.flatten((args, kwargs, state))
    flags = [
        jax.tree.map(lambda _, b=i in opts.batch_idx: b, a) for i, a in enumerate(args)
    ]
    is_batch = jax.tree.leaves((flags, *jax.tree.map(lambda _: False, (kwargs, state))))
    dyn = [i for i, x in enumerate(flat) if is_batch[i] or _is_array(x)]
    # Which aux leaves hold the micro-batch's rows (axis 1, after the stacking
    # axis) is declared (`aux_rows`), and checked against the device-local
    # shapes while the loop is traced, so `fun` never runs outside it.
    rows = _RowLeaves(size // k // n_dev, opts.aux_rows)

    def rebuild(leaves, cast):
        full = list(flat)
        for i, x in zip(dyn, leaves, strict=True):
            full[i] = _sharding.to_varying(x, axes) if cast and not is_batch[i] else x
        return jax.tree.unflatten(treedef, full)

    def per_device(*leaves):
        largs, lkwargs, lstate = rebuild(leaves, cast=True)
        out = scan(fun, list(largs), lkwargs, lstate, opts, Context(axes, local=True))
        new_state = jax.tree.map(
            lambda new, old: _reduce_state(new, old, axes),
            out.state,
            rebuild(leaves, cast=False)[2],
        )
        ws = jnp.ones((k,), jnp.float32) if out.weights is None else out.weights
        aux = rows.reduce(out.aux, ws, axes) if opts.has_aux else out.aux
        return out._replace(aux=aux, state=new_state, weights=None)

    mapped = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=tuple(P(axes) if is_batch[i] else P() for i in dyn),
        out_specs=Loop(P(), P(), P(None, axes), None, P(), P(), P()),
        axis_names=set(axes),
    )
    out = mapped(*(flat[i] for i in dyn))
    if not opts.has_aux:
        return out
    aux = rows.join(out.aux)
    if opts.aux_in_batch_order:
        aux = _order.in_batch_order(aux, rows.is_row, k, n_dev)
    return out._replace(aux=aux)


class _RowLeaves:
    """The ``aux`` leaves that hold a micro-batch's rows, as declared by
    ``aux_rows``: those are gathered over devices; the others are reduced
    inside and gain a device axis of length 1, so one out_spec serves every
    leaf. Undeclared, a leaf that could be either raises: a per-feature
    statistic as long as the rows per device must not be gathered by chance."""

    def __init__(self, rows_here: int, declared: Any):
        self.rows_here = rows_here
        self.declared = declared
        self.is_row: list[bool] = []

    def _flags(self, aux: Any) -> list[bool]:
        paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(aux)]
        leaves = jax.tree.leaves(aux)
        fits = [a.ndim >= 2 and a.shape[1] == self.rows_here for a in leaves]
        if self.declared is None:
            for path, fit in zip(paths, fits, strict=True):
                if fit:
                    raise ValueError(
                        f"`aux` leaf {jax.tree_util.keystr(path)} has "
                        f"{self.rows_here} entries on axis 0, the rows per device "
                        "of a micro-batch: it could be rows (to gather over "
                        "devices) or a statistic (to average). Declare which "
                        "with `aux_rows` (True, False, or a pytree prefix of aux)."
                    )
            return fits
        flags = jax.tree.leaves(
            jax.tree.map(
                lambda flag, sub: jax.tree.map(lambda _: flag, sub),
                self.declared,
                aux,
            )
        )
        for path, flag, fit in zip(paths, flags, fits, strict=True):
            if flag and not fit:
                raise ValueError(
                    f"`aux_rows` declares `aux` leaf {jax.tree_util.keystr(path)} "
                    f"row-wise, but its axis 0 is not the {self.rows_here} rows "
                    "per device of a micro-batch."
                )
        return flags

    def reduce(self, aux: Any, ws: jax.Array, axes: tuple) -> Any:
        leaves, aux_def = jax.tree.flatten(aux)
        self.is_row = self._flags(aux)
        return jax.tree.unflatten(
            aux_def,
            [
                a if row else _reduce_aux(a, ws, axes)[:, None]
                for a, row in zip(leaves, self.is_row, strict=True)
            ],
        )

    def join(self, aux: Any) -> Any:
        leaves, aux_def = jax.tree.flatten(aux)
        return jax.tree.unflatten(
            aux_def,
            [
                a if row else _sharding.replicated(a)[:, 0]
                for a, row in zip(leaves, self.is_row, strict=True)
            ],
        )
