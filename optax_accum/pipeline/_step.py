# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""One pipeline slot, and the policy every runner inherits from it.

A runner (`_gpipe`, `_1f1b`, any new schedule) is a module with
``run(ctx, params, table) -> (loss, grads, per-tick aux)``, called inside
the ``shard_map`` on every device of the stage axis. Its contract:

- ``params`` is ``(first, stage, last)`` already widened to the accumulator
  dtype (`widen`), the stage leaves this device's ``(R, ...)`` stack; every
  slot goes through `forward`, which narrows them back to the parameters'
  dtypes, so the gradients a runner sums (by ``jax.grad`` through its loop,
  or by adding ``jax.vjp`` cotangents into a carry built by `no_grads`) are
  summed in the accumulator dtype (`_dtypes.promote` by default);
- `forward` is the only place a slot computes: it runs ``stage_fn`` and
  ``loss_fn`` under `lax.cond`, so an idle slot, and every slot of a
  micro-batch whose weight is 0 (or rejected: NaN, infinite, negative),
  computes nothing that reaches a value or a gradient, whatever ``stage_fn``
  does at the `BUBBLE_FILL` it is sent;
- the loss a runner returns is the sum of `forward`'s losses, already scaled
  by each micro-batch's share (`scales`: `_weights` and `_reduction`, as
  the other faces), in ``ctx.loss_dtype`` (`no_loss` starts it);
- messages and buffers start as `fill`; the tick's aux comes from `forward`,
  and the module names ``LOSS_OP``, the `Op` of the table cell in which its
  last stage computes a micro-batch's loss (`_aux` reads the aux there);
- `_run.RUNNERS` maps the schedule's name to the module.

What the runner owns is only the order of the slots and the messages
between devices (``ppermute`` once per direction per tick).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _dtypes, _sharding, _weights

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
    reduction: Any = None  # a `_reduction` strategy
    accumulator_dtype: Any = _dtypes.PROMOTE
    data_axes: tuple[str, ...] | None = None  # None: not declared
    aux_rows: Any = None


class Local(NamedTuple):
    """What every tick of one device reads (inside ``shard_map``)."""

    pipe: Pipeline
    stage: jax.Array  # this device's index along the stage axis
    num_stages: int
    views: Any  # the local batch as (rows, M, ...): micro-batch m is column m
    scales: jax.Array  # (M,) each micro-batch's multiplier of its loss
    keep: jax.Array  # (M,) bool: the micro-batch's admitted weight is > 0
    key: jax.Array | None  # ``rng``
    shard: jax.Array | None  # this device's data shard (see `fold`)
    h: jax.ShapeDtypeStruct  # the local stage input
    aux: Any  # loss_fn's aux, as ShapeDtypeStructs (None without has_aux)
    axes: tuple[str, ...]  # the manual axes: the stage axis and the data axes
    dtypes: Any  # the parameters' own dtypes, (first, stage, last)
    loss_dtype: Any  # the dtype the losses are summed in


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
        # int32 indices throughout: under x64 a Python 0 would be int64.
        start = (jnp.int32(t), jnp.int32(stage), jnp.int32(0))
        row = lax.dynamic_slice(
            jnp.asarray(self.table), start, (1, 1, self.table.shape[-1])
        )
        return tuple(row[0, 0, i] for i in range(self.table.shape[-1]))


def microbatch(views: Any, m: jax.Array) -> Any:
    """Micro-batch ``m`` (rows ``m, m+M, ...``) of the ``(rows, M, ...)`` views."""
    return jax.tree.map(lambda v: lax.dynamic_index_in_dim(v, m, 1, False), views)


def fold(key: jax.Array, m: Any, j: Any, d: Any = None) -> jax.Array:
    """The key of micro-batch ``m`` at stage ``j`` (``S·r``: the loss):
    ``fold_in(fold_in(rng, m), j)``; on data shard ``d`` (the flat index over
    ``data_axes``) ``fold_in(fold_in(fold_in(rng, m), d), j)``, that is the
    key `microbatch` gives micro-batch ``m`` on device ``d``, folded with
    the stage."""
    key = jax.random.fold_in(key, m)
    if d is not None:
        key = jax.random.fold_in(key, d)
    return jax.random.fold_in(key, j)


def shard_index(data_axes: tuple[str, ...]) -> Any:
    """This device's data shard (None without data axes)."""
    return lax.axis_index(data_axes) if data_axes else None


def call_stage(pipe: Pipeline, sp: Any, x: jax.Array, key: Any, m: Any, j: Any, d=None):
    if key is None:
        return pipe.stage_fn(sp, x)
    return pipe.stage_fn(sp, x, fold(key, m, j, d))


def call_loss(
    pipe: Pipeline, lp: Any, y: jax.Array, mb: Any, key: Any, m: Any, j: Any, d=None
):
    """``(loss, aux)`` of one micro-batch (aux None without ``has_aux``)."""
    args = (lp, y, mb) if key is None else (lp, y, mb, fold(key, m, j, d))
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


def no_loss(ctx: Local) -> jax.Array:
    """A zero loss in the dtype losses are summed in."""
    return zeros(jax.ShapeDtypeStruct((), ctx.loss_dtype), ctx.axes)


def no_grads(ctx: Local, params: Any) -> Any:
    """Zero gradients of the (widened) ``params``: a runner's carry."""
    return zeros(jax.tree.map(jax.typeof, params), ctx.axes)


def accumulator_dtypes(params: Any, policy: Any) -> Any:
    """Each parameter's accumulator dtype under ``policy`` (`_dtypes`)."""
    return jax.tree.map(lambda p: _dtypes.for_gradient(p.dtype, policy), params)


