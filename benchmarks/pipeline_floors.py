# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Hand-written pipeline floors: the least code that runs a schedule.

Each floor is one ``shard_map`` over the stage axis with one ``lax.scan``
over the ticks, no ``lax.cond`` and no options: an op that a tick does not
need is masked with ``jnp.where``. The benchmark compares each library
schedule with the floor of the same schedule; the tests
(``tests/pipeline/test_floors.py``) check that each floor's loss and
gradients equal ``jax.value_and_grad`` of the sequential model, so a floor
is a real floor and not a cheaper, wrong program.

- `gpipe`: every forward, then ``jax.grad`` of the forward scan (its
  transpose), each tick rematerialised (``jax.checkpoint``), as the
  library's GPipe keeps one stage input per tick.
- `gpipe` and `one_f_one_b` take ``stage_fn=`` (one device's stage), for
  the benchmark's two-layer stages beside circular and interleaved 1F1B.
- `pipeline_free`: no pipeline; each of the S devices runs the whole
  sequential model on its M/S micro-batches, gradients summed once. The
  context for what micro-batching and a lock-step sync cost on this host.

The model is the tests' (``tests/pipeline/models.py``) with a mask of ones:
the loss is the mean over all rows, the mean of the equal micro-batches'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from tests.pipeline import models as md


def _microbatches(batch, m):
    """``(M, rows/M, ...)``: micro-batch ``m`` is rows ``m, m+M, ...``."""
    return jax.tree.map(
        lambda v: jnp.moveaxis(v.reshape(-1, m, *v.shape[1:]), 1, 0), batch
    )


def gpipe(mesh, num_microbatches: int, axis: str = "stage", stage_fn=md.stage_fn):
    """``vg(params, batch) -> (loss, grads)``: GPipe by hand on ``axis``."""
    stages = mesh.shape[axis]
    m = num_microbatches
    perm = [(i, (i + 1) % stages) for i in range(stages)]

    def local(fp, sp, lp, batch):
        s = lax.axis_index(axis)
        sp = jax.tree.map(lambda v: v[0], sp)
        mbs = _microbatches(batch, m)

        @jax.checkpoint
        def tick(carry, t):
            h, loss = carry
            mb_in = jax.tree.map(lambda v: v[jnp.minimum(t, m - 1)], mbs)
            x = jnp.where(s == 0, md.first_fn(fp, mb_in), h)
            y = stage_fn(sp, x)
            out = t - (stages - 1)
            mb_out = jax.tree.map(lambda v: v[jnp.clip(out, 0, m - 1)], mbs)
            done = (s == stages - 1) & (out >= 0)
            loss = loss + jnp.where(done, md.loss_fn(lp, y, mb_out), 0.0)
            return (lax.ppermute(y, axis, perm), loss), None

        h0 = jnp.zeros_like(md.first_fn(fp, jax.tree.map(lambda v: v[0], mbs)))
        h0 = lax.pcast(h0, axis, to="varying")
        loss0 = lax.pcast(jnp.zeros((), h0.dtype), axis, to="varying")
        (_, loss), _ = lax.scan(tick, (h0, loss0), jnp.arange(m + stages - 1))
        return lax.psum(loss, axis) / m

    run = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P(axis), P(), P()), out_specs=P()
    )

    def loss(params, batch):
        fp, sp, lp = params
        return run(fp, jax.reshard(sp, P(axis)), lp, batch)

    return jax.value_and_grad(loss)


def pipeline_free(mesh, num_microbatches: int, axis: str = "stage"):
    """``vg(params, batch) -> (loss, grads)``: each device the whole model
    on its M/S micro-batches (rows sharded over ``axis``), no pipeline."""
    devices = mesh.shape[axis]
    m = num_microbatches // devices

    def local(params, batch):
        def step(loss, mb):
            return loss + md.sequential(params, mb), None

        mbs = _microbatches(batch, m)
        zero = lax.pcast(jnp.zeros((), jnp.float32), axis, to="varying")
        loss, _ = lax.scan(step, zero, mbs)
        return lax.psum(loss, axis) / num_microbatches

    run = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(axis)), out_specs=P())
    return jax.value_and_grad(
        lambda params, batch: run(params, jax.reshard(batch, P(axis)))
    )


def sequential():
    """``jax.value_and_grad`` of the sequential model on the whole batch."""
    return jax.value_and_grad(md.sequential)


