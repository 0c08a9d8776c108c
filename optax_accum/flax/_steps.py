# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`nnx_train_step` and `linen_train_step`: fused micro-batch train steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax
from flax import nnx

from .._microbatch import StepKeywords
from .._typing import Unpack
from . import _nnx
from ._common import (
    check_loss_scale,
    extras,
    fused_loop,
    keep_unless,
    split_output,
    step_options,
    with_value,
)


def nnx_train_step(
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    has_aux: bool = False,
    loss_scaling: bool = False,
    **microbatch_kwargs: Unpack[StepKeywords],
) -> Callable[..., Any]:
    """Builds ``step(model, optimizer, *batch)`` for a `flax.nnx` model.

    ``loss_fn(model, *batch)`` returns the loss (a mean over the batch rows),
    or ``(loss, aux)`` with ``has_aux``. The step splits every ``batch``
    argument into ``num_microbatches`` micro-batches (rows ``i, i+k, ...``),
    computes the mean loss and gradients with `optax_accum.microbatch`, calls
    ``optimizer.update(model, grads)`` once and writes the threaded state back
    into ``model``. Wrap it in ``nnx.jit``.

    What is differentiated: the Variables the optimizer's ``wrt`` filter
    selects, as with ``nnx.grad(loss_fn, argnums=nnx.DiffState(0,
    optimizer.wrt))``. Other Params (frozen layers, integer tables) are
    read-only inputs, with no gradient and no part in the noise scale.

    Optimizer extra arguments: keyword arguments of ``step`` are forwarded to
    ``optimizer.update``. When the optimizer reads ``value`` (e.g.
    ``optax.contrib.reduce_on_plateau``) and none is given, the step passes its
    own loss, the mean over all k micro-batches (the large batch's loss).

    ``optimizer.step`` counts calls of ``optimizer.update``: one per step here,
    so it counts optimizer updates.

    Dropout: the model's own ``nnx.Rngs`` stream advances once per micro-batch,
    so every micro-batch draws a fresh mask, the same masks k small steps
    would draw. With ``data_axes`` (k >= 2), device ``d`` of those axes draws
    with the model's PRNG keys folded with ``d``
    (``jax.random.fold_in(key, d)``, ``d`` the index over the named axes), so
    devices draw their own masks; the model's keys stay as they were and its
    counters advance once per micro-batch. Call-time Rngs, as in the Flax
    NNX tutorial (``loss_fn(model, rngs, batch)`` calling
    ``model(x, rngs)``, whose Dropout layers hold no Rngs): pass the
    ``nnx.Rngs`` (or an ``RngStream``) as a step argument,
    ``step(model, optimizer, rngs, batch)``; it is no batch, it reaches
    ``loss_fn`` where it was given, and its state is threaded through the
    micro-batches as the model's is, so micro-batch ``i`` draws what the
    ``i``-th of k small steps with that Rngs would and its counters advance
    as over those k steps. BatchNorm: each micro-batch is
    normalized with its own batch statistics and the running averages are
    updated micro-batch by micro-batch, in order (k momentum steps per
    optimizer step).

    Intermediates: values the model sows with ``self.sow(nnx.Intermediate,
    ...)`` during the step are written back into it with each leaf stacked
    along a leading axis of length k (one entry per micro-batch, following
    ``aux``'s rules with ``data_axes``). Take them out with
    ``nnx.pop(model, nnx.Intermediate)`` before the next step: a model that
    still holds intermediates is refused. ``nnx.capture`` inside ``loss_fn``,
    returned as ``aux``, needs no such step.

    Args:
      loss_fn: ``loss_fn(model, *batch) -> loss`` or ``(loss, aux)``.
      num_microbatches: k, as in `optax_accum.microbatch`.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``aux`` comes back
        stacked along a leading axis of length k (micro-batch ``i``: rows
        ``i::k``), or with ``aux_order="batch"`` its row-wise leaves (the
        logits) as ``(B, ...)`` in the batch's order, ready for
        ``metrics.update(logits=aux, labels=batch["label"])``.
      loss_scaling: fp16 dynamic loss scaling: the step then takes
        ``loss_scale=`` (e.g. a ``jmp.DynamicLossScale``), scales each
        micro-batch's loss by it and unscales the gradients
        (`optax_accum.scaled_value_and_grad`), applies the step only if every
        micro-batch's gradients are finite (else the model, its BatchNorm
        statistics and Rngs counters included, and the optimizer are left as
        they were), and also returns the adjusted loss scale for the next
        step.
      **microbatch_kwargs: ``reduction``, ``weight_fn`` (called with the
        micro-batch arguments), ``accumulator_dtype``, ``axis_name`` or
        ``data_axes``, ``aux_rows``, ``aux_order``, ``noise_scale_decay``,
        passed to `optax_accum.microbatch_value_and_grad`. ``aux_rows``
        declares ``aux``'s row-wise leaves; a bool covers the sown
        intermediates too, a pytree covers ``aux`` and leaves the sown ones
        statistics. ``aux_order`` orders the sown row-wise leaves as ``aux``.

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
    microbatch_kwargs, opts = step_options(
        loss_fn, num_microbatches, microbatch_kwargs, "nnx_train_step", has_aux
    )
    if opts.aux_rows is not None:  # the loop's aux is (aux, sown intermediates)
        rows = opts.aux_rows
        sown_rows = rows if isinstance(rows, bool) else False
        microbatch_kwargs = {**microbatch_kwargs, "aux_rows": (rows, sown_rows)}
    noise = opts.decay is not None

    def step(model, optimizer, *batch, noise_scale=None, loss_scale=None, **opt_kwargs):
        check_loss_scale(loss_scaling, loss_scale, "nnx_train_step")
        _nnx.check_arguments(model, optimizer)
        parts = _nnx.split(model, optimizer.wrt)
        # Call-time nnx.Rngs arguments leave the batch; their state is
        # threaded through the micro-batches as the model's is.
        call_rngs = _nnx.CallRngs(batch)

        def loss(trained, frozen, *arrays, state):
            model_state, rng_state = state
            rngs = call_rngs.merge(rng_state, opts.data_axes)
            call = lambda m: loss_fn(m, *call_rngs.batch(arrays, rngs))
            out, sown, new_state = _nnx.run(
                parts, trained, frozen, model_state, call, opts.data_axes
            )
            value, aux = out if has_aux else (out, None)
            return (value, (aux, sown)), (new_state, call_rngs.state(rng_state, rngs))

        arrays = call_rngs.arrays
        mb = fused_loop(
            loss,
            loss_scale,
            num_microbatches,
            range(2, len(arrays) + 2),
            (),
            microbatch_kwargs,
        )
        tracker = {"noise_scale": noise_scale} if noise else {}
        state = (parts.state, call_rngs.initial)
        out = mb(parts.trained, parts.frozen, *arrays, state=state, **tracker)
        loss, (aux, sown), grads, new_state, tracker, scaled = split_output(out, noise)
        new_state, rng_state = new_state
        _nnx_update(model, optimizer, grads, new_state, loss, scaled, opt_kwargs)
        if scaled is not None:
            rng_state = keep_unless(scaled.finite, rng_state, call_rngs.initial)
        call_rngs.update(rng_state)
        nnx.update(model, sown)
        result = (loss, aux) if has_aux else loss
        more = extras(tracker, scaled, noise)
        return (result, *more) if more else result

    return step


def _nnx_update(model, optimizer, grads, new_state, loss, scaled, opt_kwargs):
    """The threaded state into ``model``, then ``optimizer.update`` once; with
    a loss scale, both only if every micro-batch's gradients were finite."""
    opt_kwargs = with_value(
        opt_kwargs,
        optimizer.tx,
        nnx.as_pure(nnx.state(model, optimizer.wrt)),
        nnx.as_pure(optimizer.opt_state),
        loss,
    )
    # Pure arrays: a State holds the Variables, which the update mutates.
    before = None if scaled is None else nnx.as_pure(nnx.state((model, optimizer)))
    nnx.update(model, new_state)
    optimizer.update(model, grads, **opt_kwargs)
    if scaled is not None:
        after = nnx.as_pure(nnx.state((model, optimizer)))
        nnx.update((model, optimizer), keep_unless(scaled.finite, after, before))