def widen(params: Any, policy: Any) -> Any:
    """``params`` in their accumulator dtypes: what a runner differentiates,
    so the gradient sums over micro-batches run in that dtype."""
    return jax.tree.map(
        lambda p, d: p.astype(d), params, accumulator_dtypes(params, policy)
    )


def narrow(params: Any, dtypes: Any) -> Any:
    """Widened ``params`` back in their own dtypes (exact: they came from there)."""
    return jax.tree.map(lambda p, d: p.astype(d), params, dtypes)


def scales(pipe: Pipeline, views: Any, data_axes: tuple, dtype: Any):
    """``(multipliers, weights)``: each local micro-batch's multiplier of its
    loss, and its admitted weight (1 without ``weight_fn``).

    Weights follow `_weights` (NaN, infinite and negative weights are
    rejected: they weigh 0, as in `microbatch`), and the multipliers
    `_reduction`'s strategy over every data shard's weights.
    """
    m = pipe.num_microbatches
    if pipe.weight_fn is None:
        w = jnp.ones((m,), dtype)
    else:
        mbs = jax.tree.map(lambda v: jnp.moveaxis(v, 1, 0), views)

        def weight_of(mb):
            w = pipe.weight_fn(mb)
            if jnp.ndim(w) != 0:
                raise ValueError(
                    "`weight_fn` must return a scalar (the micro-batch's weight), "
                    f"got shape {jnp.shape(w)}."
                )
            return jnp.asarray(w, dtype)

        w = jax.vmap(weight_of)(mbs)
        w = _weights.admitted(lax.stop_gradient(w))
    devices = _sharding.mesh_size(jax.sharding.get_abstract_mesh(), data_axes)
    every = lax.all_gather(w, data_axes) if data_axes else w[None]
    multipliers = pipe.reduction.loop_scales(every.reshape(-1)).reshape(every.shape)
    here = multipliers[lax.axis_index(data_axes)] if data_axes else multipliers[0]
    parts = 1 if pipe.weight_fn is not None else devices
    divisor = pipe.reduction.loop_divisor(m * devices, parts)
    return here / jnp.asarray(divisor, dtype), w


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
    dy: Any = None,
):
    """One slot: ``(stage output, scaled loss, aux)``.

    ``params`` is ``(first, stage r's, last)``, widened; ``x_in`` the stage
    input that arrived (ignored on device 0's first pass, which embeds the
    micro-batch). An idle slot, or one of a micro-batch of weight 0, runs
    nothing: it sends `BUBBLE_FILL` and adds no loss; so does every slot
    without ``with_loss``. ``dy`` (zeros) is added to the stage output, the
    head's input: a runner differentiates by it for the cotangent there.
    """
    pipe = ctx.pipe
    fp, sp, lp = narrow(params, ctx.dtypes)
    last = ctx.num_stages * pipe.repeats
    m = jnp.maximum(m, 0)  # idle cells say -1
    r = jnp.maximum(r, 0)
    mb = microbatch(ctx.views, m)
    run = active & ctx.keep[m]
    is_first = run & (ctx.stage == 0) & (r == 0)
    is_last = run & (ctx.stage == ctx.num_stages - 1) & (r == pipe.repeats - 1)
    vary = lambda a: _sharding.varying(a, ctx.axes)

    def embed(fp, mb, x_in):
        return vary(pipe.first_fn(fp, mb).astype(x_in.dtype))

    def stage(sp, x):
        j = r * ctx.num_stages + ctx.stage
        return vary(call_stage(pipe, sp, x, ctx.key, m, j, ctx.shard))

    # A micro-batch of weight 0 still gives its aux, as on the other faces:
    # with has_aux its slots run on frozen (stop_gradient) inputs, which no
    # gradient reaches; without, they are idle.
    frozen = active & ~run if pipe.has_aux else jnp.bool_(False)
    freeze = lambda f: lambda *a: f(*lax.stop_gradient(a))
    x = lax.cond(
        (is_first | (frozen & (ctx.stage == 0) & (r == 0))),
        lambda fp, mb, x_in: lax.cond(run, embed, freeze(embed), fp, mb, x_in),
        lambda fp, mb, x_in: x_in,
        fp, mb, x_in,
    )  # fmt: skip
    idle = lambda sp, x: fill(ctx.h, ctx.axes)
    if pipe.has_aux:
        which = jnp.where(run, 2, jnp.where(frozen, 1, 0))
        y = lax.switch(which, [idle, freeze(stage), stage], sp, x)
    else:
        y = lax.cond(run, stage, idle, sp, x)
    if dy is not None:
        y = y + dy
    if not with_loss:
        return y, no_loss(ctx), zeros(ctx.aux, ctx.axes)

    def head(lp, y, mb, scale):
        loss, aux = call_loss(pipe, lp, y, mb, ctx.key, m, last, ctx.shard)
        loss = jnp.asarray(loss).astype(ctx.loss_dtype) * scale.astype(ctx.loss_dtype)
        return vary(loss), jax.tree.map(vary, aux)

    def aux_only(lp, y, mb, scale):
        _, aux = freeze(head)(lp, y, mb, scale)
        return no_loss(ctx), aux

    def skip(lp, y, mb, scale):
        return no_loss(ctx), zeros(ctx.aux, ctx.axes)

    at_last = (ctx.stage == ctx.num_stages - 1) & (r == pipe.repeats - 1)
    which = jnp.where(is_last, 2, jnp.where(frozen & at_last, 1, 0))
    args = (lp, y, mb, ctx.scales[m])
    loss, aux = lax.switch(which, [skip, aux_only, head], *args)
    return y, loss, aux