def _one_f_one_b_cells(stages: int, m: int):
    """Per (tick, device): the branch index, micro-batch, slot, and the slots
    where the messages that arrive this tick go (-1: none). Slots are
    ``m % K``, K = 2S, checked free against the table."""
    from optax_accum import pipeline as pl

    table = pl.schedule_table("1f1b", stages, m)
    op, mb = table.op, table.microbatch
    k = 2 * stages
    ticks = op.shape[0]
    role = np.array([0] + [1] * (stages - 2) + [2])  # first, middle, last
    # Branches: 0 idle, 1 F first, 2 F (middle, last), 3 B first, 4 B middle,
    # 5 B last.
    branch = np.zeros_like(op)
    for t in range(ticks):
        for s in range(stages):
            if op[t, s] == 1:
                branch[t, s] = 1 if role[s] == 0 else 2
            elif op[t, s] == 2:
                branch[t, s] = 3 + role[s]
    in_x = np.full_like(op, -1)
    in_g = np.full_like(op, -1)
    for t in range(1, ticks):
        for s in range(stages):
            if s > 0 and op[t - 1, s - 1] == 1:
                in_x[t, s] = mb[t - 1, s - 1] % k
            if s < stages - 1 and op[t - 1, s + 1] == 2:
                in_g[t, s] = mb[t - 1, s + 1] % k
    # A slot is free when a value arrives: its previous micro-batch j - K
    # has run its backward on this device.
    for s in range(stages):
        done = {int(mb[t, s]): t for t in range(ticks) if op[t, s] == 2}
        for t in range(ticks):
            for src, sop in ((s - 1, 1), (s + 1, 2)):
                if 0 <= src < stages and t and op[t - 1, src] == sop:
                    j = int(mb[t - 1, src])
                    if j >= k and done[j - k] >= t:
                        raise AssertionError("1F1B floor: a slot reused too early.")
    return [np.asarray(a, np.int32) for a in (branch, np.maximum(mb, 0), in_x, in_g)], k


def _varying(axis: str):
    """``var(x)``: ``x`` marked varying over ``axis`` (as it is already, or
    by ``pcast``), so every branch returns per-device values."""

    def var(x):
        if axis in jax.typeof(x).mat.varying:
            return x
        return lax.pcast(x, axis, to="varying")

    return var


def _arrive(buf, slot, msg):
    """``buf[slot] = msg`` where a message arrives (``slot >= 0``)."""
    i = jnp.maximum(slot, 0)
    return buf.at[i].set(jnp.where(slot >= 0, msg, buf[i]))


def _send(y, gx, axis: str, stages: int):
    """One tick's messages: ``y`` to the next stage, ``gx`` to the previous."""
    fwd = [(i, (i + 1) % stages) for i in range(stages)]
    bwd = [(i, (i - 1) % stages) for i in range(stages)]
    return lax.ppermute(y, axis, fwd), lax.ppermute(gx, axis, bwd)


def _run_ticks(tick, init, cells, axis: str):
    """The scan over the table's ticks; the carry ends ``(..., grads, loss)``."""
    (*_, grads, loss), _ = lax.scan(tick, init, jnp.arange(cells[0].shape[0]))
    return _summed(loss, grads, axis)


def _staged(mesh, axis: str, local):
    """``vg(params, batch)``: ``local(fp, sp, lp, batch)`` in a shard_map
    with the stages one a device, their gradients returned so."""
    run = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(axis), P(), P()),
        out_specs=(P(), (P(), P(axis), P())),
    )

    def vg(params, batch):
        fp, sp, lp = params
        return run(fp, jax.reshard(sp, P(axis)), lp, batch)

    return vg


def _summed(loss, grads, axis: str):
    """Per-device loss and gradients to the floor's outputs: one psum at
    the end (none inside a branch); the stage's gradient stays local."""
    gf, gs, gl = grads
    gs = jax.tree.map(lambda v: v[None], gs)
    return lax.psum(loss, axis), (lax.psum(gf, axis), gs, lax.psum(gl, axis))


def _locals(axis, fp, sp, lp, batch, m):
    """What every floor's local function starts from: ``(var, mbs, h,
    (fp, sp, lp), zeros, nil, no_loss)``."""
    var = _varying(axis)
    sp = jax.tree.map(lambda v: v[0], sp)
    mbs = _microbatches(batch, m)
    h = jax.eval_shape(md.first_fn, fp, jax.tree.map(lambda v: v[0], mbs))
    fp, lp = jax.tree.map(var, (fp, lp))
    zeros = jax.tree.map(lambda v: var(jnp.zeros_like(v)), (fp, sp, lp))
    nil = var(jnp.zeros(h.shape, h.dtype))
    no_loss = var(jnp.zeros((), h.dtype))
    return var, mbs, h, (fp, sp, lp), zeros, nil, no_loss


