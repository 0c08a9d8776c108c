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
import optax
from flax import nnx

from ._extra_args import reads_value
from ._microbatch import microbatch_with_state
from ._validation import check_positive_int

_RESERVED = ("batch_argnums", "rng_argnums", "has_aux")


def _check_step_args(
    loss_fn: Any, num_micro_batches: Any, microbatch_kwargs: dict, helper: str
) -> None:
    """Validates a helper's arguments at construction, as `microbatch` does."""
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable, got {loss_fn!r}.")
    k = check_positive_int(num_micro_batches, "num_micro_batches")
    for name in _RESERVED:
        if name in microbatch_kwargs:
            raise TypeError(
                f"`{name}` is set by {helper} itself; it takes `has_aux` as its "
                "own keyword and builds the batch and rng arguments from the "
                "step's signature."
            )
    # Builds (does not run) a microbatch to check the remaining keywords.
    microbatch_with_state(lambda *a, state: None, k, **microbatch_kwargs)


def _with_value(opt_kwargs: dict, tx: Any, params: Any, opt_state: Any, loss: Any):
    """Adds the step's loss as ``value`` when the optimizer reads one."""
    if "value" not in opt_kwargs and reads_value(tx, params, opt_state):
        return {**opt_kwargs, "value": loss}
    return opt_kwargs


def nnx_train_step(
    loss_fn: Callable[..., Any],
    num_micro_batches: int,
    *,
    has_aux: bool = False,
    **microbatch_kwargs: Any,
) -> Callable[..., Any]:
    """Builds ``step(model, optimizer, *batch)`` for a `flax.nnx` model.

    ``loss_fn(model, *batch)`` returns the loss (a mean over the batch rows),
    or ``(loss, aux)`` with ``has_aux``. The step splits every ``batch``
    argument into ``num_micro_batches`` micro-batches (rows ``i, i+k, ...``),
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
      num_micro_batches: k, as in `optax_accum.microbatch`.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``aux`` comes back
        stacked along a leading axis of length k.
      **microbatch_kwargs: ``reduction``, ``weight_fn`` (called with the
        micro-batch arguments), ``accumulator_dtype``, ``axis_name`` or
        ``mesh_axes``, ``noise_scale_decay``, passed to
        `optax_accum.microbatch`.

    Returns:
      ``step(model, optimizer, *batch) -> loss`` (or ``(loss, aux)``), which
      updates ``model`` and ``optimizer`` in place. With ``noise_scale_decay``
      it is ``step(model, optimizer, *batch, noise_scale=tracker) ->
      (loss, tracker)``: pass the returned `NoiseScaleState` (``None`` at
      first) to the next step and read it with `optax_accum.noise_scale`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> from optax_accum.flax import nnx_train_step
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> def loss_fn(model, x, y):
      ...     return jnp.mean((model(x) - y) ** 2)
      >>> step = nnx.jit(nnx_train_step(loss_fn, num_micro_batches=4))
      >>> loss = step(model, optimizer, jnp.ones((8, 2)), jnp.zeros((8, 1)))
      >>> loss.shape
      ()
    """
    _check_step_args(loss_fn, num_micro_batches, microbatch_kwargs, "nnx_train_step")

    noise = microbatch_kwargs.get("noise_scale_decay") is not None

    def step(
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        *batch: Any,
        noise_scale=None,
        **opt_kwargs: Any,
    ) -> Any:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def fun(params, *batch, state):
            # copy=True: fresh Variables at this trace level, since the forward
            # pass mutates them (BatchStat, RngCount).
            def loss_of(params, state):
                m = nnx.merge(graphdef, params, state, copy=True)
                out = loss_fn(m, *batch)
                loss, aux = out if has_aux else (out, None)
                return loss, (aux, nnx.split(m, nnx.Param, ...)[2])

            grad_fn = jax.value_and_grad(loss_of, has_aux=True)
            (loss, (aux, new_state)), grads = grad_fn(params, state)
            return ((loss, aux), grads), new_state

        mb = microbatch_with_state(
            fun,
            num_micro_batches,
            batch_argnums=tuple(range(1, len(batch) + 1)),
            has_aux=True,
            **microbatch_kwargs,
        )
        tracker = {"noise_scale": noise_scale} if noise else {}
        out = mb(params, *batch, state=rest, **tracker)
        (((loss, aux), grads), new_rest), tracker = out if noise else (out, None)
        nnx.update(model, new_rest)
        opt_kwargs = _with_value(
            opt_kwargs,
            optimizer.tx,
            nnx.as_pure(nnx.state(model, optimizer.wrt)),
            nnx.as_pure(optimizer.opt_state),
            loss,
        )
        optimizer.update(model, grads, **opt_kwargs)
        result = (loss, aux) if has_aux else loss
        return (result, tracker) if noise else result

    return step


