# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The runner's gradient sums: ``(first, stages, last)`` in the accumulator
dtypes (`_dtypes`, per leaf), each op's gradient added in place, the stage
sums one stage's shape with one repeat, an ``(R, ...)`` stack with more."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .. import _dtypes
from ._step import Local, zeros


def add(acc: Any, d: Any) -> Any:
    """``acc + d`` leaf by leaf in the accumulator's dtype (the arithmetic
    at least float32, as `_dtypes.compute` says)."""

    def one(a, g):
        c = _dtypes.compute(a.dtype)
        return (a.astype(c) + g.astype(c)).astype(a.dtype)

    return jax.tree.map(one, acc, d)


def _add_at(stack: jax.Array, r: jax.Array, d: jax.Array) -> jax.Array:
    """``stack[r] += d``, as `add` rounds it, updating the carry in place.

    Where the stack, ``d`` and their arithmetic share one dtype, a
    scatter-add touches the repeat's slab alone. A narrower stack (or
    ``d``) is added in `add`'s wider dtype over the whole stack, selected
    at ``r``. Not a dynamic slice then a dynamic update: the CPU compiler
    kept the slice as a weight-sized temporary buffer, where these two
    forms update the carry in place.
    """
    if stack.dtype == d.dtype == _dtypes.compute(stack.dtype):
        return stack.at[r].add(d)
    hit = (jnp.arange(stack.shape[0]) == r).reshape(-1, *([1] * d.ndim))
    return jnp.where(hit, add(stack, d[None]), stack)


def accumulators(ctx: Local, params: tuple) -> tuple:
    """Zero gradient sums of ``(first, stages, last)`` in the accumulator
    dtypes ``ctx.dtypes`` (the stages: one, or the ``(R, ...)`` stack)."""
    fd, sd, ld = ctx.dtypes
    fp, sp, lp = params

    def zero(tree, dtypes):
        like = jax.tree.map(lambda p, d: jax.ShapeDtypeStruct(p.shape, d), tree, dtypes)
        return zeros(like, ctx.axes)

    return zero(fp, fd), zero(sp, sd), zero(lp, ld)


def summed(grads: tuple, deltas: tuple, r: jax.Array, repeats: int) -> tuple:
    """The sums plus an op's gradients (the stages' at repeat ``r``)."""
    (gf, gs, gl), (df, ds, dl) = grads, deltas
    if repeats == 1:
        gs = add(gs, ds)
    else:
        gs = jax.tree.map(lambda a, d: _add_at(a, r, d), gs, ds)
    return add(gf, df), gs, add(gl, dl)


def stacked(grads: tuple, repeats: int) -> tuple:
    """The stage sums as an ``(R, ...)`` stack (with one repeat they are one
    stage's own shape in the loop)."""
    gf, gs, gl = grads
    if repeats == 1:
        gs = jax.tree.map(lambda g: g[None], gs)
    return gf, gs, gl
