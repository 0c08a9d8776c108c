# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`pipeline.value_and_grad`'s checks: its options, and at trace time the
mesh, the stacked stage parameters, the batch and the stage input ``h``.

Each error names the argument in backticks and says what would be accepted.
"""

from __future__ import annotations

from typing import Any

import jax

from .. import _sharding
from . import _schedule as sched
from ._step import Pipeline, call_stage


def options(pipe: Pipeline) -> Pipeline:
    """``pipe``, once its options are checked (construction time)."""
    for name in ("first_fn", "stage_fn", "loss_fn"):
        if not callable(getattr(pipe, name)):
            raise TypeError(f"`{name}` must be callable, got {getattr(pipe, name)!r}.")
    if pipe.weight_fn is not None and not callable(pipe.weight_fn):
        raise TypeError(
            f"`weight_fn` must be callable or None, got {pipe.weight_fn!r}."
        )
    if not isinstance(pipe.stage_axis, str):
        raise TypeError(
            f"`stage_axis` must be a mesh axis name, got {pipe.stage_axis!r}."
        )
    # The stage count is the mesh's; 1 stands in until the call.
    sched.check_schedule(pipe.schedule, 1, pipe.num_microbatches, pipe.repeats)
    return pipe


def _stages(pipe: Pipeline) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or pipe.stage_axis not in mesh.axis_names:
        names = () if mesh.empty else tuple(mesh.axis_names)
        raise ValueError(
            f"`stage_axis`={pipe.stage_axis!r} is not an axis of the current mesh "
            f"(axes {names}); call the pipeline under `jax.set_mesh(mesh)` with a "
            "mesh that has it."
        )
    return mesh.shape[pipe.stage_axis]


def _leading(tree: Any, name: str, size: int | None = None) -> int:
    sizes = {
        jax.tree_util.keystr(k): jax.numpy.shape(v)[:1]
        for k, v in jax.tree_util.tree_leaves_with_path(tree)
    }
    if not sizes or any(not s for s in sizes.values()):
        raise ValueError(f"every leaf of `{name}` needs a leading axis, got {sizes}.")
    found = {s[0] for s in sizes.values()}
    if size is not None and found != {size}:
        raise ValueError(
            f"`{name}` leaves must have a leading axis of {size}, got {sizes}."
        )
    if len(found) > 1:
        raise ValueError(f"`{name}` leaves must share their leading size, got {sizes}.")
    return found.pop()


def check_call(pipe: Pipeline, params: Any, batch: Any):
    """``(first, stage, last params, S, data axes)`` once the call is checked."""
    if not isinstance(params, (tuple, list)) or len(params) != 3:
        raise TypeError(
            "`params` must be `(first_params, stage_params, last_params)`, got "
            f"{type(params).__name__}."
        )
    fp, sp, lp = params
    stages = _stages(pipe)
    sched.check_schedule(pipe.schedule, stages, pipe.num_microbatches, pipe.repeats)
    total = stages * pipe.repeats
    try:
        _leading(sp, "stage_params", total)
    except ValueError as e:
        raise ValueError(
            f"{e} (S·repeats = {stages}·{pipe.repeats}: the size of "
            f"`stage_axis`={pipe.stage_axis!r} times `repeats`)."
        ) from None
    mesh = jax.sharding.get_abstract_mesh()
    data_axes = tuple(
        a
        for a in mesh.axis_names
        if a in _sharding.row_axes(batch) and a != pipe.stage_axis
    )
    rows = _leading(batch, "batch")
    per = pipe.num_microbatches * _sharding.mesh_size(mesh, data_axes)
    if rows % per:
        raise ValueError(
            f"the batch size {rows} is not divisible by `num_microbatches`="
            f"{pipe.num_microbatches}"
            + (f" times the data axes {data_axes}' size." if data_axes else ".")
        )
    if pipe.has_aux and data_axes:
        raise ValueError(
            "`has_aux=True` with a batch sharded over the data axes "
            f"{data_axes} is not supported: aux is per micro-batch, not per shard."
        )
    return fp, sp, lp, stages, data_axes


def first_microbatch(views: Any, data_axes: tuple) -> Any:
    """One device's micro-batch, as ShapeDtypeStructs."""
    mesh = jax.sharding.get_abstract_mesh()
    d = _sharding.mesh_size(mesh, data_axes)
    return jax.tree.map(
        lambda v: jax.ShapeDtypeStruct((v.shape[0] // d, *v.shape[2:]), v.dtype), views
    )


def stage_input(pipe: Pipeline, fp: Any, sp: Any, mb: Any, rng: Any):
    """``h``, the stage input, after checking that a stage keeps it."""
    h = jax.eval_shape(pipe.first_fn, fp, mb)
    if not isinstance(h, jax.ShapeDtypeStruct):
        raise TypeError(f"`first_fn` must return one array, got {h}.")
    h = jax.ShapeDtypeStruct(h.shape, h.dtype)
    sp0 = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape[1:], v.dtype), sp)
    out = jax.eval_shape(
        lambda sp0, x, k: call_stage(pipe, sp0, x, k, 0, 0), sp0, h, rng
    )
    if getattr(out, "shape", None) != h.shape or getattr(out, "dtype", None) != h.dtype:
        raise ValueError(
            "`stage_fn` must return `h` with the shape and dtype it was given "
            f"({h.shape} {h.dtype}, from `first_fn`), got {out}."
        )
    return h
