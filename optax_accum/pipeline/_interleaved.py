# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Interleaved 1F1B: 1F1B over ``S · repeats`` virtual stages.

Device ``s`` runs stages ``s, s + S, ...`` (repeat ``r`` is stage
``r·S + s``), one op per tick as the table says, the backward an explicit
``jax.vjp`` as in `_1f1b`. A stage output of device S-1 goes around the ring
to device 0's next repeat, a cotangent of device 0 back to device S-1's
previous one: the same two ``ppermute``s per tick.

Where a value waits is data too: `plan` reads the table and gives every
stage input and every pending cotangent a buffer slot for the ticks between
its arrival and its backward (a slot freed is reused), so the buffers hold
the table's most values in flight, O(S·r), flat in M. The runner knows
nothing of the schedule but the table: it runs a 1F1B table too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _schedule as sched
from ._1f1b import _store
from ._step import (
    Cells,
    Local,
    fill,
    forward,
    no_grads,
    no_loss,
    ring,
    stage_params,
    zeros,
)

# The op of the slot where the last stage computes a micro-batch's loss.
LOSS_OP = sched.BACKWARD


def _intervals(table: sched.ScheduleTable):
    """Per device, ``{(m, j): [arrival, backward tick]}`` for the stage
    inputs (``x``) and the cotangents (``g``) that arrive over the ring."""
    stages = table.op.shape[1]
    last = stages * (table.repeat.max() + 1) - 1
    x = [{} for _ in range(stages)]
    g = [{} for _ in range(stages)]
    for t, s in zip(*np.nonzero(table.op != sched.IDLE), strict=True):
        m, j = int(table.microbatch[t, s]), int(table.repeat[t, s] * stages + s)
        op, to = table.op[t, s], None
        if op == sched.FORWARD and j < last:
            to, key, into = (s + 1) % stages, (m, j + 1), x
        elif op == sched.BACKWARD and j > 0:
            to, key, into = (s - 1) % stages, (m, j - 1), g
        if op == sched.BACKWARD:
            for held in (x[s], g[s]):
                if (m, j) in held:
                    held[m, j][1] = int(t)
        if to is not None:
            into[to][key] = [int(t) + 1, None]
    return x, g


def _slots(live: dict, ticks: int) -> tuple[np.ndarray, dict, int]:
    """Greedy slots for one device's ``live`` intervals: ``(store, read,
    count)``, the slot written at each arrival tick and read at each
    backward tick (its forward reads the same one), or -1."""
    store = np.full(ticks, -1, np.int32)
    free_at: list[int] = []  # per slot, the first tick it is free again
    where = {}
    for key, (start, end) in sorted(live.items(), key=lambda kv: kv[1][0]):
        slot = next((i for i, f in enumerate(free_at) if f <= start), len(free_at))
        if slot == len(free_at):
            free_at.append(0)
        free_at[slot] = end + 1
        store[start], where[key] = slot, slot
    return store, where, len(free_at)


def plan(table: sched.ScheduleTable) -> tuple[tuple[np.ndarray, ...], int, int]:
    """``(cells, x slots, g slots)``: per tick and device the op, micro-batch,
    repeat, the slots the arriving stage output and cotangent go to, and the
    slots the op reads its stage input and cotangent from (0 where unused)."""
    ticks, stages = table.op.shape
    cols = [np.full((ticks, stages), -1, np.int32) for _ in range(2)]
    reads = [np.zeros((ticks, stages), np.int32) for _ in range(2)]
    sizes = [1, 1]
    for s, lives in enumerate(zip(*_intervals(table), strict=True)):
        for k, live in enumerate(lives):
            store, where, count = _slots(live, ticks)
            cols[k][:, s], sizes[k] = store, max(sizes[k], count)
            for t in np.nonzero(table.op[:, s] != sched.IDLE)[0]:
                key = (
                    int(table.microbatch[t, s]),
                    int(table.repeat[t, s] * stages + s),
                )
                reads[k][t, s] = where.get(key, 0)
    cells = (table.op, table.microbatch, table.repeat, *cols, *reads)
    return cells, sizes[0], sizes[1]


