# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""One runner for every schedule: a loop over the table that dispatches each op.

Each tick, every device reads its cell of the table (op, micro-batch,
repeat) and the slots `plan` gave the values it needs, and runs one branch
of a ``lax.switch`` (op) over a ``lax.switch`` (variant). The variant is
the slot's role, decided in the index, never inside the differentiated
code: the stage's repeat, whether it embeds (stage 0) or ends in the loss
(stage ``S·R - 1``), and whether the micro-batch is frozen (weight 0 with
``has_aux``: its aux without its gradient). An idle cell, or a micro-batch
of weight 0 without ``has_aux``, takes the idle branch. So every branch is
straight-line code around one ``jax.vjp``: no ``lax.cond`` sits inside a
linearization, and no weight-sized residual is copied or zero-filled.

Two ways to run a backward (``split``):

- whole (GPipe, circular, 1F1B, interleaved 1F1B): F runs the stage and the
  stage input waits in a slot; the backward recomputes the slot under one
  ``jax.vjp`` and takes every gradient (what GPipe's remat and 1F1B keep);
- split (ZB-H1): F linearizes the stage once and keeps its residuals (not
  the parameters among them: `probe` reads from the traced program which
  residuals are parameters, and W puts the current ones back); B takes the
  input cotangent from them and keeps the stage output's cotangent; W takes
  the weight gradient from the same residuals. B computes no forward and no
  weight gradient, W no input gradient (XLA drops each unused half). The
  last stage linearizes at B, where its loss's cotangent is.

Gradients are summed in the accumulator dtype (`_dtypes`, per leaf), the
model always evaluated at the parameters themselves. Only a tick whose op
returns a gradient touches the sums: its branch runs under a ``lax.cond``
that adds in place, and every other tick (forwards, idle slots, a middle
stage's B) passes them through, with no weight-sized zeros or adds.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _sharding
from . import _schedule as sched
from ._plan import Residuals, paired, phases, plan, probe
from ._step import (
    Cells,
    Local,
    call_loss,
    call_stage,
    fill,
    microbatch,
    no_loss,
    ring,
    zeros,
)
from ._sums import accumulators, stacked, summed

IDLE, FORWARD, BACKWARD = sched.IDLE, sched.FORWARD, sched.BACKWARD
INPUT, WEIGHT = sched.INPUT, sched.WEIGHT


def _repeat(sp: Any, r: int) -> Any:
    """Repeat ``r``'s stage parameters, out of the ``(R, ...)`` stack."""
    return jax.tree.map(lambda v: v[r], sp)


def _get(buf: Any, slot: jax.Array) -> Any:
    return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, slot, 0, False), buf)


