# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""``aux_order="batch"``: row-wise ``aux`` leaves back in the batch's row order.

The loop stacks ``aux`` per micro-batch, ``(k, B/k, ...)``, and micro-batch
``i`` holds rows ``i, i+k, ...`` (`_call.views`). In the device-local mode
each of the ``n`` devices splits its own block of ``B/n`` rows so, and the
gather over devices puts device ``d``'s rows of micro-batch ``i`` at
``[i, d*m:(d+1)*m]`` (``m = B/(n k)``). Row ``d*(B/n) + j*k + i`` of the batch
is then ``aux[i, d*m + j]``: one transpose back to ``(B, ...)``, with no
gather. Which leaves hold rows is ``aux_rows``'s to declare; left ``None``, in
the global view a leaf whose axis 0 (after the stacking axis) is the
micro-batch's rows is taken as rows, and the device-local mode has already
flagged its leaves (`_local._RowLeaves`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .. import _sharding


def row_flags(aux: Any, declared: Any, rows: int) -> list[bool]:
    """Which leaves of the stacked ``aux`` hold a micro-batch's ``rows`` rows
    on axis 1: as ``declared`` (a bool or a pytree prefix of ``aux``), or,
    left ``None``, those whose axis 1 is that long."""
    paths_leaves = jax.tree_util.tree_leaves_with_path(aux)
    fits = [a.ndim >= 2 and a.shape[1] == rows for _, a in paths_leaves]
    if declared is None:
        return fits
    flags = jax.tree.leaves(
        jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: flag, sub), declared, aux)
    )
    for (path, _), flag, fit in zip(paths_leaves, flags, fits, strict=True):
        if flag and not fit:
            raise ValueError(
                f"`aux_rows` declares `aux` leaf {jax.tree_util.keystr(path)} "
                f'row-wise for `aux_order="batch"`, but its axis 0 is not the '
                f"{rows} rows of a micro-batch."
            )
    return flags


def in_batch_order(aux: Any, flags: Sequence[bool], k: int, n_dev: int = 1) -> Any:
    """The flagged leaves, ``(k, n_dev * m, ...)``, as ``(B, ...)`` in the
    batch's row order; the others as they are."""

    def batch_order(a: jax.Array) -> jax.Array:
        shape = (k * a.shape[1], *a.shape[2:])
        if n_dev == 1:
            # (B/k, k, ...) -> (B, ...) merges into the rows' axis, as the
            # batch was split: on an Explicit mesh it keeps the rows' spec.
            rows = jnp.swapaxes(a, 0, 1)
            spec = _sharding.explicit_spec(rows)
            if spec is None:
                return rows.reshape(shape)
            tail = tuple(spec)[2:] if len(spec) > 2 else ()
            head = spec[0] if len(spec) else None
            return jax.lax.reshape(rows, shape, out_sharding=P(head, *tail))
        m = a.shape[1] // n_dev
        blocks = a.reshape(k, n_dev, m, *a.shape[2:])
        return blocks.transpose(1, 2, 0, *range(3, a.ndim + 1)).reshape(shape)

    leaves, treedef = jax.tree.flatten(aux)
    return jax.tree.unflatten(
        treedef,
        [batch_order(a) if row else a for a, row in zip(leaves, flags, strict=True)],
    )
