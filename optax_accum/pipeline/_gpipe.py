# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""GPipe and circular: one forward scan over the table, ``jax.grad`` through it.

Each tick, every device runs its cell of the table's forward ticks and sends
its stage output one device on around the ring (device S-1 back to device 0,
which is where the circular schedule's next pass picks it up). The tick is
rematerialised, so the backward pass (the transposed scan, the table's
mirrored backward ticks) keeps one stage input per tick: O(M) activations,
what MaxText and Praxis save.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import _schedule as sched
from ._step import Cells, Local, fill, forward, no_loss, ring, stage_params

# The op of the slot where the last stage computes a micro-batch's loss.
LOSS_OP = sched.FORWARD


def run(ctx: Local, params: tuple, table: sched.ScheduleTable):
    """``(loss, grads, per-tick aux)`` of this device's share of the loss."""
    axis, stages = ctx.pipe.stage_axis, ctx.num_stages
    ticks = table.num_forward_ticks
    cells = Cells(tuple(a[:ticks] for a in table))

    def local_loss(params):
        fp, sp, lp = params

        @jax.checkpoint
        def tick(carry, _):
            t, incoming, total = carry
            op, m, r = cells.at(t, ctx.stage)
            cell = (fp, stage_params(sp, jnp.maximum(r, 0)), lp)
            y, loss, aux = forward(ctx, cell, incoming, m, r, op == sched.FORWARD)
            sent = lax.ppermute(y, axis, ring(stages, 1))
            return (t + 1, sent, total + loss), aux

        init = (jnp.int32(0), fill(ctx.h, ctx.axes), no_loss(ctx))
        (_, _, total), auxs = lax.scan(tick, init, length=ticks)
        return total, auxs

    (loss, auxs), grads = jax.value_and_grad(local_loss, has_aux=True)(params)
    return loss, grads, auxs