def _branches(ctx: Local):
    """Idle, forward and backward of one virtual stage, for `lax.switch`."""
    last_device = ctx.num_stages - 1

    def idle(params, x_in, g_in, m, r):
        grads = no_grads(ctx, params)
        h = fill(ctx.h, ctx.axes)
        return h, h, grads, no_loss(ctx), zeros(ctx.aux, ctx.axes)

    def fwd(params, x_in, g_in, m, r):
        y, _, _ = forward(ctx, params, x_in, m, r, True, with_loss=False)
        _, gx, grads, loss, aux = idle(params, x_in, g_in, m, r)
        return y, gx, grads, loss, aux

    def bwd(params, x_in, g_in, m, r):
        def f(params, x_in):
            y, loss, aux = forward(ctx, params, x_in, m, r, True)
            return (y, loss), aux

        (_y, loss), vjp, aux = jax.vjp(f, params, x_in, has_aux=True)
        last = (ctx.stage == last_device) & (r == ctx.pipe.repeats - 1)
        ct_y = jnp.where(last, jnp.zeros_like(g_in), g_in)
        grads, gx = vjp((ct_y, jnp.ones_like(loss)))
        return fill(ctx.h, ctx.axes), gx, grads, loss, aux

    return [idle, fwd, bwd]


def _add_at(stack, r, d):
    """``stack[r] += d`` on each leaf of the ``(R, ...)`` stage stack."""
    old = lax.dynamic_index_in_dim(stack, r, 0, False)
    return lax.dynamic_update_index_in_dim(stack, old + d, r, 0)


def run(ctx: Local, params: tuple, table: sched.ScheduleTable):
    """``(loss, grads, per-tick aux)`` of this device's share of the loss."""
    axis, stages = ctx.pipe.stage_axis, ctx.num_stages
    fp, sp, lp = params  # sp: this device's (R, ...) stages
    columns, nx, ng = plan(table)
    cells = Cells(columns)
    branches = _branches(ctx)

    def buffer(n):
        return fill(jax.ShapeDtypeStruct((n, *ctx.h.shape), ctx.h.dtype), ctx.axes)

    def tick(carry, _):
        t, xbuf, gbuf, f_msg, b_msg, grads, total = carry
        op, m, r, f_slot, b_slot, x_slot, g_slot = cells.at(t, ctx.stage)
        xbuf, gbuf = _store(xbuf, f_slot, f_msg), _store(gbuf, b_slot, b_msg)
        x_in = lax.dynamic_index_in_dim(xbuf, x_slot, 0, False)
        g_in = lax.dynamic_index_in_dim(gbuf, g_slot, 0, False)
        r = jnp.maximum(r, 0)
        cell = (fp, stage_params(sp, r), lp)
        y, gx, (df, ds, dl), loss, aux = lax.switch(
            op, branches, cell, x_in, g_in, m, r
        )
        gf, gs, gl = grads
        grads = (
            jax.tree.map(jnp.add, gf, df),
            jax.tree.map(lambda v, d: _add_at(v, r, d), gs, ds),
            jax.tree.map(jnp.add, gl, dl),
        )
        f_msg = lax.ppermute(y, axis, ring(stages, 1))
        b_msg = lax.ppermute(gx, axis, ring(stages, -1))
        return (t + 1, xbuf, gbuf, f_msg, b_msg, grads, total + loss), aux

    h = fill(ctx.h, ctx.axes)
    grads = no_grads(ctx, params)
    init = (jnp.int32(0), buffer(nx), buffer(ng), h, h, grads, no_loss(ctx))
    (*_, grads, total), auxs = lax.scan(tick, init, length=table.num_ticks)
    return total, grads, auxs