def _store(buf: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """``buf[slot] = value``, or ``buf`` unchanged where ``slot`` < 0."""
    i = jnp.maximum(slot, 0)
    old = lax.dynamic_index_in_dim(buf, i, 0, False)
    return lax.dynamic_update_index_in_dim(buf, jnp.where(slot >= 0, value, old), i, 0)


class _Slot:
    """The branches of one device's ops, each for a static role."""

    def __init__(self, ctx: Local, split: bool, residuals: Residuals | None):
        self.ctx, self.split, self.res = ctx, split, residuals
        self.vary = lambda a: _sharding.varying(a, ctx.axes)

    # The pieces of a slot, at micro-batch m of repeat r.
    def embed(self, mb):
        ctx = self.ctx
        return lambda fp: self.vary(ctx.pipe.first_fn(fp, mb).astype(ctx.h.dtype))

    def stage(self, m, r):
        ctx = self.ctx
        j = r * ctx.num_stages + ctx.stage
        return lambda sp, x: self.vary(
            call_stage(ctx.pipe, sp, x, ctx.key, m, j, ctx.shard)
        )

    def head(self, mb, m):
        ctx, last = self.ctx, self.ctx.num_stages * self.ctx.pipe.repeats

        def head(lp, y):
            loss, aux = call_loss(ctx.pipe, lp, y, mb, ctx.key, m, last, ctx.shard)
            loss = jnp.asarray(loss).astype(ctx.loss_dtype)
            loss = loss * ctx.scales[m].astype(ctx.loss_dtype)
            return self.vary(loss), jax.tree.map(self.vary, aux)

        return head

    def nil(self, tree: Any) -> Any:
        """Zeros like ``tree``: a gradient this op does not add to."""
        return zeros(jax.tree.map(jax.typeof, tree), self.ctx.axes)

    @property
    def probed(self) -> Residuals:
        """The split backward's residuals (only it keeps any)."""
        if self.res is None:  # pragma: no cover - a whole backward keeps none
            raise AssertionError("no residuals were probed for this runner.")
        return self.res

    def kept(self, vjp) -> tuple:
        leaves, source = jax.tree.leaves(vjp), self.probed.source
        if len(leaves) != len(source):  # pragma: no cover - a probe bug
            raise AssertionError("the stage's vjp differs from the probed one.")
        return tuple(self.vary(v) for v, j in zip(leaves, source, strict=True) if j < 0)

    def rebuild(self, kept: tuple, sp: Any):
        pleaves, it = jax.tree.leaves(sp), iter(kept)
        leaves = [pleaves[j] if j >= 0 else next(it) for j in self.probed.source]
        return jax.tree.unflatten(self.probed.treedef, leaves)

    def branch(self, op: int, r: int, first: bool, last: bool, frozen: bool):
        """The op's code for this role: straight-line, one linearization."""
        ctx, split = self.ctx, self.split

        def run(params, x_in, g_in, res_in, m):
            fp, sps, lp = params
            sp = _repeat(sps, r)
            if frozen:  # weight 0 with has_aux: values only, no gradient
                fp, sp, lp, x_in = lax.stop_gradient((fp, sp, lp, x_in))
            gf, gs, gl = (self.nil(t) for t in (fp, sp, lp))
            mb = microbatch(ctx.views, m)
            embed, stage, head = self.embed(mb), self.stage(m, r), self.head(mb, m)
            nothing = fill(ctx.h, ctx.axes)
            out_y, out_gx = nothing, nothing
            loss, aux = no_loss(ctx), zeros(ctx.aux, ctx.axes)
            res, wrote = res_in, jnp.bool_(False)

            def done():
                return out_y, out_gx, res, wrote, (gf, gs, gl), loss, aux

            if op == FORWARD:
                x = embed(fp) if first else x_in
                if split and not frozen:
                    out_y, vjp = jax.vjp(stage, sp, x)
                    res, wrote = (self.kept(vjp), res_in[1]), jnp.bool_(True)
                else:
                    out_y = stage(sp, x)
                return done()
            if frozen:  # the last stage's aux, at its backward
                x = embed(fp) if first else x_in
                _, aux = head(lp, stage(sp, x))
                return done()
            e_vjp = None
            if op == WEIGHT:
                gs, _ = self.rebuild(res_in[0], sp)(res_in[1])
                return done()
            if op == INPUT and not last:
                s_vjp = self.rebuild(res_in[0], sp)
                ct_y = g_in
                if first:
                    _, e_vjp = jax.vjp(embed, fp)
            else:  # the whole backward, or B of the last stage
                if first:
                    x, e_vjp = jax.vjp(embed, fp)
                else:
                    x = x_in
                y, s_vjp = jax.vjp(stage, sp, x)
                if last:
                    loss, h_vjp, aux = jax.vjp(head, lp, y, has_aux=True)
                    gl, ct_y = h_vjp(jnp.ones_like(loss))
                else:
                    ct_y = g_in
            gsp, gx = s_vjp(ct_y)
            if op == BACKWARD:
                gs = gsp
            else:  # B: W takes the weights' share from the residuals
                kept = self.kept(s_vjp) if last else res_in[0]
                res, wrote = (kept, self.vary(ct_y)), jnp.bool_(True)
            if first:
                (gf,) = e_vjp(gx)
            else:
                out_gx = self.vary(gx)
            return done()

        return run


def _roles(stages: int, repeats: int) -> set[tuple[int, bool, bool]]:
    """Every (repeat, first, last) a device can be in."""
    return {
        (r, r == 0 and s == 0, r == repeats - 1 and s == stages - 1)
        for r in range(repeats)
        for s in range(stages)
    }


def _adds(op: int, first: bool, last: bool, frozen: bool) -> bool:
    """Whether the op's branch for this role returns a gradient: every whole
    backward and W, and B where the stage embeds or ends in the loss (a
    frozen micro-batch's never)."""
    if frozen or op in (IDLE, FORWARD):
        return False
    return op != INPUT or first or last


def _dispatch(ctx: Local, split: bool, slot: _Slot):
    """``(branches, variants, adds)``: per op a function ``(variant,
    *args)``, the ``(5, R, 2, 2, 2)`` table of the variant of (op, repeat,
    first, last, frozen), -1 where the slot is idle, and the table of
    whether that variant returns a gradient (`_adds`)."""
    repeats = ctx.pipe.repeats
    ops = (FORWARD, INPUT, WEIGHT) if split else (FORWARD, BACKWARD)
    variants = np.full((5, repeats, 2, 2, 2), -1, np.int32)
    adds = np.zeros((5, repeats, 2, 2, 2), bool)
    branches = [None] * 5
    for op in ops:
        keys: list[tuple] = []
        for r, first, last in sorted(_roles(ctx.num_stages, repeats)):
            for frozen in (False, True) if ctx.pipe.has_aux else (False,):
                if op == FORWARD:
                    # The last stage's forward is its backward's (whole: it
                    # recomputes; split: it linearizes at B).
                    key = None if last else (r, first, False, frozen and split)
                elif frozen:  # only the last stage's aux, at its backward
                    key = (r, first, True, True) if last and op != WEIGHT else None
                elif op == WEIGHT:
                    key = (r, False, False, False)
                else:
                    key = (r, first, last, False)
                if key is None:
                    continue
                if key not in keys:
                    keys.append(key)
                at = (op, r, int(first), int(last), int(frozen))
                variants[at], adds[at] = keys.index(key), _adds(op, *key[1:])
        leaves = [slot.branch(op, *key) for key in keys]
        # None: no device runs this op alone (S = 1: the one stage is also
        # the last, whose forward is its backward's); `run` makes it idle.
        branches[op] = _switch(leaves) if leaves else None
    return branches, variants, adds


def _switch(leaves: list):
    if len(leaves) == 1:
        return lambda variant, *args: leaves[0](*args)
    return lambda variant, *args: lax.switch(variant, leaves, *args)


def _idle(variant, params, x_in, g_in, res_in, m, *, ctx):
    nothing = fill(ctx.h, ctx.axes)
    fp, sps, lp = params
    deltas = zeros(jax.tree.map(jax.typeof, (fp, _repeat(sps, 0), lp)), ctx.axes)
    aux = zeros(ctx.aux, ctx.axes)
    return nothing, nothing, res_in, jnp.bool_(False), deltas, no_loss(ctx), aux


def run(ctx: Local, params: tuple, table: sched.ScheduleTable, split: bool):
    """``(loss, grads, per-tick aux)`` of this device's share of the loss;
    the stage gradients stacked ``(R, ...)`` like this device's stages."""
    repeats = ctx.pipe.repeats
    ticks = _Ticks(ctx, params, table, split)
    if paired(table):
        carry, auxs = lax.scan(ticks.pair, ticks.init(), length=table.num_ticks // 2)
        auxs = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), auxs)
    else:
        carry, outs = ticks.init(), []
        for start, stop, send_f, send_b in phases(table, split):
            ops = table.op[start:stop]
            grad = bool(np.isin(ops, (BACKWARD, INPUT, WEIGHT)).any())
            body = functools.partial(
                ticks.tick, send_f=send_f, send_b=send_b, grad=grad
            )
            carry, out = lax.scan(body, carry, length=stop - start)
            outs.append(out)
        auxs = jax.tree.map(lambda *a: jnp.concatenate(a), *outs)
    *_, grads, total, _, _ = carry
    return total, stacked(grads, repeats), auxs


