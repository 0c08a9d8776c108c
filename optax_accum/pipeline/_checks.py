# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`pipeline.value_and_grad`'s checks: its options, and at trace time the
mesh, the parameters, the batch and the shapes `_run` derived.

This module only judges: it derives no layout and infers no shape (`_run`
does, and hands the results here). Each error names the argument in
backticks and says what would be accepted.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp

from .. import _checks, _dtypes, _reduction, _sharding, _weights
from . import _schedule as sched
from ._step import Pipeline

# "stacked": one leading axis of S·repeats, stage j at j. "repeats_by_stage":
# leading axes (repeats, S), stage r·S + s at [r, s], placed P(None, stage_axis).
STAGE_LAYOUTS = ("stacked", "repeats_by_stage")


def stage_layout(layout: Any) -> str:
    """``layout``, once it is one of `STAGE_LAYOUTS` (a ValueError if not)."""
    if layout not in STAGE_LAYOUTS:
        raise ValueError(
            f"`stage_layout` must be one of {STAGE_LAYOUTS}, got {layout!r}."
        )
    return layout


def options(pipe: Pipeline) -> Pipeline:
    """``pipe``, once its options are checked (construction time)."""
    for name in ("first_fn", "stage_fn", "loss_fn"):
        if not callable(getattr(pipe, name)):
            raise TypeError(f"`{name}` must be callable, got {getattr(pipe, name)!r}.")
    _checks.callable_or_none(pipe.weight_fn, "weight_fn")
    if not isinstance(pipe.stage_axis, str):
        raise TypeError(
            f"`stage_axis` must be a mesh axis name, got {pipe.stage_axis!r}."
        )
    # The stage count is the mesh's; 1 stands in until the call.
    sched.check_schedule(pipe.schedule, 1, pipe.num_microbatches, pipe.repeats)
    if pipe.schedule == "interleaved_1f1b" and pipe.repeats == 1:
        raise ValueError(
            "`schedule='interleaved_1f1b'` needs `repeats` >= 2 (stages per "
            "device), got `repeats`=1: with one stage per device it is 1F1B; "
            "pass `schedule='1f1b'`, or `repeats=2` or more."
        )
    stage_layout(pipe.stage_layout)
    data_axes = _checks.axis_names(pipe.data_axes, "data_axes")
    if data_axes is not None and pipe.stage_axis in data_axes:
        raise ValueError(
            f"`data_axes`={data_axes!r} must not name `stage_axis`="
            f"{pipe.stage_axis!r}: the stages are not data shards."
        )
    policy = _dtypes.canonical(pipe.accumulator_dtype)
    return Pipeline(
        **{
            **pipe.__dict__,
            "weight_fn": _real_weights(pipe.weight_fn),
            "reduction": _reduction.get(pipe.reduction),
            "accumulator_dtype": policy,
            "data_axes": data_axes,
        }
    )


def _real_weights(weight_fn: Any) -> Any:
    """``weight_fn``, refusing what a cast to the weight dtype would change:
    a complex weight (its imaginary part), or a non-number, as the loss
    face refuses them (`_weights.from_fn`)."""
    if weight_fn is None:
        return None

    @functools.wraps(weight_fn)
    def checked(mb):
        w = weight_fn(mb)
        _weights.from_fn(w, jnp.float32)  # raises; the caller casts
        return w

    return checked


def loss_pair(out: Any, has_aux: bool) -> tuple:
    """``(loss, aux)`` from what ``loss_fn`` returned (``aux`` None without
    ``has_aux``): with ``has_aux`` it must return a pair."""
    if not has_aux:
        return out
    if not (isinstance(out, tuple | list) and len(out) == 2):
        got = (
            f"{type(out).__name__} of length {len(out)}"
            if isinstance(out, tuple | list)
            else f"one {getattr(out, 'dtype', type(out).__name__)} array of "
            f"shape {getattr(out, 'shape', '()')}"
        )
        raise TypeError(
            "with `has_aux=True` the `loss_fn` must return (loss, aux), got "
            f"{got}; pass `has_aux=False` for a loss alone."
        )
    return tuple(out)


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


def _data_axes(pipe: Pipeline, mesh: Any) -> None:
    """The declared ``data_axes`` are axes of the mesh."""
    missing = [a for a in pipe.data_axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"`data_axes`={pipe.data_axes!r} names {missing}, not axes of the "
            f"current mesh (axes {tuple(mesh.axis_names)})."
        )


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


