# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The frame around a pipeline schedule: layout, shapes and ``shard_map``.

`call` checks the inputs against the mesh, lays the stacked stage parameters
out so that device ``s`` holds stages ``s, s + S, ...``, splits the batch
into micro-batches (micro-batch ``m`` is rows ``m, m+M, ...``, as in
`microbatch`), and runs the schedule's runner in one ``shard_map`` over the
stage axis and the declared data axes (``data_axes``). Every parameter is
cast to varying over those axes before the loop, so that each device's
gradient stays its own, summed in its accumulator dtype (the parameters
stay as they are: the model is evaluated at them), until the one ``psum``
after the loop: taken from an invariant input,
the cotangent would be summed over the stages before the mask that keeps one
stage's share. The gradients come back in the parameters' dtypes and
shardings (replicated where a parameter was placed nowhere).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from .. import _dtypes, _sharding
from . import _1f1b, _aux, _checks, _gpipe, _interleaved, _zb
from . import _schedule as sched
from ._step import Local, Pipeline, call_loss, call_stage, scales, shard_index

RUNNERS = {
    "gpipe": _gpipe,
    "circular": _gpipe,
    "1f1b": _1f1b,
    "interleaved_1f1b": _interleaved,
    "zb_h1": _zb,
}


def _layout(sp: Any, stages: int, repeats: int, layout: str) -> Any:
    """Stacked stages to ``(S, R, ...)``: [s, r] is stage r·S+s. From
    ``(R, S, ...)`` (``"repeats_by_stage"``) that is a local transpose: a
    device's stages are already its own."""
    if layout == "repeats_by_stage":
        return jax.tree.map(lambda v: v.swapaxes(0, 1), sp)
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


def _unlayout(gs: Any, stages: int, repeats: int, layout: str) -> Any:
    if layout == "repeats_by_stage":
        return jax.tree.map(lambda v: v.swapaxes(0, 1), gs)
    if repeats == 1:
        return jax.tree.map(lambda v: v[:, 0], gs)
    return jax.tree.map(
        lambda v: _sharding.replicated(v.swapaxes(0, 1)).reshape(
            stages * repeats, *v.shape[2:]
        ),
        gs,
    )


def _place(tree: Any, spec: P) -> Any:
    """``tree``'s leaves placed as ``spec`` says, where the mesh is Explicit
    (``shard_map`` takes its inputs as its specs say; a leaf placed nowhere
    is placed so)."""
    mesh = jax.sharding.get_abstract_mesh()
    if AxisType.Explicit not in tuple(mesh.axis_types):
        return tree
    return jax.tree.map(lambda x: jax.sharding.reshard(x, spec), tree)


def _like(grads: Any, params: Any) -> Any:
    """Gradients in their parameters' dtypes and shardings: a parameter
    placed nowhere gets a replicated gradient, so that `accumulate` and
    ``optax.MultiSteps`` take it beside the others."""

    def like(g, p):
        g = g.astype(jnp.result_type(p))
        return _place(g, _sharding.explicit_spec(p) or P())

    return jax.tree.map(like, grads, params)


def _manual_axes(pipe: Pipeline, data_axes: tuple, mesh: Any) -> set[str]:
    """The ``shard_map``'s manual axes: the stage and data axes, and on an
    Explicit mesh every other axis too. There the inputs are placed
    replicated over those (`_place`), so the result is the same; and XLA's
    CPU compiler aborts on bf16 gradient sums in a partly manual loop
    ("Invalid binary instruction opcode copy"). An Auto mesh keeps its other
    axes automatic, for the compiler to shard over."""
    if AxisType.Explicit in tuple(mesh.axis_types):
        return set(mesh.axis_names)
    return {pipe.stage_axis, *data_axes}


