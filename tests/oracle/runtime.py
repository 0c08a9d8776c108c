# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""What every adapter shares: dtypes, the mesh, placing inputs, the cache.

Compiled functions are cached by `Cell.structure`, so cells that differ only
in their values (the weights' pattern, NaN rows, the seed) reuse one
compilation; values always travel as arrays.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from .cells import DEVICES, PIPE_STAGES, Cell

JNP_DTYPES = {
    "f32": jnp.float32,
    "bf16": jnp.bfloat16,
    "f16": jnp.float16,
    "f64": jnp.float64,
}
ACCS = {"promote": "promote", "none": None, "f32": jnp.float32}
AXIS = "d"
STAGE = "stage"  # the pipeline's stage axis
DECAY = 0.5  # noise_scale_decay


@functools.cache
def mesh() -> jax.sharding.Mesh:
    """8 CPU devices on one Explicit axis."""
    return jax.make_mesh((DEVICES,), (AXIS,))


@functools.cache
def pipeline_mesh(data: int) -> jax.sharding.Mesh:
    """The pipeline's mesh: ``(data, stage)``, the batch's rows over ``data``."""
    devices = jax.devices()[: data * PIPE_STAGES]
    return jax.make_mesh((data, PIPE_STAGES), (AXIS, STAGE), devices=devices)


def context(cell: Cell) -> contextlib.ExitStack:
    """x64 for f64 cells; the mesh for the global view, data_axes and the
    pipeline."""
    stack = contextlib.ExitStack()
    if cell.dtype == "f64":
        stack.enter_context(jax.enable_x64(True))
    if cell.pipeline:
        stack.enter_context(jax.set_mesh(pipeline_mesh(cell.devices)))
    elif cell.mode in ("global", "data_axes"):
        stack.enter_context(jax.set_mesh(mesh()))
    return stack


def place(cell: Cell, x: np.ndarray, dtype: Any, rows: bool) -> jax.Array:
    """An input: sharded over its rows (axis 0) on the mesh, or replicated."""
    a = jnp.asarray(x, dtype)
    if cell.mode in ("global", "data_axes"):
        return jax.device_put(a, P(AXIS) if rows else P())
    if cell.mode == "axis_name":
        return jax.device_put(a, jax.NamedSharding(mesh(), P(AXIS) if rows else P()))
    if cell.mode == "pmap" and rows:  # device d's rows on the leading axis
        return a.reshape(DEVICES, -1, *a.shape[1:])
    return a


def first_device(tree: Any) -> Any:
    """Device 0's copy of a ``pmap`` result."""
    return jax.tree.map(lambda x: x[0], tree)


def params(cell: Cell, w0: np.ndarray) -> dict:
    p = {"w": place(cell, w0, JNP_DTYPES[cell.dtype], rows=False)}
    if cell.float0:  # an integer parameter: its gradient is float0
        p["n"] = place(cell, np.int32(3), jnp.int32, rows=False)
    return p


def inner(cell: Cell) -> optax.GradientTransformation:
    """SGD or Adam; with an integer parameter, masked off its float0
    gradient (as optax needs; `accumulate` passes it through)."""
    # eps that fp16 can hold (see `model.Adam`).
    tx = optax.sgd(0.5) if cell.inner == "sgd" else optax.adam(0.1, eps=1e-4)
    if cell.float0:
        tx = optax.masked(tx, {"w": True, "n": False})
    return tx


def loss(cell: Cell) -> Callable:
    """The token-mean loss of `data`; with ``has_aux`` also the micro-batch's
    feature mean and per-row losses; with ``rng`` a key's draw added.

    The token weights stay float32 (they may be 2**±100) and the mean is
    taken in at least float32, then cast to the parameters' dtype, as a
    mixed-precision loss does."""

    def fn(p, c, m, key=None):
        wide = jnp.promote_types(c.dtype, jnp.float32)
        per_row = c @ p["w"]
        mean = lambda x: jnp.sum(m * x.astype(wide).T, axis=-1) / jnp.sum(m)
        v = mean(per_row).astype(c.dtype)
        if key is not None:
            u = jax.random.uniform(key, (cell.dim,), jnp.float32).astype(c.dtype)
            v = v + jnp.sum(u * p["w"])
        if cell.option == "has_aux":
            return v, {"feat": mean(c).astype(c.dtype), "rows": per_row}
        return v

    return fn


def weight_fn(c: jax.Array, m: jax.Array) -> jax.Array:
    """A micro-batch's token count."""
    del c
    return jnp.sum(m)


def to_np(x: Any) -> np.ndarray:
    """A result in float64 (bf16 through ml_dtypes), other kinds as they are."""
    a = np.asarray(x)
    return a if a.dtype.kind in "biu" else a.astype(np.float64)


_CACHE: dict[tuple, Any] = {}


def cached(key: tuple, build: Callable[[], Any]) -> Any:
    """``build()`` once per ``key`` (a cell's structure and a name)."""
    if key not in _CACHE:
        _CACHE[key] = build()
    return _CACHE[key]
