# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The privacy face, `privacy.clipped_value_and_grad`, on a cell's batches.

Each row is an example: its loss is the cell's token-mean loss on a batch of
one (`runtime.loss`), so its gradient is its row ``c_r`` (NaN where the row
is). The cell's bad micro-batch carries padding: with ``weights="zeros"``
its rows weigh 0, and ``example_mask_fn`` marks them (``m > 0``); other
weights are refused (the face has no weights: a row is an example or
padding). Returns each call's pre-noise sum and mean loss; with
``axis_name`` (``shard_map`` or ``pmap``) each device's sum and loss, reduced
here over the devices
(`dp_accumulate` does it in its boundary; tests/privacy checks that).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum import privacy

from . import data
from . import runtime as rt
from .cells import Cell

CLIP_NORM = 1.25  # about half of the rows' gradients (|c_r| ~ 0.6 to 2.2) clip


def mask_fn(c: jax.Array, m: jax.Array) -> jax.Array:
    del c
    return m > 0


def build_fn(cell: Cell) -> Any:
    """The face as ``f(params, c, m) -> (value, grads)`` (may refuse)."""
    kw: dict[str, Any] = dict(batch_argnums=(1, 2))
    if cell.weights == "zeros":
        kw["example_mask_fn"] = mask_fn
    elif cell.weighted:  # no such option: refused by name
        kw["weight_fn"] = rt.weight_fn
    return privacy.clipped_value_and_grad(rt.loss(cell), CLIP_NORM, cell.k, **kw)


def _compiled(cell: Cell) -> Any:
    f = build_fn(cell)

    def call(p, c, m):
        value, grads = f(p, c, m)
        return value, grads["w"]

    if not cell.mapped:
        return jax.jit(call)

    def local(p, c, m):
        value, grad = call(p, c, m)
        n = jnp.sum(mask_fn(c, m)).astype(value.dtype)  # this device's examples
        total = jax.lax.psum(n, rt.AXIS)
        value = jax.lax.psum(value * n, rt.AXIS) / jnp.maximum(total, 1)
        return value, jax.lax.psum(grad, rt.AXIS)

    if cell.mode == "pmap":
        return jax.pmap(local, rt.AXIS, in_axes=(None, 0, 0))
    row = P(rt.AXIS)
    return jax.jit(
        jax.shard_map(
            local, mesh=rt.mesh(), in_specs=(P(), row, row), out_specs=(P(), P())
        )
    )


def run(cell: Cell, inputs: data.Inputs) -> dict[str, Any]:
    with rt.context(cell):
        params = rt.params(cell, inputs.w0)
        f = rt.cached((cell.structure(), "privacy"), lambda: _compiled(cell))
        steps = []
        for t in range(len(inputs.m)):
            c = rt.place(cell, inputs.c[t], rt.JNP_DTYPES[cell.dtype], rows=True)
            m = rt.place(cell, inputs.m[t], jnp.float32, rows=True)
            value, grad = f(params, c, m)
            if cell.mode == "pmap":  # replicated after the reduction
                value, grad = rt.first_device((value, grad))
            steps.append({"value": float(rt.to_np(value)), "grad": rt.to_np(grad)})
    return {"steps": steps}
