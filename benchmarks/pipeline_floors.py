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
- `pipeline_free`: no pipeline; each of the S devices runs the whole
  sequential model on its M/S micro-batches, gradients summed once. The
  context for what micro-batching and a lock-step sync cost on this host.

The model is the tests' (``tests/pipeline/models.py``) with a mask of ones:
the loss is the mean over all rows, the mean of the equal micro-batches'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from tests.pipeline import models as md


def _microbatches(batch, m):
    """``(M, rows/M, ...)``: micro-batch ``m`` is rows ``m, m+M, ...``."""
    return jax.tree.map(
        lambda v: jnp.moveaxis(v.reshape(-1, m, *v.shape[1:]), 1, 0), batch
    )


def gpipe(mesh, num_microbatches: int, axis: str = "stage"):
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
            y = md.stage_fn(sp, x)
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
