# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`pipeline.value_and_grad`: the loss and gradients of a model split into stages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._microbatch import WeightFn
from . import _checks, _run
from ._schedule import Op as Op
from ._schedule import ScheduleTable as ScheduleTable
from ._schedule import bubble_fraction as bubble_fraction
from ._schedule import schedule_table as schedule_table
from ._step import Pipeline


def value_and_grad(
    first_fn: Callable,
    stage_fn: Callable,
    loss_fn: Callable,
    num_microbatches: int,
    *,
    schedule: str = "gpipe",
    repeats: int = 1,
    stage_axis: str = "stage",
    weight_fn: WeightFn | None = None,
    has_aux: bool = False,
    reduction: str = "mean",
    accumulator_dtype: Any = "promote",
    data_axes: str | tuple[str, ...] | None = None,
    aux_rows: Any = None,
    stage_layout: str = "stacked",
) -> Callable[..., Any]:
    """The loss and gradients of a model split into pipeline stages.

    The model is ``loss_fn(lp, stage_{L-1}(... stage_0(first_fn(fp, batch))),
    batch)`` with ``L = S · repeats`` stages, S the size of ``stage_axis``.
    The returned ``vg((first_params, stage_params, last_params), batch,
    rng=None)`` computes it in one ``shard_map`` over ``stage_axis`` (and
    ``data_axes``, whose gradient reduction runs once, after the loop), with
    one ``lax.scan`` over the ticks of `schedule_table`. Its result equals
    ``jax.value_and_grad`` of the sequential model on the whole batch (the
    weighted mean with ``weight_fn``), under the rules of the other faces:
    weights by the weight contract (0 leaves a micro-batch out; NaN, an
    infinity or a negative weight rejects it, as in
    `microbatch_value_and_grad`), gradient sums in the accumulator dtype, and
    idle slots that run neither ``stage_fn`` nor ``loss_fn``. The gradients
    have the structure, dtypes and shardings of the parameters (replicated
    where a parameter is placed nowhere; under ``jax.jit`` on an Auto mesh
    the compiler places them, and ``out_shardings`` pins them), so they feed
    `accumulate` and
    ``optax.MultiSteps``; the loss comes back in ``loss_fn``'s dtype.

    Args:
      first_fn: ``first_fn(first_params, microbatch) -> h`` (the embedding).
      stage_fn: ``stage_fn(stage_params, h) -> h`` (one stage; with ``rng``,
        ``stage_fn(stage_params, h, key)``); ``h`` keeps its shape and dtype.
      loss_fn: ``loss_fn(last_params, h, microbatch) -> loss``, a mean over
        its rows (with ``rng``, a fourth argument ``key``); with
        ``has_aux``, ``(loss, aux)``.
      num_microbatches: M. Micro-batch ``m`` is rows ``m, m+M, ...`` of the
        batch, as in `optax_accum.microbatch`.
      schedule: ``"gpipe"``, ``"circular"`` (needs M a multiple of S),
        ``"1f1b"`` (activations O(S), flat in M), ``"interleaved_1f1b"``
        (needs M a multiple of S and ``repeats`` >= 2; activations
        O(S · repeats), flat in M, with circular's time bubble) or
        ``"zb_h1"`` (zero-bubble ZB-H1: the
        backward split into an input gradient and a deferred weight
        gradient; activations O(S), flat in M).
      repeats: stages per device, for ``"circular"`` and
        ``"interleaved_1f1b"``: device ``s`` runs stages ``s, s + S, ...``.
      stage_axis: the mesh axis of the stages.
      weight_fn: ``weight_fn(microbatch) -> scalar``, e.g. the number of
        valid tokens: the loss is then ``Σ w_m loss_m / Σ w_m``. Over data
        axes each shard weighs its own rows.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` comes back
        stacked per micro-batch (over data axes, as ``aux_rows`` says).
      reduction: ``"mean"`` (the weighted mean) or ``"sum"`` (the weighted
        sum), as in `microbatch`.
      accumulator_dtype: the dtype the gradients are summed in over the
        micro-batches: ``"promote"`` (at least float32), a floating dtype,
        or ``None`` (the parameters' own), as in `microbatch`.
      data_axes: the mesh axes that shard the batch's rows (not
        ``stage_axis``), as in `microbatch`: each data shard runs the
        pipeline on its rows. Never guessed: left ``None`` with a batch
        whose rows an Explicit mesh axis shards, the call raises a
        ValueError that names the axes to pass.
      aux_rows: with ``data_axes`` and ``has_aux``: which ``aux`` leaves hold
        the micro-batch's rows on axis 0 (gathered over the data shards) and
        which are statistics (averaged), as in `microbatch`.
      stage_layout: how ``stage_params`` are stacked. ``"stacked"``: one
        leading axis of ``S · repeats``, stage ``j`` at slice ``j``.
        ``"repeats_by_stage"``: two leading axes ``(repeats, S)``, stage
        ``r · S + s`` at ``[r, s]`` (MaxText's circular layout); placed with
        ``P(None, stage_axis)``, every device already holds the stages it
        runs, so ``"circular"`` and ``"interleaved_1f1b"`` move no
        parameter over ``stage_axis`` (with ``"stacked"`` and ``repeats`` >=
        2 they are laid out once before the loop, and the gradients put
        back after it). The gradients come back in the same layout.

    Returns:
      ``vg(params, batch, rng=None) -> (loss, grads)`` (``((loss, aux),
      grads)`` with ``has_aux``), to call under ``jax.set_mesh(mesh)``.
      ``stage_params`` leaves are stacked with a leading axis of
      ``S · repeats`` (stage ``j`` is slice ``j``); placed with
      ``P(stage_axis)``, each stage's slice stays on its device. With ``rng``,
      stage ``j`` of micro-batch ``m`` gets ``fold_in(fold_in(rng, m), j)``
      and the loss ``j = S · repeats``; on data shard ``d`` (the flat index
      over ``data_axes``), ``fold_in(fold_in(fold_in(rng, m), d), j)``: the
      key `microbatch` gives micro-batch ``m`` on device ``d``, then the
      stage.

    Raises:
      ValueError: an unknown ``schedule``, ``repeats > 1`` with another
        schedule, ``"interleaved_1f1b"`` with ``repeats=1`` (that is
        ``"1f1b"``), M not a multiple of S for ``"circular"`` or
        ``"interleaved_1f1b"``; at the call, a
        mesh without ``stage_axis``, ``stage_params`` not stacked by
        ``S · repeats`` (or ``(repeats, S)``), an unknown ``stage_layout``,
        a batch size not divisible by M times the data shards, a
        ``stage_fn`` that changes ``h``'s shape or dtype, or a
        non-scalar loss or weight.
      TypeError: an integer parameter leaf, an integer loss, a complex (or
        non-numeric) weight from ``weight_fn``, a ``loss_fn`` that returns
        no ``(loss, aux)`` pair with ``has_aux``, or ``rng`` with a
        ``stage_fn`` or ``loss_fn`` that does not take a key.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from optax_accum import pipeline
      >>> first = lambda fp, b: b["x"] * fp
      >>> stage = lambda sp, h: jnp.tanh(h * sp)
      >>> loss = lambda lp, h, b: jnp.mean((h * lp - b["y"]) ** 2)
      >>> params = (jnp.float32(1.0), jnp.array([0.5, 2.0]), jnp.float32(3.0))
      >>> batch = {"x": jnp.linspace(-1.0, 1.0, 8), "y": jnp.ones(8)}
      >>> def sequential(p, b):
      ...     h = first(p[0], b)
      ...     for j in range(2):
      ...         h = stage(p[1][j], h)
      ...     return loss(p[2], h, b)
      >>> mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
      >>> vg = pipeline.value_and_grad(first, stage, loss, 4, schedule="1f1b")
      >>> with jax.set_mesh(mesh):
      ...     value, grads = jax.jit(vg)(params, batch)
      >>> want_value, want_grads = jax.value_and_grad(sequential)(params, batch)
      >>> bool(jnp.allclose(value, want_value)), grads[1].shape
      (True, (2,))
      >>> bool(jnp.allclose(grads[1], want_grads[1], rtol=1e-5))
      True
    """
    pipe = Pipeline(
        first_fn,
        stage_fn,
        loss_fn,
        num_microbatches,
        schedule,
        repeats,
        stage_axis,
        weight_fn,
        has_aux,
        reduction,
        accumulator_dtype,
        data_axes,
        aux_rows,
        stage_layout,
    )
    pipe = _checks.options(pipe)

    def vg(params: Any, batch: Any, rng: Any = None):
        out = _run.call(pipe, params, batch, rng)
        value, grads = out
        return value, _placed_like(grads, params)

    return vg


def _placed_like(grads: Any, params: Any) -> Any:
    """Gradients placed as their parameters are, where a parameter is a
    concrete array (a call outside ``jit``): on an Auto mesh the program's
    output placement is the compiler's choice, and a gradient reduced over
    the data axes comes back replicated. Under ``jit`` the parameters are
    tracers that carry no Auto placement; ``jit``'s ``out_shardings`` pins
    it there."""

    def like(g, p):
        if isinstance(p, jax.core.Tracer) or not isinstance(p, jax.Array):
            return g
        if isinstance(p.sharding, jax.sharding.NamedSharding) and (
            g.sharding != p.sharding
        ):
            return jax.device_put(g, p.sharding)
        return g

    try:
        return jax.tree.map(like, grads, params)
    except ValueError:  # a structure `_run` already refused
        return grads
