# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The frame around a pipeline schedule: checks, layout and ``shard_map``.

`call` checks the inputs against the mesh, lays the stacked stage parameters
out so that device ``s`` holds stages ``s, s + S, ...``, splits the batch
into micro-batches (micro-batch ``m`` is rows ``m, m+M, ...``, as in
`microbatch`), and runs the schedule's runner in one ``shard_map`` over the
stage axis and the axes that shard the batch's rows (the data axes). Every
parameter is cast to varying over those axes before the loop, so that each
device's gradient stays its own until the one ``psum`` after the loop: taken
from an invariant input, the cotangent would be summed over the stages
before the mask that keeps one stage's share.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from .. import _sharding
from . import _1f1b, _gpipe, _interleaved, _zb
from . import _schedule as sched
from ._checks import check_call, first_microbatch, stage_input
from ._step import Local, Pipeline, call_loss


def _layout(sp: Any, stages: int, repeats: int) -> Any:
    """``(S·R, ...)`` stacked stages to ``(S, R, ...)``: [s, r] is stage r·S+s."""
    if repeats == 1:
        return jax.tree.map(lambda v: v[:, None], sp)
    return jax.tree.map(
        lambda v: (
            _sharding.replicated(v)
            .reshape(repeats, stages, *v.shape[1:])
            .swapaxes(0, 1)
        ),
        sp,
    )


def _unlayout(gs: Any, stages: int, repeats: int) -> Any:
    if repeats == 1:
        return jax.tree.map(lambda v: v[:, 0], gs)
    return jax.tree.map(
        lambda v: _sharding.replicated(v.swapaxes(0, 1)).reshape(
            stages * repeats, *v.shape[2:]
        ),
        gs,
    )


def _place(tree: Any, spec: P) -> Any:
    """``tree``'s leaves resharded to ``spec`` where an Explicit mesh places
    them otherwise (``shard_map`` takes its inputs as its specs say)."""

    mesh = jax.sharding.get_abstract_mesh()
    if AxisType.Explicit not in tuple(mesh.axis_types):
        return tree

    def place(x):
        have = _sharding.explicit_spec(x) or P()
        if _sharding.same_spec(have, spec, x.ndim):
            return x
        return jax.sharding.reshard(x, spec)

    return jax.tree.map(place, tree)


def _like(grads: Any, params: Any) -> Any:
    """Gradients resharded like their Explicit-mesh parameters."""

    def like(g, p):
        spec = _sharding.explicit_spec(p)
        return g if spec is None else _place(g, spec)

    return jax.tree.map(like, grads, params)


def _views(batch: Any, m: int) -> Any:
    def view(x):
        x = _sharding.splittable(x, m)
        return x.reshape(x.shape[0] // m, m, *x.shape[1:])

    return jax.tree.map(view, batch)


def _scales(pipe: Pipeline, views: Any, data_axes: tuple[str, ...]) -> jax.Array:
    """Each micro-batch's share of the mean: ``w_m / Σ w`` over all devices."""
    m = pipe.num_microbatches
    if pipe.weight_fn is None:
        w = jnp.ones((m,), jnp.float32)
    else:
        mbs = jax.tree.map(lambda v: jnp.moveaxis(v, 1, 0), views)
        w = jax.vmap(lambda mb: jnp.asarray(pipe.weight_fn(mb), jnp.float32))(mbs)
        w = lax.stop_gradient(w)
    total = lax.psum(jnp.sum(w), data_axes) if data_axes else jnp.sum(w)
    return jnp.where(w > 0, w / total, 0.0)


def _aux_ticks(table: sched.ScheduleTable, pipe: Pipeline) -> np.ndarray:
    """The tick at which the last stage computes each micro-batch's loss."""
    op = {
        "1f1b": sched.BACKWARD,
        "interleaved_1f1b": sched.BACKWARD,
        "zb_h1": sched.INPUT,
    }.get(pipe.schedule, sched.FORWARD)
    last = table.op.shape[1] - 1
    ticks = np.zeros(pipe.num_microbatches, np.int32)
    for t in range(table.num_ticks):
        if table.op[t, last] == op and table.repeat[t, last] == pipe.repeats - 1:
            ticks[table.microbatch[t, last]] = t
    return ticks


def _body(pipe, stages, data_axes, table, h, aux, fp, sp, lp, views, key):
    axes = (pipe.stage_axis, *data_axes)
    fp, sp, lp = jax.tree.map(lambda x: _sharding.varying(x, axes), (fp, sp, lp))
    sp = jax.tree.map(lambda v: v[0], sp)  # this device's (R, ...) stages
    stage = lax.axis_index(pipe.stage_axis)
    ctx = Local(
        pipe, stage, stages, views, _scales(pipe, views, data_axes), key, h, aux, axes
    )
    runner = {
        "1f1b": _1f1b,
        "interleaved_1f1b": _interleaved,
        "zb_h1": _zb,
    }.get(pipe.schedule, _gpipe)
    loss, (gf, gs, gl), auxs = runner.run(ctx, (fp, sp, lp), table)
    gf, gl = lax.psum((gf, gl), axes)
    if data_axes:
        gs = lax.psum(gs, data_axes)
    gs = jax.tree.map(lambda v: v[None], gs)
    if aux is not None:
        ticks = _aux_ticks(table, pipe)
        auxs = lax.psum(jax.tree.map(lambda a: a[ticks], auxs), pipe.stage_axis)
    return lax.psum(loss, axes), (gf, gs, gl), auxs if aux is not None else None


def call(pipe: Pipeline, params: Any, batch: Any, rng: Any = None):
    """``(loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``)."""
    fp, sp, lp, stages, data_axes = check_call(pipe, params, batch)
    table = sched.schedule_table(
        pipe.schedule, stages, pipe.num_microbatches, pipe.repeats
    )
    views = _views(batch, pipe.num_microbatches)
    mb = first_microbatch(views, data_axes)
    h = stage_input(pipe, fp, sp, mb, rng)
    aux = None
    if pipe.has_aux:
        _, aux = jax.eval_shape(
            lambda lp, y, mb, k: call_loss(pipe, lp, y, mb, k, 0, 0), lp, h, mb, rng
        )
    rows = P(data_axes) if data_axes else P()
    stage_spec = P(pipe.stage_axis)

    def body(fp, sp, lp, views, key):
        return _body(pipe, stages, data_axes, table, h, aux, fp, sp, lp, views, key)

    run = jax.shard_map(
        body,
        in_specs=(P(), P(pipe.stage_axis), P(), rows, P()),
        out_specs=(P(), (P(), P(pipe.stage_axis), P()), P()),
        axis_names={pipe.stage_axis, *data_axes},
    )
    loss, (gf, gs, gl), auxs = run(
        _place(fp, P()),
        _place(_layout(sp, stages, pipe.repeats), stage_spec),
        _place(lp, P()),
        _place(views, rows),
        rng,
    )
    grads = _like((gf, _unlayout(gs, stages, pipe.repeats), gl), (fp, sp, lp))
    return ((loss, auxs), grads) if pipe.has_aux else (loss, grads)