def linen_train_step(
    loss_fn: Callable[..., Any],
    num_micro_batches: int,
    *,
    has_aux: bool = False,
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
      num_micro_batches: k, as in `optax_accum.microbatch`.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)`` as its first output.
      **microbatch_kwargs: passed to `optax_accum.microbatch`.

    Returns:
      ``step(state, *batch, rng=None, **opt_kwargs) -> (new_state, loss)``
      (or ``(new_state, (loss, aux))``). With ``noise_scale_decay`` it takes
      ``noise_scale=tracker`` and returns ``(new_state, loss, tracker)``, the
      `NoiseScaleState` to pass to the next step.

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
      >>> step = jax.jit(linen_train_step(loss_fn, num_micro_batches=2))
      >>> state, loss = step(state, x)
      >>> int(state.step)
      1
    """

    _check_step_args(loss_fn, num_micro_batches, microbatch_kwargs, "linen_train_step")

    noise = microbatch_kwargs.get("noise_scale_decay") is not None

    def step(
        state: Any,
        *batch: Any,
        rng: Any = None,
        noise_scale: Any = None,
        **opt_kwargs: Any,
    ) -> tuple:
        with_stats = hasattr(state, "batch_stats")

        def fun(params, rng, *batch, state):
            def loss_of(params):
                if with_stats:
                    out, new_stats = loss_fn(params, state, rng, *batch)
                else:
                    out, new_stats = loss_fn(params, rng, *batch), ()
                loss, aux = out if has_aux else (out, None)
                return loss, (aux, new_stats)

            (loss, (aux, new_stats)), grads = jax.value_and_grad(loss_of, has_aux=True)(
                params
            )
            return ((loss, aux), grads), new_stats

        mb = microbatch_with_state(
            fun,
            num_micro_batches,
            batch_argnums=tuple(range(2, len(batch) + 2)),
            rng_argnums=1,
            has_aux=True,
            **microbatch_kwargs,
        )
        stats_in = state.batch_stats if with_stats else ()
        tracker = {"noise_scale": noise_scale} if noise else {}
        out = mb(state.params, rng, *batch, state=stats_in, **tracker)
        (((loss, aux), grads), stats), tracker = out if noise else (out, None)
        stats_kw = {"batch_stats": stats} if with_stats else {}
        opt_kwargs = _with_value(
            opt_kwargs, state.tx, state.params, state.opt_state, loss
        )
        if opt_kwargs:
            # TrainState.apply_gradients forwards no extra args to tx.update.
            updates, opt_state = state.tx.update(
                grads, state.opt_state, state.params, **opt_kwargs
            )
            new_state = state.replace(
                step=state.step + 1,
                params=optax.apply_updates(state.params, updates),
                opt_state=opt_state,
                **stats_kw,
            )
        else:
            new_state = state.apply_gradients(grads=grads, **stats_kw)
        result = (loss, aux) if has_aux else loss
        return (new_state, result, tracker) if noise else (new_state, result)

    return step