def _floating(params: Any) -> None:
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        if not _dtypes.is_differentiable(jnp.result_type(p)):
            raise TypeError(
                f"`params`{jax.tree_util.keystr(path)} is {jnp.result_type(p)}: "
                "the pipeline differentiates every parameter leaf, so each must "
                "be floating (or complex); keep integer state out of `params`."
            )


def _takes_key(pipe: Pipeline) -> None:
    for name in ("stage_fn", "loss_fn"):
        fn, n = getattr(pipe, name), 3 if name == "stage_fn" else 4
        try:
            inspect.signature(fn).bind(*range(n))
        except TypeError:
            raise TypeError(
                f"with `rng`, `{name}` is called with a key as argument {n} "
                f"(`{name}(..., key)`), but its signature {inspect.signature(fn)} "
                "does not take it."
            ) from None
        except ValueError:  # no signature to read (a builtin): let it run
            return


def check_call(pipe: Pipeline, params: Any, batch: Any, rng: Any, data_axes: tuple):
    """``(first, stage, last params, S)`` once the call is checked, ``data_axes``
    the declared data axes."""
    if not isinstance(params, (tuple, list)) or len(params) != 3:
        raise TypeError(
            "`params` must be `(first_params, stage_params, last_params)`, got "
            f"{type(params).__name__}."
        )
    fp, sp, lp = params
    stages = _stages(pipe)
    sched.check_schedule(pipe.schedule, stages, pipe.num_microbatches, pipe.repeats)
    _stage_params(pipe, sp, stages)
    _floating(params)
    if rng is not None:
        _takes_key(pipe)
    mesh = jax.sharding.get_abstract_mesh()
    if pipe.data_axes is not None:
        _data_axes(pipe, mesh)
    divisible(pipe, batch, data_axes, _sharding.mesh_size(mesh, data_axes))
    return fp, sp, lp, stages


def _stage_params(pipe: Pipeline, sp: Any, stages: int) -> None:
    """``stage_params`` leaves lead with the axes ``stage_layout`` says."""
    if pipe.stage_layout == "stacked":
        try:
            _leading(sp, "stage_params", stages * pipe.repeats)
        except ValueError as e:
            raise ValueError(
                f"{e} (S·repeats = {stages}·{pipe.repeats}: the size of "
                f"`stage_axis`={pipe.stage_axis!r} times `repeats`)."
            ) from None
        return
    want = (pipe.repeats, stages)
    sizes = {
        jax.tree_util.keystr(k): tuple(jnp.shape(v)[:2])
        for k, v in jax.tree_util.tree_leaves_with_path(sp)
    }
    if not sizes or any(s != want for s in sizes.values()):
        raise ValueError(
            "with `stage_layout='repeats_by_stage'` every `stage_params` leaf "
            f"must lead with (repeats, S) = {want} (`repeats` and the size of "
            f"`stage_axis`={pipe.stage_axis!r}), got {sizes}."
        )


def divisible(pipe: Pipeline, batch: Any, data_axes: tuple, size: int) -> None:
    """The batch splits into M micro-batches on each of ``size`` data shards."""
    rows = _leading(batch, "batch")
    m = pipe.num_microbatches
    if rows % (m * size):
        shards = f" times the {size} data shards of {data_axes}" if data_axes else ""
        raise ValueError(
            f"the batch size {rows} is not divisible by `num_microbatches`={m}"
            f"{shards} (= {m * size}): pass a batch of a multiple of {m * size} "
            "rows."
        )


def stage_input(h: Any) -> None:
    if not isinstance(h, jax.ShapeDtypeStruct):
        raise TypeError(f"`first_fn` must return one array, got {h}.")


def stage_output(h: jax.ShapeDtypeStruct, out: Any) -> None:
    """A stage keeps ``h``'s shape and dtype."""
    if getattr(out, "shape", None) != h.shape or getattr(out, "dtype", None) != h.dtype:
        raise ValueError(
            "`stage_fn` must return `h` with the shape and dtype it was given "
            f"({h.shape} {h.dtype}, from `first_fn`), got {out}."
        )


def loss_output(loss: Any) -> None:
    """``loss_fn``'s loss is a floating scalar."""
    shape, dtype = getattr(loss, "shape", None), getattr(loss, "dtype", None)
    if shape != ():
        raise ValueError(
            f"`loss_fn` must return a scalar loss (a mean over the micro-batch's "
            f"rows), got shape {shape}; with `has_aux`, `(loss, aux)`."
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"`loss_fn` must return a floating loss, got {dtype}: an integer "
            "loss has no gradient."
        )
