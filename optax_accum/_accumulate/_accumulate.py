# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`accumulate`: the per-call gradient-accumulation transformation.

This module owns the public face: `AccumulateState`, the `accumulate` factory
(which checks its options and builds the engine of `_engine`), and
`state_specs` for keeping the state across ``shard_map`` calls.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .. import _checks, _dtypes, _extra_args, _reduction, _schedules
from .. import _noise_scale as ns
from .._devices import Devices
from .._typing import AccumulatorDType, AxisName, Reduction
from . import _skip
from ._clip_warning import warn_if_clipped_before
from ._engine import Engine, Window, check_state


class AccumulateState(NamedTuple):
    """State of `accumulate`.

    Attributes:
      micro_step: int32, accepted micro-batches in the current window.
      update_step: int32, number of updates emitted so far (optimizer steps).
      accumulator: the weighted running mean (``reduction="mean"``) or the
        weighted sum (``reduction="sum"``) of the window's gradients, in
        ``accumulator_dtype``. A boundary resets the window logically
        (``micro_step`` and ``mean_weight`` return to 0) and the next accepted
        micro-batch overwrites the buffer; it is not zeroed in between, which
        would cost a full pass over it.
      mean_weight: the mean of the window's accepted weights (their sum is
        ``micro_step * mean_weight``; a mean cannot overflow), in float32, or
        float64 where the accumulator is.
      inner_state: the inner optimizer's state. Only boundary steps change it.
      num_skipped: int32, micro-batches rejected so far, by ``skip_fn`` or
        for a weight that is not finite or is negative.
      updated: bool, whether the last call emitted an update.
      skip_state: what ``skip_fn`` returned as its second output, if anything.
      value_accumulator: the window's running ``value`` (the loss passed to
        ``update``), accumulated like the gradients; a scalar when the inner
        optimizer reads ``value`` (``reduce_on_plateau``, line searches), else
        ``()``.
      noise_scale: a `NoiseScaleState` with ``noise_scale_decay``, else ``()``.
    """

    micro_step: jax.Array
    update_step: jax.Array
    accumulator: optax.Updates
    mean_weight: jax.Array
    inner_state: optax.OptState
    num_skipped: jax.Array
    updated: jax.Array
    skip_state: Any = ()
    value_accumulator: Any = ()
    noise_scale: Any = ()


