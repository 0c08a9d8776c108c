# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""One pipeline slot: what a device computes for one (micro-batch, stage).

The runners (`_gpipe`, `_1f1b`) call `forward` once per
tick on every device of the stage axis, each with its own cell of the
schedule table. Device 0 on its first pass embeds the micro-batch
(``first_fn``), the last device on its last pass adds the scaled loss
(``loss_fn``); both sit in a `lax.cond`, so other devices skip them. A stage
input in an idle slot is replaced by zeros before anything reads it, so the
garbage that fills the bubbles never reaches a value or a gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _sharding

# What idle slots send and what buffers start with. The tests set it to NaN
# to check that no bubble reaches a value or a gradient.
BUBBLE_FILL = 0.0


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """`value_and_grad`'s checked options."""

    first_fn: Callable
    stage_fn: Callable
    loss_fn: Callable
    num_microbatches: int
    schedule: str
    repeats: int
    stage_axis: str
    weight_fn: Callable | None
    has_aux: bool


class Local(NamedTuple):
    """What every tick of one device reads (inside ``shard_map``)."""

    pipe: Pipeline
    stage: jax.Array  # this device's index along the stage axis
    num_stages: int
    views: Any  # the local batch as (rows, M, ...): micro-batch m is column m
    scales: jax.Array  # (M,) weight of each micro-batch over the total weight
    key: jax.Array | None
    h: jax.ShapeDtypeStruct  # the local stage input
    aux: Any  # loss_fn's aux, as ShapeDtypeStructs (None without has_aux)
    axes: tuple[str, ...]  # the manual axes: the stage axis and the data axes


def ring(num_stages: int, step: int) -> list[tuple[int, int]]:
    """``ppermute`` pairs that send device i's value to device i + step."""
    return [(i, (i + step) % num_stages) for i in range(num_stages)]


class Cells:
    """Static ``(ticks, S)`` int tables, read one cell per tick.

    They are constants of the program, so neither they nor a column of them
    is a buffer that grows with the number of ticks.
    """

    def __init__(self, tables: tuple):
        self.table = np.stack([np.asarray(a, np.int32) for a in tables], axis=-1)

    def at(self, t: jax.Array, stage: jax.Array) -> tuple[jax.Array, ...]:
        row = lax.dynamic_slice(
            jnp.asarray(self.table), (t, stage, 0), (1, 1, self.table.shape[-1])
        )
        return tuple(row[0, 0, i] for i in range(self.table.shape[-1]))


def microbatch(views: Any, m: jax.Array) -> Any:
    """Micro-batch ``m`` (rows ``m, m+M, ...``) of the ``(rows, M, ...)`` views."""
    return jax.tree.map(lambda v: lax.dynamic_index_in_dim(v, m, 1, False), views)


def fold(key: jax.Array, m: Any, j: Any) -> jax.Array:
    """The key of micro-batch ``m`` at stage ``j`` (``S·r``: the loss)."""
    return jax.random.fold_in(jax.random.fold_in(key, m), j)


def call_stage(pipe: Pipeline, sp: Any, x: jax.Array, key: Any, m: Any, j: Any):
    if key is None:
        return pipe.stage_fn(sp, x)
    return pipe.stage_fn(sp, x, fold(key, m, j))


def call_loss(pipe: Pipeline, lp: Any, y: jax.Array, mb: Any, key: Any, m: Any, j: Any):
    """``(loss, aux)`` of one micro-batch (aux None without ``has_aux``)."""
    args = (lp, y, mb) if key is None else (lp, y, mb, fold(key, m, j))
    out = pipe.loss_fn(*args)
    return out if pipe.has_aux else (out, None)


def zeros(like: Any, axes: tuple[str, ...]) -> Any:
    """Zeros shaped like ``like`` (ShapeDtypeStructs too), varying over ``axes``."""
    return jax.tree.map(
        lambda x: _sharding.varying(jnp.zeros(x.shape, x.dtype), axes), like
    )


def fill(like: Any, axes: tuple[str, ...]) -> Any:
    """`BUBBLE_FILL` shaped like ``like``, varying over ``axes``."""
    return jax.tree.map(lambda z: jnp.full_like(z, BUBBLE_FILL), zeros(like, axes))


def stage_params(sp: Any, r: jax.Array) -> Any:
    """This device's parameters for repeat ``r`` of its ``(R, ...)`` stack."""
    return jax.tree.map(lambda v: lax.dynamic_index_in_dim(v, r, 0, False), sp)


def forward(
    ctx: Local,
    params: tuple,
    x_in: jax.Array,
    m: Any,
    r: Any,
    active: Any,
    with_loss: bool = True,
):
    """One slot: ``(stage output, scaled loss, aux)``.

    ``params`` is ``(first, stage r's, last)``; ``x_in`` the stage input that
    arrived (ignored on device 0's first pass, which embeds the micro-batch).
    An idle slot sends `BUBBLE_FILL` and adds no loss; so does every slot
    without ``with_loss``.
    """
    fp, sp, lp = params
    pipe = ctx.pipe
    last = ctx.num_stages * pipe.repeats
    m = jnp.maximum(m, 0)  # idle cells say -1
    r = jnp.maximum(r, 0)
    mb = microbatch(ctx.views, m)
    is_first = active & (ctx.stage == 0) & (r == 0)
    is_last = active & (ctx.stage == ctx.num_stages - 1) & (r == pipe.repeats - 1)

    def embed(fp, mb, x_in):
        return _sharding.varying(pipe.first_fn(fp, mb).astype(x_in.dtype), ctx.axes)

    x = lax.cond(is_first, embed, lambda fp, mb, x_in: x_in, fp, mb, x_in)
    x = jnp.where(active, x, jnp.zeros_like(x))
    y = call_stage(pipe, sp, x, ctx.key, m, r * ctx.num_stages + ctx.stage)
    y = jnp.where(active, y, jnp.full_like(y, BUBBLE_FILL))
    if not with_loss:
        return (
            y,
            zeros(jax.ShapeDtypeStruct((), jnp.float32), ctx.axes),
            zeros(ctx.aux, ctx.axes),
        )

    def head(lp, y, mb, scale):
        loss, aux = call_loss(pipe, lp, y, mb, ctx.key, m, last)
        loss = jnp.asarray(loss, jnp.float32) * scale
        vary = lambda a: _sharding.varying(a, ctx.axes)
        return vary(loss), jax.tree.map(vary, aux)

    def skip(lp, y, mb, scale):
        return zeros(jax.ShapeDtypeStruct((), jnp.float32), ctx.axes), zeros(
            ctx.aux, ctx.axes
        )

    loss, aux = lax.cond(is_last, head, skip, lp, y, mb, ctx.scales[m])
    return y, loss, aux