def _views(batch: Any, m: int) -> Any:
    def view(x):
        x = _sharding.splittable(x, m)
        return x.reshape(x.shape[0] // m, m, *x.shape[1:])

    return jax.tree.map(view, batch)


def data_axes_of(pipe: Pipeline, batch: Any) -> tuple[str, ...]:
    """The declared ``data_axes``; undeclared, none, and a batch whose rows an
    Explicit mesh axis shards is refused (the pipeline would gather it and run
    every data shard's rows on every replica)."""
    if pipe.data_axes is not None:
        return pipe.data_axes  # checked with the call (`_checks.check_call`)
    sharding = _sharding.batch_axes(batch, exclude=(pipe.stage_axis,))
    if sharding:
        raise ValueError(
            f"the batch's rows are sharded over {sharding} but `data_axes` is "
            f"not given; pass `data_axes={sharding!r}` (as in `microbatch`), or "
            "replicate the batch."
        )
    return ()


def _shapes(pipe: Pipeline, fp, sp, lp, views, data_axes, rng):
    """``(h, loss, aux)`` of one data shard's micro-batch, as ShapeDtypeStructs."""
    d = _sharding.mesh_size(jax.sharding.get_abstract_mesh(), data_axes)
    mb = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct((v.shape[0] // d, *v.shape[2:]), v.dtype), views
    )
    h = jax.eval_shape(pipe.first_fn, fp, mb)
    _checks.stage_input(h)
    h = jax.ShapeDtypeStruct(h.shape, h.dtype)
    lead = 2 if pipe.stage_layout == "repeats_by_stage" else 1
    sp0 = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape[lead:], v.dtype), sp)
    out = jax.eval_shape(lambda s, x, k: call_stage(pipe, s, x, k, 0, 0), sp0, h, rng)
    _checks.stage_output(h, out)
    loss, aux = jax.eval_shape(
        lambda lp, y, mb, k: _checks.loss_pair(
            call_loss(pipe, lp, y, mb, k, 0, 0), pipe.has_aux
        ),
        lp, h, mb, rng,
    )  # fmt: skip
    _checks.loss_output(loss)
    rows_here = jax.tree.leaves(mb)[0].shape[0]
    return h, loss, aux, rows_here


def _body(pipe, table, shapes, data_axes, params, views, key):
    h, loss, aux, flags, stages = shapes
    axes = (pipe.stage_axis, *data_axes)
    fp, sp, lp = params
    sp = jax.tree.map(lambda v: v[0], sp)  # this device's (R, ...) stages
    params = jax.tree.map(lambda x: _sharding.varying(x, axes), (fp, sp, lp))
    dtypes = _dtypes.resolve(pipe.accumulator_dtype, (fp, sp, lp))
    wdtype = _dtypes.weight_dtype((fp, sp, lp))
    mult, w = scales(pipe, views, data_axes, wdtype)
    loss_dtype = jnp.promote_types(loss.dtype, jnp.float32)
    ctx = Local(
        pipe, lax.axis_index(pipe.stage_axis), stages, views, mult, w > 0,
        key, shard_index(data_axes), h, aux, axes, dtypes, loss_dtype,
    )  # fmt: skip
    runner = RUNNERS[pipe.schedule]
    total, (gf, gs, gl), auxs = runner.run(ctx, params, table)
    gf, gl = lax.psum((gf, gl), axes)
    if data_axes:
        gs = lax.psum(gs, data_axes)
    gs = jax.tree.map(lambda v: v[None], gs)
    if aux is not None:
        at = _aux.ticks(table, runner.LOSS_OP, pipe.repeats)
        auxs = _aux.collect(auxs, at, pipe.stage_axis, w, flags, data_axes)
    value = lax.psum(total, axes).astype(loss.dtype)
    return value, (gf, gs, gl), auxs if aux is not None else None


def call(pipe: Pipeline, params: Any, batch: Any, rng: Any = None):
    """``(loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``)."""
    data_axes = data_axes_of(pipe, batch)
    fp, sp, lp, stages = _checks.check_call(pipe, params, batch, rng, data_axes)
    _dtypes.resolve(pipe.accumulator_dtype, (fp, sp, lp))  # raises early
    mesh = jax.sharding.get_abstract_mesh()
    table = sched.schedule_table(
        pipe.schedule, stages, pipe.num_microbatches, pipe.repeats
    )
    views = _views(batch, pipe.num_microbatches)
    h, loss, aux, rows_here = _shapes(pipe, fp, sp, lp, views, data_axes, rng)
    flags = _aux.row_flags(aux, rows_here, pipe.aux_rows, data_axes)
    rows = P(data_axes) if data_axes else P()
    stage_spec = P(pipe.stage_axis)
    aux_specs = _aux.specs(aux, flags, data_axes) if aux is not None else P()

    def body(params, views, key):
        shapes = (h, loss, aux, flags, stages)
        return _body(pipe, table, shapes, data_axes, params, views, key)

    run = jax.shard_map(
        body,
        in_specs=((P(), stage_spec, P()), rows, P()),
        out_specs=(P(), (P(), stage_spec, P()), aux_specs),
        axis_names=_manual_axes(pipe, data_axes, mesh),
    )
    layout = pipe.stage_layout
    if layout == "repeats_by_stage":  # each device's stages are its own already
        sp = _place(sp, P(None, pipe.stage_axis))
    laid = (
        _place(fp, P()),
        _place(_layout(sp, stages, pipe.repeats, layout), stage_spec),
    )
    loss, (gf, gs, gl), auxs = run((*laid, _place(lp, P())), _place(views, rows), rng)
    gs = _unlayout(gs, stages, pipe.repeats, layout)
    grads = _like((gf, gs, gl), (fp, sp, lp))
    return ((loss, auxs), grads) if pipe.has_aux else (loss, grads)
