# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""What `nnx_train_step` and `linen_train_step` share.

Their options, checked once when a step is built and in the public
function's name; the one call into the fused loop (`fused_loop`), which
differentiates a loss that also returns state (loss-scaled, or not); and the
loop's output taken apart. The public steps are `optax_accum.flax`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._extra_args import reads_value
from .._loss_scale import ScaledGrads, scaled_value_and_grad
from .._microbatch import (
    Keywords,
    Options,
    microbatch_with_state,
    options,
    value_and_grad_with_state,
)

_RESERVED = ("batch_argnums", "rng_argnums", "has_aux")
# `microbatch`'s keywords that a step passes through.
_ACCEPTED = tuple(
    name
    for name in (*(f.name for f in dataclasses.fields(Keywords)), "argnums")
    if name not in _RESERVED
)


def step_options(
    loss_fn: Any,
    num_microbatches: Any,
    microbatch_kwargs: Mapping[str, Any],
    helper: str,
    has_aux: bool,
) -> tuple[Any, Options]:
    """A helper's arguments, checked at construction in ``helper``'s name;
    returns the keywords for `fused_loop` and their checked `Options`."""
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable, got {loss_fn!r}.")
    for name in _RESERVED:
        if (
            name == "rng_argnums"
            and name in microbatch_kwargs
            and helper == ("nnx_train_step")
        ):
            raise TypeError(
                "nnx_train_step takes no `rng_argnums`: pass the `nnx.Rngs` "
                "itself as an argument of the step, `step(model, optimizer, rngs, "
                "*batch)` for `loss_fn(model, rngs, *batch)` (as the Flax NNX "
                "tutorial does), or give the model's Dropout layers their own "
                "`rngs=`; either way each micro-batch draws its own masks, as k "
                "small steps would, and the Rngs' counters advance as over them."
            )
        if name in microbatch_kwargs:
            raise TypeError(
                f"`{name}` is set by {helper} itself; it takes `has_aux` as its "
                "own keyword and builds the batch and rng arguments from the "
                "step's signature."
            )
    kwargs = dict(microbatch_kwargs)
    unknown = [name for name in kwargs if name not in _ACCEPTED]
    if unknown:
        raise TypeError(
            f"{helper}() got an unexpected keyword argument `{unknown[0]}`; it "
            "takes `has_aux`, `loss_scaling` and these keywords of "
            f"`optax_accum.microbatch`: {', '.join(f'`{n}`' for n in _ACCEPTED)}."
        )
    opts = options(num_microbatches, stateful=True, has_aux=has_aux, **kwargs)
    return kwargs, opts


def fused_loop(
    loss: Callable[..., Any],
    loss_scale: Any,
    num_microbatches: int,
    batch_argnums: Sequence[int],
    rng_argnums: Sequence[int],
    microbatch_kwargs: dict,
) -> Callable[..., Any]:
    """The steps' one call into the fused loop.

    ``loss(*args, state=state)`` returns ``((loss, aux), new_state)``; the
    loop differentiates it w.r.t. its first argument. The steps own the
    differentiation, so they use the loss face (`value_and_grad_with_state`),
    whose token weights enter the backward pass and keep the loop sinkable;
    with a loss scale, each micro-batch goes through `scaled_value_and_grad`
    and the result is a `ScaledGrads` in place of ``((loss, aux), grads)``.
    """
    common = dict(
        batch_argnums=tuple(batch_argnums),
        rng_argnums=tuple(rng_argnums),
        has_aux=True,
        **microbatch_kwargs,
    )
    if loss_scale is None:
        return value_and_grad_with_state(loss, num_microbatches, **common)

    def fun(first, *rest, state):
        def loss_of(first, state):
            (value, aux), new_state = loss(first, *rest, state=state)
            return value, (aux, new_state)

        out = scaled_value_and_grad(loss_of, has_aux=True)(loss_scale, first, state)
        value, (aux, new_state) = out.value
        return out._replace(value=(value, aux)), new_state

    return microbatch_with_state(fun, num_microbatches, **common)


def with_value(opt_kwargs: dict, tx: Any, params: Any, opt_state: Any, loss: Any):
    """Adds the step's loss as ``value`` when the optimizer reads one."""
    if "value" not in opt_kwargs and reads_value(tx, params, opt_state):
        return {**opt_kwargs, "value": loss}
    return opt_kwargs


def split_output(out: Any, noise: bool) -> tuple:
    """The fused loop's output as ``(loss, aux, grads, state, tracker, scaled)``."""
    (out, new_state), tracker = out if noise else (out, None)
    if isinstance(out, ScaledGrads):
        (loss, aux), grads = out.value, out.grads
        return loss, aux, grads, new_state, tracker, out
    (loss, aux), grads = out
    return loss, aux, grads, new_state, tracker, None


def extras(tracker: Any, scaled: ScaledGrads | None, noise: bool) -> tuple:
    """What a step returns after its result: the tracker, then the loss scale."""
    return ((tracker,) if noise else ()) + (
        (scaled.loss_scale,) if scaled is not None else ()
    )


def keep_unless(finite: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``finite``, else ``old`` (leaf by leaf)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def check_loss_scale(loss_scaling: bool, loss_scale: Any, helper: str) -> None:
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