def one_f_one_b(mesh, num_microbatches: int, axis: str = "stage", stage_fn=md.stage_fn):
    """``vg(params, batch) -> (loss, grads)``: 1F1B by hand on ``axis``: one
    ``lax.switch`` per tick (the op and the device's role), a backward
    recomputed under one ``jax.vjp`` from the kept stage input."""
    stages = mesh.shape[axis]
    m = num_microbatches
    cells, k = _one_f_one_b_cells(stages, m)

    def local(fp, sp, lp, batch):
        s = lax.axis_index(axis)
        var, mbs, h, (fp, sp, lp), zeros, nil, no_loss = _locals(
            axis, fp, sp, lp, batch, m
        )
        branch, mb_of, in_x, in_g = (jnp.asarray(c) for c in cells)

        def idle(x, g, mb):
            return nil, nil, zeros, no_loss

        def f_first(x, g, mb):
            return stage_fn(sp, md.first_fn(fp, mb)), nil, zeros, no_loss

        def f_mid(x, g, mb):
            return stage_fn(sp, x), nil, zeros, no_loss

        def b_first(x, g, mb):
            def f(fp, sp):
                return stage_fn(sp, md.first_fn(fp, mb))

            gf, gs = jax.vjp(f, fp, sp)[1](g)
            return nil, nil, (gf, gs, zeros[2]), no_loss

        def b_mid(x, g, mb):
            gs, gx = jax.vjp(stage_fn, sp, x)[1](g)
            return nil, gx, (zeros[0], gs, zeros[2]), no_loss

        def b_last(x, g, mb):
            def f(sp, lp, x):
                return md.loss_fn(lp, stage_fn(sp, x), mb) / m

            loss, vjp = jax.vjp(f, sp, lp, x)
            gs, gl, gx = vjp(jnp.ones_like(loss))
            return nil, gx, (zeros[0], gs, gl), loss

        branches = [idle, f_first, f_mid, b_first, b_mid, b_last]

        def tick(carry, t):
            xs, gs, f_msg, b_msg, grads, loss = carry
            xs, gs = _arrive(xs, in_x[t, s], f_msg), _arrive(gs, in_g[t, s], b_msg)
            j = mb_of[t, s]
            mb = jax.tree.map(lambda v: v[j], mbs)
            y, gx, d, dl = lax.switch(branch[t, s], branches, xs[j % k], gs[j % k], mb)
            grads = jax.tree.map(jnp.add, grads, d)
            f_msg, b_msg = _send(y, gx, axis, stages)
            return (xs, gs, f_msg, b_msg, grads, loss + dl), None

        buf = var(jnp.zeros((k, *h.shape), h.dtype))
        init = (buf, buf, nil, nil, zeros, no_loss)
        return _run_ticks(tick, init, cells, axis)

    return _staged(mesh, axis, local)


def _zb_cells(stages: int, m: int):
    """ZB-H1's table as (branch, micro-batch, x arrival slot, g arrival
    slot); slots ``m % K``, K = 3S, checked free (a value waits from its
    arrival to its W)."""
    from optax_accum import pipeline as pl

    table = pl.schedule_table("zb_h1", stages, m)
    op, mb = table.op, table.microbatch
    k, ticks = 3 * stages, op.shape[0]
    role = [0] + [1] * (stages - 2) + [2]
    # 0 idle, 1 F first, 2 F, 3 B first, 4 B middle, 5 B last, 6 W.
    branch = np.zeros_like(op)
    branch[op == 1] = 2
    branch[:, 0][op[:, 0] == 1] = 1
    branch[op == 4] = 6
    for s in range(stages):
        branch[:, s][op[:, s] == 3] = 3 + role[s]
    in_x, in_g = np.full_like(op, -1), np.full_like(op, -1)
    for t in range(1, ticks):
        for s in range(stages):
            if s > 0 and op[t - 1, s - 1] == 1:
                in_x[t, s] = mb[t - 1, s - 1] % k
            if s < stages - 1 and op[t - 1, s + 1] == 3:
                in_g[t, s] = mb[t - 1, s + 1] % k
    for s in range(stages):
        w_at = {int(mb[t, s]): t for t in range(ticks) if op[t, s] == 4}
        start = {int(mb[t, s]): t for t in range(ticks) if op[t, s] == 1}
        for t in range(1, ticks):
            if s > 0 and op[t - 1, s - 1] == 1:
                start[int(mb[t - 1, s - 1])] = t
        for j, t in start.items():
            if j >= k and w_at[j - k] >= t:
                raise AssertionError("ZB-H1 floor: a slot reused too early.")
    return [np.asarray(a, np.int32) for a in (branch, np.maximum(mb, 0), in_x, in_g)], k