def accumulate(
    inner: optax.GradientTransformation,
    every_k: _schedules.EveryK,
    *,
    reduction: Reduction = "mean",
    accumulator_dtype: AccumulatorDType = "promote",
    skip_fn: _skip.SkipFn | None = None,
    axis_name: AxisName | None = None,
    data_axes: AxisName | None = None,
    allow_value_fn: bool = False,
    noise_scale_decay: float | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Accumulates gradients over ``every_k`` micro-steps, then runs ``inner``.

    Each call adds one micro-batch's gradients to an accumulator. On the last
    micro-step of a window (the boundary) the reduced gradient is passed through
    ``inner`` inside a single ``jax.lax.cond`` and its updates are emitted. On
    every other step the updates are exact zeros and ``inner``'s state is
    untouched, so Adam's count, schedules, weight decay and clipping all see
    optimizer steps, never micro-steps.

    .. math::

        g = \frac{\sum_i w_i g_i}{\sum_i w_i} \quad (\text{mean}), \qquad
        g = \sum_i w_i g_i \quad (\text{sum}).

    With the number of valid tokens of micro-batch ``i`` as its ``weight`` and a
    token-mean loss per micro-batch, the mean is exactly the full-batch
    token-mean gradient.

    ``update`` takes extra keyword arguments: ``weight`` (a finite scalar
    >= 0, default 1; see **Weights**), ``close_window`` (a boolean scalar:
    when true, this micro-batch closes the window early and the update
    averages over what was accumulated, e.g. the last, partial window of an
    epoch; a rejected micro-batch that carries it still closes the window
    over the micro-batches accepted before it, and on an empty window it does
    nothing), and anything else, which reaches ``inner`` on the boundary
    step as the large batch would pass it: ``value`` (the micro-batch's
    loss) is accumulated like the gradients when ``inner`` reads it
    (``reduce_on_plateau``), ``grad`` is replaced by the accumulated
    gradient, and ``value_fn`` raises unless ``allow_value_fn``. Other extra
    args are forwarded as given on the boundary micro-step.

    **Weights** (the same contract as `microbatch`'s ``weight_fn``): a
    micro-batch of weight 0 contributes nothing, even if its gradients are
    NaN, and is no rejection (``skip_fn`` does not judge it; it counts
    towards ``every_k``); one whose weight is NaN, infinite or negative is
    rejected like a ``skip_fn`` rejection and counted in ``num_skipped``.
    Weights are held in float32 (float64 where the accumulator is float64):
    any finite positive weight from the smallest normal number up is
    honoured, and any number of them, since the window keeps the mean of its
    weights, not their sum, and its arithmetic runs at the accumulator's
    precision. A weight whose value is known when ``update`` runs (a Python
    or NumPy value, or a ``jax.Array`` in an eager call) raises if it is
    negative, not finite or does not fit (1e39, or a subnormal 1e-40 in
    float32); under ``jit`` it is traced, so a bad one is rejected and
    counted instead, and a traced subnormal weight is flushed to 0 by XLA and
    weighs 0. A window whose weights sum to 0 (all padding) emits zeros and
    leaves ``inner``'s state and ``update_step`` untouched, like a hold step.

    Under ``jax.vmap``, ``lax.cond`` with a batched predicate runs both
    branches, so the inner optimizer then runs on every micro-step. On GPU
    the ``lax.cond`` is a loop of at most one trip (XLA:GPU would turn the
    conditional into selects and run ``inner`` on every micro-step), except
    where ``update`` itself is differentiated (``jax.grad`` through it).

    Args:
      inner: the optimizer to run on the accumulated gradient.
      every_k: micro-steps per update, an int >= 1, or a callable of
        ``update_step`` returning it (traced, so a schedule of k does not
        recompile). A traced value below 1 is treated as 1.
      reduction: ``"mean"`` (weighted mean) or ``"sum"`` (weighted sum).
      accumulator_dtype: ``"promote"`` (the default): each gradient's dtype
        promoted to at least float32, of its own kind (bf16 and fp16
        accumulate in float32, float64 and complex stay as they are); a
        floating or complex dtype; or ``None`` for each gradient's own dtype.
        Or a pytree prefix of the parameters with one of these per subtree,
        e.g. ``{"embed": jnp.bfloat16, "layers": "promote"}``; a narrow
        (bf16, fp16) buffer keeps a running mean, as a scalar one does.
        Emitted updates have ``inner``'s dtypes.
      skip_fn: optional `SkipFn`. A rejected micro-batch leaves the state as if
        it never arrived and is counted in ``num_skipped``. With
        ``axis_name``, a skip function judges each device's own gradients
        and the micro-batch is rejected if any device rejects it, except
        `skip_large_updates`, which judges the micro-batch's gradient over
        every device, as in the global view. Not with ``data_axes``.
      axis_name: inside ``pmap`` or ``shard_map``, the mapped axis. Do not
        ``pmean`` the gradients yourself: each device accumulates its own and
        the weighted cross-device reduction runs once, in the boundary branch.
        With ``skip_fn`` the devices also agree on skipping (a scalar psum;
        `skip_large_updates` all-reduces the gradients per micro-step);
        without one, a device's bad weight counts as 0 (not in
        ``num_skipped``), which keeps the devices in step without it.
      allow_value_fn: accept a ``value_fn`` extra argument (line searches such
        as ``optax.lbfgs``). A line search evaluates ``value_fn`` at trial
        points, so set this only if it computes the loss of the whole window,
        not of one micro-batch; it is forwarded as given. With ``every_k=1``
        the window is the micro-batch, and ``value_fn`` is always accepted.
      data_axes: in a global-view ``jit`` step on an Explicit mesh, the mesh
        axis (or axes) that shard the batch, when the gradients come from
        ``jax.grad(loss)(optax_accum.defer_reduction(params, data_axes), batch)``:
        they are then unreduced over those axes (each device's partial sum),
        the accumulator keeps them so (with its parameter's sharding
        otherwise), and the one all-reduce runs in the boundary branch.
      noise_scale_decay: ``None`` (off: the state and the compiled program are
        as without it) or the EMA decay in (0, 1) of the gradient noise scale,
        measured from each window's micro-batch gradients and their mean and
        read with `noise_scale`. Needs ``reduction="mean"``, and windows of
        several micro-batches: ``every_k`` >= 2, or ``axis_name`` (each
        device's micro-batch is then one of them). It costs one
        squared-norm reduction per micro-step and a few scalars added to the
        boundary's all-reduce. ``every_k`` may then be `adaptive_every_k`.

    Sharded parameters: the accumulator, and the zeros of a hold step, have
    exactly their parameter's sharding (under an Explicit mesh this follows
    from the types; under an Auto mesh, initialise with
    ``jax.jit(tx.init, out_shardings=optax_accum.state_shardings(tx, params))``).

    Integer parameters' gradients (``float0``, from
    ``jax.grad(..., allow_int=True)``) pass through to ``inner`` as they are.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is
      `AccumulateState`.

    Raises:
      ValueError: for ``every_k`` < 1, an unknown ``reduction``, gradients that
        do not match the state, a non-scalar ``weight`` or ``close_window``, a
        known ``weight`` that is negative, not finite or does not fit its
        dtype, a ``value_fn`` without ``allow_value_fn``, ``skip_fn`` or
        ``noise_scale_decay`` with ``data_axes``, or ``noise_scale_decay``
        with ``every_k=1`` and no ``axis_name``; at ``init``, an
        ``accumulator_dtype`` prefix that does not match the parameters
        (naming the path).
      TypeError: for an ``inner`` that is not an optimizer (e.g. the factory
        ``optax.adam`` uncalled), a non-integer ``every_k``, a non-float
        ``accumulator_dtype`` (naming its path in a prefix), a ``skip_fn``
        that is not a skip function (e.g. the factory ``skip_large_updates``
        uncalled) or returns no boolean scalar, or a ``weight`` that is not
        a real number.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
      >>> params = {"w": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> u, state = tx.update({"w": jnp.array([1.0, 2.0])}, state, params)
      >>> u["w"]
      Array([0., 0.], dtype=float32)
      >>> u, state = tx.update({"w": jnp.array([3.0, 4.0])}, state, params)
      >>> u["w"]
      Array([-2., -3.], dtype=float32)
      >>> bool(optax_accum.has_updated(state))
      True

      A bf16 buffer for one subtree, float32 for the rest:

      >>> tx = optax_accum.accumulate(
      ...     optax.sgd(1.0), 2, accumulator_dtype={"a": jnp.bfloat16, "b": None}
      ... )
      >>> state = tx.init({"a": jnp.zeros(2), "b": jnp.zeros(2)})
      >>> {n: a.dtype.name for n, a in state.accumulator.items()}
      {'a': 'bfloat16', 'b': 'float32'}
    """
    engine = _engine_for(
        inner,
        every_k,
        reduction,
        accumulator_dtype,
        skip_fn,
        axis_name,
        data_axes,
        allow_value_fn,
        noise_scale_decay,
    )
    return _transformation(engine)


def sum_and_clear(
    inner: optax.GradientTransformation,
    every_k: _schedules.EveryK,
    *,
    accumulator_dtype: AccumulatorDType,
    axis_name: AxisName | None,
) -> optax.GradientTransformationExtraArgs:
    """`accumulate` in sum mode whose boundary branch zeroes the window's
    sums: once a window is emitted, no state leaf holds them (the privacy
    wing's, whose sum is secret until it is noised). Options as
    `accumulate`'s, checked in its names."""
    engine = _engine_for(
        inner, every_k, "sum", accumulator_dtype, None, axis_name, None, False, None
    )
    return _transformation(dataclasses.replace(engine, clear_sums=True))


def _transformation(engine: Engine) -> optax.GradientTransformationExtraArgs:
    """`accumulate`'s init and update around a checked engine."""

    def init_fn(params: optax.Params) -> AccumulateState:
        return _init(engine, params)

    def update_fn(
        grads: optax.Updates,
        state: AccumulateState,
        params: optax.Params | None = None,
        *,
        weight: jax.typing.ArrayLike | None = None,
        close_window: jax.typing.ArrayLike = False,
        **extra_args: Any,
    ) -> tuple[optax.Updates, AccumulateState]:
        warn_if_clipped_before("accumulate")
        return _update(engine, grads, state, params, weight, close_window, extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _init(engine: Engine, params: optax.Params) -> AccumulateState:
    window = engine.init_window(params)
    return AccumulateState(
        micro_step=window.micro_step,
        update_step=window.update_step,
        accumulator=window.accumulator,
        mean_weight=window.weight,
        inner_state=window.inner_state,
        num_skipped=jnp.zeros([], jnp.int32),
        updated=jnp.zeros([], jnp.bool_),
        skip_state=engine.init_skip_state(params),
        value_accumulator=window.value,
        noise_scale=window.noise,
    )


def _update(engine, grads, state, params, weight, close_window, extra_args):
    """One micro-step: the state as the engine's window, and back."""
    check_state(state, AccumulateState._fields, "accumulate")
    window = Window(
        state.micro_step,
        state.update_step,
        state.accumulator,
        state.mean_weight,
        state.inner_state,
        state.value_accumulator,
        state.noise_scale,
    )
    out = engine.step(grads, window, params, weight, close_window, extra_args)
    return out.updates, AccumulateState(
        micro_step=out.window.micro_step,
        update_step=out.window.update_step,
        accumulator=out.window.accumulator,
        mean_weight=out.window.weight,
        inner_state=out.window.inner_state,
        num_skipped=state.num_skipped + out.skipped.astype(jnp.int32),
        updated=out.stepped,
        skip_state=out.skip_state,
        value_accumulator=out.window.value,
        noise_scale=out.window.noise,
    )


def _engine_for(
    inner, every_k, reduction, accumulator_dtype, skip_fn, axis_name, data_axes,
    allow_value_fn, noise_scale_decay,
) -> Engine:  # fmt: skip
    """`accumulate`'s options, checked in its names, as an engine."""
    _checks.optimizer(inner, "inner")
    _schedules.check(every_k, "every_k")
    strategy = _reduction.get(reduction)
    _skip.check(skip_fn, "skip_fn")
    data_axes = _checks.axis_names(data_axes, "data_axes") or ()
    if data_axes and axis_name is not None:
        raise ValueError(
            "Pass either `axis_name` (inside shard_map/pmap) or `data_axes` "
            f"(global view), not both: got axis_name={axis_name!r}, "
            f"data_axes={data_axes!r}."
        )
    _checks.needs_whole_gradients(data_axes, {"skip_fn": skip_fn})
    adaptive = isinstance(every_k, _schedules.AdaptiveEveryK)
    one = _schedules.is_static_one(every_k)
    decay = ns.check_options(
        noise_scale_decay, adaptive, reduction, "every_k", data_axes,
        single=one and axis_name is None,
    )  # fmt: skip
    # With a static k of 1 the window is the micro-batch: its value_fn is.
    allow = bool(allow_value_fn) or one
    return Engine(
        inner=optax.with_extra_args_support(inner),
        k_of=_schedules.k_of(every_k, "every_k"),
        adaptive=every_k if adaptive else None,
        reduction=strategy,
        accumulator_dtype=_dtypes.canonical(accumulator_dtype),
        skip=_skip.decider(skip_fn, "skip_fn"),
        devices=Devices(axis_name),
        data_axes=data_axes,
        extra_args=functools.partial(
            _extra_args.read, allow_value_fn=allow, owner="accumulate"
        ),
        noise_scale_decay=decay,
    )


def state_specs(state: Any, axis_name: AxisName) -> Any:
    """Partition specs for keeping `accumulate` state across ``shard_map`` calls.

    With ``axis_name``, each device accumulates its own gradients, so the
    accumulator, the mean weight, the value accumulator, the skip state and
    the noise scale's window sums are device-local: they have a leading axis
    of length 1 inside ``shard_map`` and stack into a global
    ``(num_devices, ...)`` array outside it. Everything else (counters, the
    inner optimizer's state, the noise scale's EMAs) is replicated.

    Args:
      state: a state (or ``jax.eval_shape`` of one) that contains
        `AccumulateState` nodes anywhere, e.g. inside ``optax.chain``.
      axis_name: the mesh axis (or tuple of axes) the batch is split over.

    Returns:
      A pytree of ``PartitionSpec`` with the structure of ``state``, for
      ``in_specs`` and ``out_specs``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, optax_accum
      >>> tx = optax_accum.accumulate(optax.sgd(0.1), 4, axis_name="data")
      >>> specs = optax_accum.state_specs(tx.init({"w": jnp.zeros(3)}), "data")
      >>> specs.accumulator["w"], specs.micro_step
      (P('data',), P())
    """
    from jax.sharding import PartitionSpec

    sharded, replicated = PartitionSpec(axis_name), PartitionSpec()

    def node(x: Any) -> Any:
        if not isinstance(x, AccumulateState):
            return replicated
        fill = lambda tree, spec: jax.tree.map(lambda _: spec, tree)
        return x._replace(
            micro_step=replicated,
            update_step=replicated,
            accumulator=fill(x.accumulator, sharded),
            mean_weight=sharded,
            inner_state=state_specs(x.inner_state, axis_name),
            num_skipped=replicated,
            updated=replicated,
            skip_state=fill(x.skip_state, sharded),
            value_accumulator=fill(x.value_accumulator, sharded),
            noise_scale=ns.state_specs(x.noise_scale, sharded, replicated),
        )

    return jax.tree.map(node, state, is_leaf=lambda x: isinstance(x, AccumulateState))
