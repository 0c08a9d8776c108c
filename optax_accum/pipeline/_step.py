# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The pieces every runner shares: options, the per-device context, keys,
weights, and the policy a slot follows.

A runner (`_gpipe`, `_1f1b`, `_zb`, `_interleaved`: each a table and
`_loop.run`) is a module with ``run(ctx, params, table) -> (loss, grads,
per-tick aux)``, called inside the ``shard_map`` on every device of the
stage axis, and ``LOSS_OP``, the `Op` of the table cell in which its last
stage computes a micro-batch's loss (`_aux` reads the aux there). Its
contract:

- ``params`` is ``(first, stage, last)`` in the parameters' own dtypes (the
  model is evaluated at them), the stage leaves this device's ``(R, ...)``
  stack; gradients are summed in the accumulator dtypes ``ctx.dtypes``
  (`_dtypes.resolve` of ``accumulator_dtype``, per leaf);
- an idle slot, and every slot of a micro-batch whose weight is 0 (or
  rejected: NaN, infinite, negative), computes nothing that reaches a value
  or a gradient, whatever ``stage_fn`` does at the `BUBBLE_FILL` it is sent;
  with ``has_aux`` a weight-0 micro-batch's slots run on frozen inputs for
  its aux;
- the loss is the sum of the slots' losses, each scaled by its
  micro-batch's share (`scales`: `_weights` and `_reduction`, as the other
  faces), in ``ctx.loss_dtype``;
- messages and buffers start as `fill`.
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
    stage_layout: str = "stacked"  # or "repeats_by_stage": (repeats, S, ...)


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
    dtypes: Any  # the accumulator dtypes of (first, stage, last)
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
