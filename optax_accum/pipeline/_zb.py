# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""ZB-H1: 1F1B with the backward split into B (input gradient) and W (weights).

The table (`_schedule._zero_bubble_h1`) says, per tick and device, F, B, W
or nothing. F runs the stage and keeps its input, as 1F1B does. B
recomputes the slot under ``jax.vjp`` from the input it kept, the stage's
weights held constant: it sends on the input cotangent and takes the
embedding's and the head's whole gradients, and the cotangent of the stage
output (`forward`'s ``dy``). The stage's own ``vjp`` over its weights is a
pytree whose leaves are its residuals, so B keeps them, with that
cotangent, in a pending slot (micro-batch mod S: the table holds at most S
pending). W rebuilds it from that slot and takes the stage weights'
cotangent. B computes no stage weight gradient and W no input gradient, and
no head's residual waits for W. The price: B linearizes the stage twice
(one more stage forward at B).

Residual leaves that are the parameters themselves are not kept (they are
the same at every tick); W puts the current parameters back in their place.
Activations are the S stage inputs of 1F1B plus S pending residual sets:
O(S), flat in M.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .. import _sharding
from . import _schedule as sched
from ._1f1b import arrivals
from ._step import Cells, Local, fill, forward, no_grads, no_loss, ring, zeros

# The op of the slot where the last stage computes a micro-batch's loss.
LOSS_OP = sched.INPUT


def _store(buf: Any, slot: jax.Array, value: Any) -> Any:
    """``buf[slot] = value`` leaf by leaf, or ``buf`` unchanged if slot < 0."""
    i = jnp.maximum(slot, 0)

    def put(b, v):
        old = lax.dynamic_index_in_dim(b, i, 0, False)
        return lax.dynamic_update_index_in_dim(b, jnp.where(slot >= 0, v, old), i, 0)

    return jax.tree.map(put, buf, value)


def _read(buf: Any, slot: jax.Array) -> Any:
    return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, slot, 0, False), buf)


class Split(NamedTuple):
    """How a ``vjp`` function's leaves are kept between B and W.

    ``source[i]`` is the index of the parameter leaf that residual ``i`` is,
    or -1 for a residual kept in the pending slot (``kept``: their shapes).
    """

    treedef: Any
    source: tuple[int, ...]
    kept: tuple[jax.ShapeDtypeStruct, ...]


def _vjp(ctx: Local, params: tuple, x_in: jax.Array, m: jax.Array):
    """B's ``(loss, vjp, aux)`` at micro-batch m: the slot's ``vjp`` over the
    embedding's and the head's weights, the input and the stage output (``dy``),
    the stage's weights held constant."""
    fp, sp, lp = params

    def f(fp, lp, x_in, dy):
        y, loss, aux = forward(ctx, (fp, sp, lp), x_in, m, 0, True, dy=dy)
        return (y, loss), aux

    dy = zeros(ctx.h, ctx.axes)
    (_y, loss), vjp, aux = jax.vjp(f, fp, lp, x_in, dy, has_aux=True)
    return loss, vjp, aux


def _stage_vjp(ctx: Local, params: tuple, x_in: jax.Array, m: jax.Array):
    """W's ``vjp``: the stage output over the stage's weights alone, so its
    residuals are the stage's (no head: the loss is not computed)."""
    fp, sp, lp = params

    def g(sp):
        return forward(ctx, (fp, sp, lp), x_in, m, 0, True, with_loss=False)[0]

    return jax.vjp(g, sp)[1]


def _sources(vjp: Any, params: tuple) -> tuple[Any, tuple[int, ...], list]:
    leaves, treedef = jax.tree.flatten(vjp)
    pleaves = jax.tree.leaves(params)
    source = tuple(
        next((j for j, p in enumerate(pleaves) if leaf is p), -1) for leaf in leaves
    )
    kept = [leaf for leaf, j in zip(leaves, source, strict=True) if j < 0]
    return treedef, source, kept


def probe(ctx: Local, params: tuple) -> Split:
    """The `Split` of this device's ``vjp`` function, traced once abstractly."""
    found = {}

    def trace(params, x_in, m):
        vjp = _stage_vjp(ctx, params, x_in, m)
        found["treedef"], found["source"], kept = _sources(vjp, params)
        return kept

    x = zeros(ctx.h, ctx.axes)
    kept = jax.eval_shape(trace, params, x, jnp.zeros((), jnp.int32))
    return Split(found["treedef"], found["source"], tuple(kept))


def _rebuild(split: Split, kept: list, params: tuple) -> Any:
    pleaves, it = jax.tree.leaves(params), iter(kept)
    leaves = [pleaves[j] if j >= 0 else next(it) for j in split.source]
    return jax.tree.unflatten(split.treedef, leaves)


