# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""1F1B: one op per device per tick, the backward an explicit ``jax.vjp``.

Nothing outside differentiates this loop: each backward tick recomputes its
stage's forward from the stage input it kept and takes the ``vjp`` there,
adding the parameters' cotangents to the carry. Device ``s`` keeps at most
``S - s`` micro-batches in flight (the table's rule), so two buffers of S
slots, indexed by micro-batch mod S, hold every stage input and pending
cotangent: activations are O(S), flat in M. A value that arrives (a stage
output from the device before, a cotangent from the one after) is written
into its slot at once, as the table says what the sender did a tick ago.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _schedule as sched
from ._step import Cells, Local, fill, forward, no_grads, no_loss, ring, zeros

# The op of the slot where the last stage computes a micro-batch's loss.
LOSS_OP = sched.BACKWARD


def arrivals(
    table: sched.ScheduleTable, back: int = sched.BACKWARD
) -> tuple[np.ndarray, np.ndarray]:
    """Per tick and device, the slot where the forward (backward) message
    that arrives goes, or -1: what the device before (after) did last tick.
    ``back`` is the op that sends a cotangent back (ZB-H1's B: `INPUT`)."""
    ticks, stages = table.op.shape
    f_in = np.full((ticks, stages), -1, np.int32)
    b_in = np.full((ticks, stages), -1, np.int32)
    for t in range(1, ticks):
        for s in range(stages):
            if s > 0 and table.op[t - 1, s - 1] == sched.FORWARD:
                f_in[t, s] = table.microbatch[t - 1, s - 1] % stages
            if s < stages - 1 and table.op[t - 1, s + 1] == back:
                b_in[t, s] = table.microbatch[t - 1, s + 1] % stages
    return f_in, b_in


def _store(buf: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    i = jnp.maximum(slot, 0)
    old = lax.dynamic_index_in_dim(buf, i, 0, False)
    return lax.dynamic_update_index_in_dim(buf, jnp.where(slot >= 0, value, old), i, 0)


def _branches(ctx: Local):
    """The idle, forward and backward ops, one signature for `lax.switch`."""

    def idle(params, x_in, g_in, m):
        return (fill(ctx.h, ctx.axes),) * 2 + (
            no_grads(ctx, params),
            no_loss(ctx),
            zeros(ctx.aux, ctx.axes),
        )

    def fwd(params, x_in, g_in, m):
        y, _, _ = forward(ctx, params, x_in, m, 0, True, with_loss=False)
        _, _, grads, loss, aux = idle(params, x_in, g_in, m)
        return y, fill(ctx.h, ctx.axes), grads, loss, aux

    def bwd(params, x_in, g_in, m):
        def f(params, x_in):
            y, loss, aux = forward(ctx, params, x_in, m, 0, True)
            return (y, loss), aux

        (_y, loss), vjp, aux = jax.vjp(f, params, x_in, has_aux=True)
        last = ctx.stage == ctx.num_stages - 1
        ct_y = jnp.where(last, jnp.zeros_like(g_in), g_in)
        grads, gx = vjp((ct_y, jnp.ones_like(loss)))
        return fill(ctx.h, ctx.axes), gx, grads, loss, aux

    return [idle, fwd, bwd]


def run(ctx: Local, params: tuple, table: sched.ScheduleTable):
    """``(loss, grads, per-tick aux)`` of this device's share of the loss."""
    axis, stages = ctx.pipe.stage_axis, ctx.num_stages
    fp, sp, lp = params
    params = (fp, jax.tree.map(lambda v: v[0], sp), lp)  # 1F1B: one stage each
    f_in, b_in = arrivals(table)
    cells = Cells((table.op, table.microbatch, f_in, b_in))
    branches = _branches(ctx)
    buffer = jax.ShapeDtypeStruct((stages, *ctx.h.shape), ctx.h.dtype)

    def tick(carry, _):
        t, xbuf, gbuf, f_msg, b_msg, grads, total = carry
        op, m, f_slot, b_slot = cells.at(t, ctx.stage)
        xbuf, gbuf = _store(xbuf, f_slot, f_msg), _store(gbuf, b_slot, b_msg)
        slot = jnp.maximum(m, 0) % stages
        x_in = lax.dynamic_index_in_dim(xbuf, slot, 0, False)
        g_in = lax.dynamic_index_in_dim(gbuf, slot, 0, False)
        y, gx, d, loss, aux = lax.switch(op, branches, params, x_in, g_in, m)
        grads = jax.tree.map(jnp.add, grads, d)
        f_msg = lax.ppermute(y, axis, ring(stages, 1))
        b_msg = lax.ppermute(gx, axis, ring(stages, -1))
        return (t + 1, xbuf, gbuf, f_msg, b_msg, grads, total + loss), aux

    grads = no_grads(ctx, params)
    init = (
        jnp.int32(0),
        fill(buffer, ctx.axes),
        fill(buffer, ctx.axes),
        fill(ctx.h, ctx.axes),
        fill(ctx.h, ctx.axes),
        grads,
        no_loss(ctx),
    )
    (*_, grads, total), auxs = lax.scan(tick, init, length=table.num_ticks)
    gf, gs, gl = grads
    return total, (gf, jax.tree.map(lambda g: g[None], gs), gl), auxs
