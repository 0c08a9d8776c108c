# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""``has_aux``: each micro-batch's aux, gathered from the tick that made it.

The last stage computes micro-batch ``m``'s loss, and its aux, in one slot
(the runner's ``LOSS_OP`` cell of the last repeat); the stacked result has a
leading axis of M. Over data shards the other faces' rule holds (see
`microbatch`'s ``aux_rows``): leaves declared row-wise (a micro-batch's rows
on their axis 0) are gathered over the data axes, the others reduced: a
weighted mean of floating leaves (by each shard's weight), a sum of integer
ones, an any of bool ones. A leaf whose axis 0 is as long as the rows per
shard must be declared, never guessed from its shape.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from .. import _weights
from . import _schedule as sched


def ticks(table: sched.ScheduleTable, loss_op: int, repeats: int) -> np.ndarray:
    """The tick at which the last stage computes each micro-batch's loss."""
    last = table.op.shape[1] - 1
    found = np.zeros(int(table.microbatch.max()) + 1, np.int32)
    for t in range(table.num_ticks):
        if table.op[t, last] == loss_op and table.repeat[t, last] == repeats - 1:
            found[table.microbatch[t, last]] = t
    return found


def row_flags(aux: Any, rows_here: int, declared: Any, data_axes: tuple) -> list:
    """Which aux leaves hold a micro-batch's rows (only over data axes)."""
    leaves_with_paths = jax.tree_util.tree_leaves_with_path(aux)
    if not data_axes:
        return [False] * len(leaves_with_paths)
    fits = [a.ndim >= 1 and a.shape[0] == rows_here for _, a in leaves_with_paths]
    if declared is None:
        for (path, _), fit in zip(leaves_with_paths, fits, strict=True):
            if fit:
                raise ValueError(
                    f"`aux` leaf {jax.tree_util.keystr(path)} has {rows_here} "
                    "entries on axis 0, the rows per data shard of a micro-batch: "
                    "it could be rows (to gather over the data axes) or a "
                    "statistic (to average). Declare which with `aux_rows` "
                    "(True, False, or a pytree prefix of aux)."
                )
        return fits
    flags = jax.tree.leaves(
        jax.tree.map(lambda f, sub: jax.tree.map(lambda _: f, sub), declared, aux)
    )
    for (path, _), flag, fit in zip(leaves_with_paths, flags, fits, strict=True):
        if flag and not fit:
            raise ValueError(
                f"`aux_rows` declares `aux` leaf {jax.tree_util.keystr(path)} "
                f"row-wise, but its axis 0 is not the {rows_here} rows per data "
                "shard of a micro-batch."
            )
    return [bool(f) for f in flags]


def specs(aux: Any, flags: list, data_axes: tuple) -> Any:
    """The ``shard_map`` out_specs of the stacked aux."""
    treedef = jax.tree.structure(aux)
    return jax.tree.unflatten(
        treedef, [P(None, data_axes) if f else P() for f in flags]
    )


def _reduce(a: jax.Array, w: jax.Array, axes: tuple) -> jax.Array:
    if jnp.issubdtype(a.dtype, jnp.bool_):
        return lax.psum(a.astype(jnp.int32), axes) > 0
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        return lax.psum(a, axes)
    w = w.reshape(w.shape + (1,) * (a.ndim - 1))
    wide = a.astype(jnp.promote_types(a.dtype, jnp.float32))
    # A weight-0 shard contributes nothing, even a NaN (select, not 0 * x).
    num = lax.psum(jnp.where(w > 0, w.astype(wide.dtype) * wide, 0), axes)
    den = lax.psum(w, axes).astype(num.dtype)
    return _weights.ratio(num, den).astype(a.dtype)


def collect(auxs: Any, at: np.ndarray, stage_axis: str, w, flags, data_axes) -> Any:
    """The per-tick aux of every device, as ``(M, ...)`` per micro-batch."""

    def one(a, row):
        picked = a[at]
        # Only the last stage holds it; the others hold zeros (bool: False).
        total = lax.psum(
            picked.astype(jnp.promote_types(a.dtype, jnp.int32)), stage_axis
        )
        total = total.astype(a.dtype)
        if row or not data_axes:
            return total
        return _reduce(total, w, data_axes)

    leaves, treedef = jax.tree.flatten(auxs)
    return jax.tree.unflatten(
        treedef, [one(a, f) for a, f in zip(leaves, flags, strict=True)]
    )