def _branches(ctx: Local, split: Split):
    """Idle, F, B and W, one signature for `lax.switch` (indexed by `Op`)."""
    vary = lambda a: _sharding.varying(a, ctx.axes)

    def idle(params, x_in, g_in, m, entry):
        grads = no_grads(ctx, params)
        nothing = fill(ctx.h, ctx.axes)
        loss, aux = no_loss(ctx), zeros(ctx.aux, ctx.axes)
        return nothing, nothing, grads, loss, aux, entry

    def fwd(params, x_in, g_in, m, entry):
        y, _, _ = forward(ctx, params, x_in, m, 0, True, with_loss=False)
        return (y, *idle(params, x_in, g_in, m, entry)[1:])

    def input_grad(params, x_in, g_in, m, entry):
        # B: the input's, the embedding's and the head's gradients now; the
        # stage's residuals and its output's cotangent wait for W.
        loss, vjp, aux = _vjp(ctx, params, x_in, m)
        last = ctx.stage == ctx.num_stages - 1
        ct_y = jnp.where(last, jnp.zeros_like(g_in), g_in)
        gf, gl, gx, ct_stage = vjp((ct_y, jnp.ones_like(loss)))
        _, source, kept = _sources(_stage_vjp(ctx, params, x_in, m), params)
        if source != split.source:  # pragma: no cover - a probe bug
            raise AssertionError("B's vjp differs from the probed one.")
        entry = (tuple(vary(k) for k in kept), vary(ct_stage))
        _, nothing, (_, gs, _), _, _, _ = idle(params, x_in, g_in, m, entry)
        grads = jax.tree.map(vary, (gf, gs, gl))
        return nothing, vary(gx), grads, loss, aux, entry

    def weight_grad(params, x_in, g_in, m, entry):
        kept, ct_stage = entry
        (gs,) = _rebuild(split, list(kept), params)(ct_stage)
        nothing, _, (gf, _, gl), loss, aux, _ = idle(params, x_in, g_in, m, entry)
        return nothing, nothing, (gf, jax.tree.map(vary, gs), gl), loss, aux, entry

    return [idle, fwd, idle, input_grad, weight_grad]  # Op 2 is not in ZB-H1


def run(ctx: Local, params: tuple, table: sched.ScheduleTable):
    """``(loss, grads, per-tick aux)`` of this device's share of the loss."""
    axis, stages = ctx.pipe.stage_axis, ctx.num_stages
    fp, sp, lp = params
    params = (fp, jax.tree.map(lambda v: v[0], sp), lp)  # one stage each
    split = probe(ctx, params)
    f_in, b_in = arrivals(table, sched.INPUT)
    cells = Cells((table.op, table.microbatch, f_in, b_in))
    branches = _branches(ctx, split)

    def tick(carry, _):
        t, xbuf, gbuf, pending, f_msg, b_msg, grads, total = carry
        op, m, f_slot, b_slot = cells.at(t, ctx.stage)
        xbuf, gbuf = _store(xbuf, f_slot, f_msg), _store(gbuf, b_slot, b_msg)
        slot = jnp.maximum(m, 0) % stages
        x_in, g_in, entry = _read((xbuf, gbuf, pending), slot)
        y, gx, d, loss, aux, entry = lax.switch(
            op, branches, params, x_in, g_in, m, entry
        )
        pending = _store(pending, jnp.where(op == sched.INPUT, slot, -1), entry)
        grads = jax.tree.map(jnp.add, grads, d)
        f_msg = lax.ppermute(y, axis, ring(stages, 1))
        b_msg = lax.ppermute(gx, axis, ring(stages, -1))
        carry = (t + 1, xbuf, gbuf, pending, f_msg, b_msg, grads, total + loss)
        return carry, aux

    init = _init(ctx, params, split)
    (*_, grads, total), auxs = lax.scan(tick, init, length=table.num_ticks)
    gf, gs, gl = grads
    return total, (gf, jax.tree.map(lambda g: g[None], gs), gl), auxs


def _init(ctx: Local, params: tuple, split: Split) -> tuple:
    """The scan's first carry: empty buffers of S slots, zero sums."""
    stages = ctx.num_stages

    def slots(like):
        return jax.ShapeDtypeStruct((stages, *like.shape), like.dtype)

    pending = (tuple(slots(k) for k in split.kept), slots(ctx.h))
    return (
        jnp.int32(0),
        fill(slots(ctx.h), ctx.axes),
        fill(slots(ctx.h), ctx.axes),
        zeros(pending, ctx.axes),
        fill(ctx.h, ctx.axes),
        fill(ctx.h, ctx.axes),
        no_grads(ctx, params),
        no_loss(ctx),
    )