def _zb_branches(params, mb_count: int, zeros, nil, no_loss) -> list:
    """ZB-H1's branches for the residual stage, each ``(x, g, t, u, mb) ->
    (y, gx, x', t', u', grads, loss)``; ``x', t', u'`` go back to the
    micro-batch's slots."""
    fp, sp, lp = params

    def idle(x, g, t, u, mb):
        return nil, nil, x, t, u, zeros, no_loss

    def forward(x):
        t = jnp.tanh(x @ sp["w"] + sp["b"])
        return x + t, t

    def f_first(x, g, t, u, mb):
        x = md.first_fn(fp, mb)
        y, t = forward(x)
        return y, nil, x, t, u, zeros, no_loss

    def f_mid(x, g, t, u, mb):
        y, t = forward(x)
        return y, nil, x, t, u, zeros, no_loss

    def input_grad(g, t):
        u = g * (1 - t * t)
        return g + u @ sp["w"].T, u

    def b_first(x, g, t, u, mb):
        gx, u = input_grad(g, t)
        (gf,) = jax.vjp(lambda fp: md.first_fn(fp, mb), fp)[1](gx)
        return nil, nil, x, t, u, (gf, zeros[1], zeros[2]), no_loss

    def b_mid(x, g, t, u, mb):
        gx, u = input_grad(g, t)
        return nil, gx, x, t, u, zeros, no_loss

    def b_last(x, g, t, u, mb):
        def head(lp, y):
            return md.loss_fn(lp, y, mb) / mb_count

        loss, vjp = jax.vjp(head, lp, x + t)
        gl, gy = vjp(jnp.ones_like(loss))
        gx, u = input_grad(gy, t)
        return nil, gx, x, t, u, (zeros[0], zeros[1], gl), loss

    def weight(x, g, t, u, mb):
        gs = {"w": x.T @ u, "b": u.sum(0)}
        return nil, nil, x, t, u, (zeros[0], gs, zeros[2]), no_loss

    return [idle, f_first, f_mid, b_first, b_mid, b_last, weight]


def zb_h1(mesh, num_microbatches: int, axis: str = "stage"):
    """``vg(params, batch) -> (loss, grads)``: ZB-H1 by hand for the tests'
    residual stage ``h + tanh(h W + b)``. F keeps ``t = tanh(h W + b)``;
    B computes only ``u = g (1 - t²)`` and the input cotangent ``g + u Wᵀ``
    and keeps ``u``; W computes ``hᵀ u`` and ``Σ u`` from the kept ``h``
    and ``u``: one matmul each, no recomputed forward."""
    stages = mesh.shape[axis]
    m = num_microbatches
    cells, k = _zb_cells(stages, m)

    def local(fp, sp, lp, batch):
        s = lax.axis_index(axis)
        var, mbs, h, params, zeros, nil, no_loss = _locals(axis, fp, sp, lp, batch, m)
        branch, mb_of, in_x, in_g = (jnp.asarray(c) for c in cells)
        branches = _zb_branches(params, m, zeros, nil, no_loss)

        def tick(carry, step):
            xs, gs, ts, us, f_msg, b_msg, grads, loss = carry
            xs = _arrive(xs, in_x[step, s], f_msg)
            gs = _arrive(gs, in_g[step, s], b_msg)
            j = mb_of[step, s]
            i = j % k
            mb = jax.tree.map(lambda v: v[j], mbs)
            y, gx, x, t, u, d, dl = lax.switch(
                branch[step, s], branches, xs[i], gs[i], ts[i], us[i], mb
            )
            xs, ts, us = xs.at[i].set(x), ts.at[i].set(t), us.at[i].set(u)
            grads = jax.tree.map(jnp.add, grads, d)
            f_msg, b_msg = _send(y, gx, axis, stages)
            return (xs, gs, ts, us, f_msg, b_msg, grads, loss + dl), None

        buf = var(jnp.zeros((k, *h.shape), h.dtype))
        init = (buf, buf, buf, buf, nil, nil, zeros, no_loss)
        return _run_ticks(tick, init, cells, axis)

    return _staged(mesh, axis, local)
