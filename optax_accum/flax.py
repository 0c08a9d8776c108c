# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Flax integration: fused micro-batch train steps for `flax.nnx` and `flax.linen`.

Both helpers run k micro-batches and one optimizer update in a single compiled
call through `optax_accum.microbatch`. Mutable state (BatchNorm running
statistics, nnx Rngs counters) is threaded through the micro-batches in order,
exactly as k small steps would update it; each micro-batch normalizes with its
own batch statistics. Flax is an optional dependency: ``import optax_accum``
never imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ._deprecations import rename, renamed_arguments
from ._extra_args import reads_value
from ._loss_scale import ScaledGrads, scaled_value_and_grad
from ._microbatch import microbatch_with_state
from ._microbatch_options import options

__all__ = ["linen_train_step", "nnx_train_step"]

_RESERVED = ("batch_argnums", "rng_argnums", "has_aux")
_RENAMED = {"num_micro_batches": "num_microbatches"}


def _step_options(
    loss_fn: Any, num_microbatches: Any, microbatch_kwargs: dict, helper: str
) -> dict:
    """A helper's arguments, checked at construction as `microbatch` checks
    its own; returns the keywords for `microbatch_with_state`."""
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable, got {loss_fn!r}.")
    for name in _RESERVED:
        if name in microbatch_kwargs:
            raise TypeError(
                f"`{name}` is set by {helper} itself; it takes `has_aux` as its "
                "own keyword and builds the batch and rng arguments from the "
                "step's signature."
            )
    kwargs = rename(microbatch_kwargs, {"mesh_axes": "data_axes"}, helper, 6)
    options(num_microbatches, stateful=True, **kwargs)
    return kwargs


def _with_value(opt_kwargs: dict, tx: Any, params: Any, opt_state: Any, loss: Any):
    """Adds the step's loss as ``value`` when the optimizer reads one."""
    if "value" not in opt_kwargs and reads_value(tx, params, opt_state):
        return {**opt_kwargs, "value": loss}
    return opt_kwargs


def _value_and_grad(loss_of: Callable, loss_scale: Any) -> Callable:
    """``(params, state) -> (((loss, aux), grads), new_state)``, or with a loss
    scale a `ScaledGrads` in place of ``((loss, aux), grads)``; ``loss_of``
    returns ``(loss, (aux, new_state))``."""

    def plain(params, state):
        grad_fn = jax.value_and_grad(loss_of, has_aux=True)
        (loss, (aux, new_state)), grads = grad_fn(params, state)
        return ((loss, aux), grads), new_state

    def scaled(params, state):
        out = scaled_value_and_grad(loss_of, has_aux=True)(loss_scale, params, state)
        loss, (aux, new_state) = out.value
        return out._replace(value=(loss, aux)), new_state

    return plain if loss_scale is None else scaled


def _split_output(out: Any, noise: bool) -> tuple:
    """The fused loop's output as ``(loss, aux, grads, state, tracker, scaled)``."""
    (out, new_state), tracker = out if noise else (out, None)
    if isinstance(out, ScaledGrads):
        (loss, aux), grads = out.value, out.grads
        return loss, aux, grads, new_state, tracker, out
    (loss, aux), grads = out
    return loss, aux, grads, new_state, tracker, None


def _extras(tracker: Any, scaled: ScaledGrads | None, noise: bool) -> tuple:
    """What a step returns after its result: the tracker, then the loss scale."""
    return ((tracker,) if noise else ()) + (
        (scaled.loss_scale,) if scaled is not None else ()
    )