class _Ticks:
    """One device's loop over the table: the carry, one tick's op, the
    messages, and the pair of ticks interleaved 1F1B runs as one step."""

    def __init__(self, ctx: Local, params: tuple, table, split: bool):
        fp, sp, lp = params
        repeats = ctx.pipe.repeats
        # The (R, ...) stack as it came: each branch slices its own repeat
        # (a static slice), so the loop holds no second copy of the stack.
        self.ctx, self.split = ctx, split
        self.params = (fp, sp, lp)
        self.sums_like = (fp, _repeat(sp, 0) if repeats == 1 else sp, lp)
        self.layout = plan(table, split)
        self.cells = Cells(self.layout.cells)
        self.residuals = None
        if split:
            stage = _Slot(ctx, split, None).stage(jnp.zeros((), jnp.int32), 0)
            self.residuals = probe(stage, _repeat(sp, 0), zeros(ctx.h, ctx.axes))
        branches, variants, adds = _dispatch(
            ctx, split, _Slot(ctx, split, self.residuals)
        )
        idle = branches[IDLE] = functools.partial(_idle, ctx=ctx)
        branches = [b if b is not None else idle for b in branches]
        self.variants, self.adds = jnp.asarray(variants), jnp.asarray(adds)
        # Two switches: the ops that return a gradient, run where the sums
        # are added to; and every op without its gradient (a whole backward
        # or W only where a variant of it adds nothing: idle otherwise).
        valid = variants >= 0
        self.adding = branches[BACKWARD:]
        self.plain = [
            _no_deltas(b if (valid[op] & ~adds[op]).any() or op < BACKWARD else idle)
            for op, b in enumerate(branches)
        ]

    def buffer(self, n: int, like: Any) -> jax.Array:
        shape = jax.ShapeDtypeStruct((n, *like.shape), like.dtype)
        return fill(shape, self.ctx.axes)

    def init(self) -> tuple:
        """``(t, x slots, g slots, residual slots, sums, loss, messages)``."""
        ctx, layout = self.ctx, self.layout
        if self.residuals is not None:  # a split backward
            kept = tuple(self.buffer(layout.nr, k) for k in self.residuals.kept)
            rbuf = (kept, self.buffer(layout.nr, ctx.h))
        else:
            rbuf = ((), self.buffer(1, ctx.h))
        h = fill(ctx.h, ctx.axes)
        sums = accumulators(ctx, self.sums_like)
        xbuf, gbuf = self.buffer(layout.nx, ctx.h), self.buffer(layout.ng, ctx.h)
        return (jnp.int32(0), xbuf, gbuf, rbuf, sums, no_loss(ctx), h, h)

    def op(self, t, state, x_store, g_store, f_msg, b_msg, grad=True):
        """Tick ``t``'s op, the messages stored: ``(state, y, gx, aux)``."""
        ctx, repeats = self.ctx, self.ctx.pipe.repeats
        xbuf, gbuf, rbuf, grads, total = state
        op, m, r, _, _, x_slot, g_slot, r_slot = self.cells.at(t, ctx.stage)
        if x_store is not None:  # None: nothing arrives (a pair's second op)
            xbuf, gbuf = _store(xbuf, x_store, f_msg), _store(gbuf, g_store, b_msg)
        x_in = lax.dynamic_index_in_dim(xbuf, x_slot, 0, False)
        g_in = lax.dynamic_index_in_dim(gbuf, g_slot, 0, False)
        m, r = jnp.maximum(m, 0), jnp.maximum(r, 0)
        keep = ctx.keep[m]
        frozen = ~keep if ctx.pipe.has_aux else jnp.bool_(False)
        first = (ctx.stage == 0) & (r == 0)
        last = (ctx.stage == ctx.num_stages - 1) & (r == repeats - 1)
        flags = (first, last, frozen)
        cell = (op, r, *(f.astype(jnp.int32) for f in flags))
        variant = self.variants[cell]
        which = jnp.where((variant >= 0) & (keep | frozen), op, IDLE)
        # Buffers stay outside the switch: a branch returns what it made, so
        # no branch passes (and copies) a buffer it does not touch.
        args = (jnp.maximum(variant, 0), self.params, x_in, g_in)
        args += (_get(rbuf, r_slot), m)
        adds = self.adds[cell] & (which == op) if grad else None
        grads, (y, gx, res, wrote, loss, aux) = self.apply(which, adds, args, grads, r)
        at = jnp.where(wrote, r_slot, -1)
        rbuf = jax.tree.map(lambda b, v: _store(b, at, v), rbuf, res)
        return (xbuf, gbuf, rbuf, grads, total + loss), y, gx, aux

    def apply(self, which, adds, args, grads, r):
        """``(grads, outputs)`` of the tick's branch. A branch that returns
        a gradient runs under a ``lax.cond`` that takes the sums and adds
        it; every other tick passes them through (in place, no copy), so
        no tick zero-fills or adds a gradient it does not have. ``adds``
        None: a loop of forwards alone, which never adds."""
        repeats = self.ctx.pipe.repeats

        def adding(sums):
            i = jnp.maximum(which - BACKWARD, 0)
            y, gx, res, wrote, deltas, loss, aux = lax.switch(i, self.adding, *args)
            return summed(sums, deltas, r, repeats), (y, gx, res, wrote, loss, aux)

        def plain(sums):
            return sums, lax.switch(which, self.plain, *args)

        return plain(grads) if adds is None else lax.cond(adds, adding, plain, grads)

    def send(self, y, gx, send_f=True, send_b=True):
        ctx, stages = self.ctx, self.ctx.num_stages
        axis, nothing = ctx.pipe.stage_axis, fill(ctx.h, ctx.axes)
        f_msg = lax.ppermute(y, axis, ring(stages, 1)) if send_f else nothing
        b_msg = lax.ppermute(gx, axis, ring(stages, -1)) if send_b else nothing
        return f_msg, b_msg

    def tick(self, carry, _, send_f=True, send_b=True, grad=True):
        t, *state, f_msg, b_msg = carry
        _, _, _, x_store, g_store, *_ = self.cells.at(t, self.ctx.stage)
        state, y, gx, aux = self.op(t, state, x_store, g_store, f_msg, b_msg, grad)
        f_msg, b_msg = self.send(y, gx, send_f, send_b)
        return (t + 1, *state, f_msg, b_msg), aux

    def pair(self, carry, _):
        """Forwards on even ticks, backwards on odd ones (interleaved 1F1B):
        no message crosses within a pair, so one step runs both, with one
        ``ppermute`` per direction. The stage output sent at the even tick
        waits for the next step, as the cotangent of the odd tick does."""
        t, *state, f_msg, b_msg = carry
        x_store = self.cells.at(jnp.maximum(t - 1, 0), self.ctx.stage)[3]
        g_store = self.cells.at(t, self.ctx.stage)[4]
        state, y, _, aux_f = self.op(
            t, state, x_store, g_store, f_msg, b_msg, grad=False
        )  # a forward adds no gradient
        state, _, gx, aux_b = self.op(t + 1, state, None, None, f_msg, b_msg)
        f_msg, b_msg = self.send(y, gx)
        aux = jax.tree.map(lambda a, b: jnp.stack([a, b]), aux_f, aux_b)
        return (t + 2, *state, f_msg, b_msg), aux


def _no_deltas(branch):
    """``branch`` without the gradients it returns (XLA drops their code)."""

    def run(*args):
        y, gx, res, wrote, _, loss, aux = branch(*args)
        return y, gx, res, wrote, loss, aux

    return run