def linen_train_step(
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    has_aux: bool = False,
    loss_scaling: bool = False,
    **microbatch_kwargs: Unpack[StepKeywords],
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
    own loss, the mean over all k micro-batches. The update always goes
    through the state's own ``apply_gradients`` (a subclass that overrides it,
    to keep an EMA of the parameters say, keeps working), with a ``tx`` that
    forwards those arguments for that one call.

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

    microbatch_kwargs, opts = step_options(
        loss_fn, num_microbatches, microbatch_kwargs, "linen_train_step", has_aux
    )
    noise = opts.decay is not None

    def step(state, *batch, rng=None, noise_scale=None, loss_scale=None, **opt_kwargs):
        check_loss_scale(loss_scaling, loss_scale, "linen_train_step")
        with_stats = hasattr(state, "batch_stats")

        def loss(params, rng, *batch, state):
            if with_stats:
                out, new_stats = loss_fn(params, state, rng, *batch)
            else:
                out, new_stats = loss_fn(params, rng, *batch), ()
            value, aux = out if has_aux else (out, None)
            return (value, aux), new_stats

        mb = fused_loop(
            loss,
            loss_scale,
            num_microbatches,
            range(2, len(batch) + 2),
            (1,),
            microbatch_kwargs,
        )
        stats_in = state.batch_stats if with_stats else ()
        tracker = {"noise_scale": noise_scale} if noise else {}
        out = mb(state.params, rng, *batch, state=stats_in, **tracker)
        loss, aux, grads, stats, tracker, scaled = split_output(out, noise)
        stats = stats if with_stats else None
        new_state = _linen_apply(state, grads, loss, stats, opt_kwargs)
        if scaled is not None:
            new_state = keep_unless(scaled.finite, new_state, state)
        result = (loss, aux) if has_aux else loss
        return (new_state, result, *extras(tracker, scaled, noise))

    return step


def _linen_apply(state, grads, loss, stats, opt_kwargs):
    """One optimizer update of a linen ``TrainState``, always through its own
    ``apply_gradients`` (a subclass's EMA, say, keeps updating)."""
    stats_kw = {} if stats is None else {"batch_stats": stats}
    opt_kwargs = with_value(opt_kwargs, state.tx, state.params, state.opt_state, loss)
    if not opt_kwargs:
        return state.apply_gradients(grads=grads, **stats_kw)
    # TrainState.apply_gradients forwards no extra args to tx.update: give it
    # a tx that does, for this one call.
    tx = state.tx
    bound = optax.GradientTransformation(
        tx.init, lambda u, s, p=None: tx.update(u, s, p, **opt_kwargs)
    )
    new = state.replace(tx=bound).apply_gradients(grads=grads, **stats_kw)
    return new.replace(tx=tx)