def _keep_unless(finite: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``finite``, else ``old`` (leaf by leaf)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def _check_loss_scale(loss_scaling: bool, loss_scale: Any, helper: str) -> None:
    if loss_scaling and loss_scale is None:
        raise TypeError(
            f"{helper} was built with `loss_scaling=True`: pass the step "
            "`loss_scale=` (e.g. jmp.DynamicLossScale(jnp.float32(2 ** 15)))."
        )
    if not loss_scaling and loss_scale is not None:
        raise TypeError(
            f"`loss_scale` was passed to a step built without `loss_scaling`: "
            f"build it with {helper}(..., loss_scaling=True)."
        )


@renamed_arguments(_RENAMED)
def nnx_train_step(
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    has_aux: bool = False,
    loss_scaling: bool = False,
    **microbatch_kwargs: Any,
) -> Callable[..., Any]:
    """Builds ``step(model, optimizer, *batch)`` for a `flax.nnx` model.

    ``loss_fn(model, *batch)`` returns the loss (a mean over the batch rows),
    or ``(loss, aux)`` with ``has_aux``. The step splits every ``batch``
    argument into ``num_microbatches`` micro-batches (rows ``i, i+k, ...``),
    computes the mean loss and gradients with `optax_accum.microbatch`, calls
    ``optimizer.update(model, grads)`` once and writes the threaded state back
    into ``model``. Wrap it in ``nnx.jit``.

    Optimizer extra arguments: keyword arguments of ``step`` are forwarded to
    ``optimizer.update``. When the optimizer reads ``value`` (e.g.
    ``optax.contrib.reduce_on_plateau``) and none is given, the step passes its
    own loss, the mean over all k micro-batches (the large batch's loss).

    ``optimizer.step`` counts calls of ``optimizer.update``: one per step here,
    so it counts optimizer updates.

    Dropout: the model's own ``nnx.Rngs`` stream advances once per micro-batch,
    so every micro-batch draws a fresh mask, the same masks k small steps
    would draw. BatchNorm: each micro-batch is normalized with its own batch
    statistics and the running averages are updated micro-batch by micro-batch,
    in order (k momentum steps per optimizer step).

    Args:
      loss_fn: ``loss_fn(model, *batch) -> loss`` or ``(loss, aux)``.
      num_microbatches: k, as in `optax_accum.microbatch`.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``aux`` comes back
        stacked along a leading axis of length k.
      loss_scaling: fp16 dynamic loss scaling: the step then takes
        ``loss_scale=`` (e.g. a ``jmp.DynamicLossScale``), scales each
        micro-batch's loss by it and unscales the gradients
        (`optax_accum.scaled_value_and_grad`), applies the update only if every
        micro-batch's gradients are finite, and also returns the adjusted
        loss scale for the next step.
      **microbatch_kwargs: ``reduction``, ``weight_fn`` (called with the
        micro-batch arguments), ``accumulator_dtype``, ``axis_name`` or
        ``data_axes``, ``noise_scale_decay``, passed to
        `optax_accum.microbatch`.

    Returns:
      ``step(model, optimizer, *batch) -> loss`` (or ``(loss, aux)``), which
      updates ``model`` and ``optimizer`` in place. With ``noise_scale_decay``
      it is ``step(model, optimizer, *batch, noise_scale=tracker) ->
      (loss, tracker)``: pass the returned `NoiseScaleState` (``None`` at
      first) to the next step and read it with `optax_accum.noise_scale`.
      With ``loss_scaling`` it takes ``loss_scale=`` too, and the adjusted
      loss scale comes last: ``(loss, loss_scale)`` or
      ``(loss, tracker, loss_scale)``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> from optax_accum.flax import nnx_train_step
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> def loss_fn(model, x, y):
      ...     return jnp.mean((model(x) - y) ** 2)
      >>> step = nnx.jit(nnx_train_step(loss_fn, num_microbatches=4))
      >>> loss = step(model, optimizer, jnp.ones((8, 2)), jnp.zeros((8, 1)))
      >>> loss.shape
      ()
    """
    microbatch_kwargs = _step_options(
        loss_fn, num_microbatches, microbatch_kwargs, "nnx_train_step"
    )
    noise = microbatch_kwargs.get("noise_scale_decay") is not None

    def step(model, optimizer, *batch, noise_scale=None, loss_scale=None, **opt_kwargs):
        _check_loss_scale(loss_scaling, loss_scale, "nnx_train_step")
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def fun(params, *batch, state):
            def loss_of(params, state):
                # copy=True: fresh Variables at this trace level, since the
                # forward pass mutates them (BatchStat, RngCount).
                m = nnx.merge(graphdef, params, state, copy=True)
                out = loss_fn(m, *batch)
                loss, aux = out if has_aux else (out, None)
                return loss, (aux, nnx.split(m, nnx.Param, ...)[2])

            return _value_and_grad(loss_of, loss_scale)(params, state)

        mb = microbatch_with_state(
            fun,
            num_microbatches,
            batch_argnums=tuple(range(1, len(batch) + 1)),
            has_aux=True,
            **microbatch_kwargs,
        )
        tracker = {"noise_scale": noise_scale} if noise else {}
        out = mb(params, *batch, state=rest, **tracker)
        loss, aux, grads, new_rest, tracker, scaled = _split_output(out, noise)
        nnx.update(model, new_rest)
        _nnx_update(model, optimizer, grads, loss, scaled, opt_kwargs)
        result = (loss, aux) if has_aux else loss
        extras = _extras(tracker, scaled, noise)
        return (result, *extras) if extras else result

    return step


def _nnx_update(model, optimizer, grads, loss, scaled, opt_kwargs) -> None:
    """``optimizer.update`` once; with a loss scale, only if all were finite."""
    opt_kwargs = _with_value(
        opt_kwargs,
        optimizer.tx,
        nnx.as_pure(nnx.state(model, optimizer.wrt)),
        nnx.as_pure(optimizer.opt_state),
        loss,
    )
    if scaled is None:
        optimizer.update(model, grads, **opt_kwargs)
        return
    # Pure arrays: a State holds the Variables, which the update mutates.
    before = nnx.as_pure(nnx.state((model, optimizer)))
    optimizer.update(model, grads, **opt_kwargs)
    after = nnx.as_pure(nnx.state((model, optimizer)))
    nnx.update((model, optimizer), _keep_unless(scaled.finite, after, before))


@renamed_arguments(_RENAMED)
def linen_train_step(
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    has_aux: bool = False,
    loss_scaling: bool = False,
    **microbatch_kwargs: Any,
) -> Callable[..., Any]:
    """Builds ``step(state, *batch, rng=None)`` for a `flax.linen` TrainState.

    Two shapes of ``state``, told apart by its ``batch_stats`` field:

    - a ``flax.training.train_state.TrainState`` subclass with a
      ``batch_stats`` field: ``loss_fn(params, batch_stats, rng, *batch)``
      returns ``(loss, new_batch_stats)``, or ``((loss, aux),
      new_batch_stats)`` with ``has_aux``; typically it calls
      ``state.apply_fn`` with ``mutable=["batch_stats"]``. Micro-batch ``i``
      gets the batch statistics micro-batch ``i - 1`` returned.
    - a plain ``TrainState`` (no BatchNorm, most language models):
      ``loss_fn(params, rng, *batch)`` returns ``loss`` or ``(loss, aux)``.

    Micro-batch ``i`` receives ``jax.random.fold_in(rng, i)`` (for each key,
    if ``rng`` is a dict of keys). The step then applies the gradients once.
    Wrap it in ``jax.jit``.

    Optimizer extra arguments: keyword arguments of ``step`` other than
    ``rng`` are forwarded to ``state.tx.update``. When the optimizer reads
    ``value`` (``reduce_on_plateau``) and none is given, the step passes its
    own loss, the mean over all k micro-batches.

    Args:
      loss_fn: ``loss_fn(params, batch_stats, rng, *batch)`` or
        ``loss_fn(params, rng, *batch)``, see above.
      num_microbatches: k, as in `optax_accum.microbatch`.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)`` as its first output.
      loss_scaling: fp16 dynamic loss scaling, as in `nnx_train_step`: the
        step takes ``loss_scale=``, keeps ``state`` unchanged unless every
        micro-batch's gradients are finite, and returns the adjusted scale.
      **microbatch_kwargs: passed to `optax_accum.microbatch`.

    Returns:
      ``step(state, *batch, rng=None, **opt_kwargs) -> (new_state, loss)``
      (or ``(new_state, (loss, aux))``). With ``noise_scale_decay`` it takes
      ``noise_scale=tracker`` and returns ``(new_state, loss, tracker)``, the
      `NoiseScaleState` to pass to the next step. With ``loss_scaling`` it
      takes ``loss_scale=`` too, and the adjusted loss scale comes last.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import flax.linen as nn
      >>> from flax.training import train_state
      >>> from optax_accum.flax import linen_train_step
      >>> class TrainState(train_state.TrainState):
      ...     batch_stats: dict
      >>> net = nn.Sequential([nn.Dense(4), nn.BatchNorm(use_running_average=False)])
      >>> x = jnp.ones((8, 2))
      >>> variables = net.init(jax.random.key(0), x)
      >>> state = TrainState.create(apply_fn=net.apply, params=variables["params"],
      ...     batch_stats=variables["batch_stats"], tx=optax.sgd(0.1))
      >>> def loss_fn(params, batch_stats, rng, x):
      ...     out, updates = net.apply({"params": params, "batch_stats": batch_stats},
      ...                              x, mutable=["batch_stats"])
      ...     return jnp.mean(out ** 2), updates["batch_stats"]
      >>> step = jax.jit(linen_train_step(loss_fn, num_microbatches=2))
      >>> state, loss = step(state, x)
      >>> int(state.step)
      1
    """

    microbatch_kwargs = _step_options(
        loss_fn, num_microbatches, microbatch_kwargs, "linen_train_step"
    )
    noise = microbatch_kwargs.get("noise_scale_decay") is not None

    def step(state, *batch, rng=None, noise_scale=None, loss_scale=None, **opt_kwargs):
        _check_loss_scale(loss_scaling, loss_scale, "linen_train_step")
        with_stats = hasattr(state, "batch_stats")

        def fun(params, rng, *batch, state):
            def loss_of(params, stats):
                if with_stats:
                    out, new_stats = loss_fn(params, stats, rng, *batch)
                else:
                    out, new_stats = loss_fn(params, rng, *batch), ()
                loss, aux = out if has_aux else (out, None)
                return loss, (aux, new_stats)

            return _value_and_grad(loss_of, loss_scale)(params, state)

        mb = microbatch_with_state(
            fun,
            num_microbatches,
            batch_argnums=tuple(range(2, len(batch) + 2)),
            rng_argnums=1,
            has_aux=True,
            **microbatch_kwargs,
        )
        stats_in = state.batch_stats if with_stats else ()
        tracker = {"noise_scale": noise_scale} if noise else {}
        out = mb(state.params, rng, *batch, state=stats_in, **tracker)
        loss, aux, grads, stats, tracker, scaled = _split_output(out, noise)
        stats = stats if with_stats else None
        new_state = _linen_apply(state, grads, loss, stats, opt_kwargs)
        if scaled is not None:
            new_state = _keep_unless(scaled.finite, new_state, state)
        result = (loss, aux) if has_aux else loss
        return (new_state, result, *_extras(tracker, scaled, noise))

    return step


def _linen_apply(state, grads, loss, stats, opt_kwargs):
    """One optimizer update of a linen ``TrainState``."""
    stats_kw = {} if stats is None else {"batch_stats": stats}
    opt_kwargs = _with_value(opt_kwargs, state.tx, state.params, state.opt_state, loss)
    if not opt_kwargs:
        return state.apply_gradients(grads=grads, **stats_kw)
    # TrainState.apply_gradients forwards no extra args to tx.update.
    updates, opt_state = state.tx.update(
        grads, state.opt_state, state.params, **opt_kwargs
    )
    return state.replace(
        step=state.step + 1,
        params=optax.apply_updates(state.params, updates),
        opt_state=opt_state,
        **stats_kw,
    )
