# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`MultiSteps`: a drop-in for ``optax.MultiSteps`` built on our engine.

Constructor, methods and state fields match optax's, and so do the state's
semantics (``acc_grads`` is the running mean with ``use_grad_mean``, the sum
otherwise), so optax checkpoints restore into it. Two differences, both for
speed: the inner optimizer runs only on boundary steps, inside ``lax.cond``,
and ``acc_grads`` is not zeroed after an update (``mini_step == 0`` marks it
empty and the next mini-step overwrites it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ._engine import _make_engine, _Window
from ._extra_args import reads_value, value_dtype
from ._mistakes import warn_if_clipped_before


class MultiStepsState(NamedTuple):
    """State of `MultiSteps`, field for field as ``optax.MultiStepsState``.

    Attributes:
      mini_step: accepted mini-steps in the current window.
      gradient_step: number of updates emitted so far.
      inner_opt_state: the wrapped optimizer's state.
      acc_grads: the running mean (or sum) of the window's gradients; stale
        (not zeroed) when ``mini_step == 0``.
      skip_state: what ``should_skip_update_fn`` returned as its second output.
      acc_value: ours only, after optax's fields: the window's running
        ``value`` (the loss passed to ``update``) when the wrapped optimizer
        reads it (``reduce_on_plateau``, line searches), else ``()``.
    """

    mini_step: jax.typing.ArrayLike
    gradient_step: jax.typing.ArrayLike
    inner_opt_state: Any
    acc_grads: Any
    skip_state: Any = ()
    acc_value: Any = ()


class MultiStepsNoiseState(NamedTuple):
    """State of `MultiSteps` with ``noise_scale_decay``: `MultiStepsState`'s
    fields and ``noise_scale``, a `NoiseScaleState`. A separate type, so that
    without it the state stays field for field optax's."""

    mini_step: jax.typing.ArrayLike
    gradient_step: jax.typing.ArrayLike
    inner_opt_state: Any
    acc_grads: Any
    skip_state: Any
    acc_value: Any
    noise_scale: Any


class MultiSteps:
    """Accumulates gradients over ``every_k_schedule`` mini-steps; optax-compatible.

    Replace ``optax.MultiSteps`` by ``optax_accum.MultiSteps`` and nothing else
    changes, except that the inner optimizer no longer runs on hold steps.

    Args:
      opt: the wrapped optimizer.
      every_k_schedule: an int >= 1, or a function of the gradient step that
        returns the number of mini-steps per update.
      use_grad_mean: average the accumulated gradients (default) or sum them.
      should_skip_update_fn: optional, e.g. ``optax.skip_not_finite`` or
        ``optax_accum.skip_not_finite``: ``fn(updates, gradient_step, params)``
        returning ``(should_skip, skip_state)`` (or just ``should_skip``).
      accumulator_dtype: dtype of the accumulator: ``"promote"`` (the
        default: at least float32, of the gradient's own kind), a floating or
        complex dtype, or ``None`` for the gradient's dtype.
      defer_axes: as in `accumulate`: the mesh axes over which the gradients
        arrive unreduced (from `defer_reduction`), reduced once per update.
      noise_scale_decay: ``None`` (off) or the EMA decay in (0, 1) of the
        gradient noise scale, read with `noise_scale` (see `accumulate`).
        ``every_k_schedule`` may then be `adaptive_every_k`. The state is
        then a `MultiStepsNoiseState`.
      allow_value_fn: accept a ``value_fn`` extra argument (line searches),
        vouching that it computes the whole window's loss; see `accumulate`.

    Extra arguments of ``update`` mean what they mean for `accumulate`:
    ``value`` is averaged over the window (optax's ``MultiSteps`` passes the
    last mini-step's), ``grad`` is the accumulated gradient, and ``value_fn``
    needs ``allow_value_fn``.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> ms = optax_accum.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
      >>> params = {"w": jnp.zeros([])}
      >>> state = ms.init(params)
      >>> _, state = ms.update({"w": jnp.array(1.0)}, state, params)
      >>> u, state = ms.update({"w": jnp.array(3.0)}, state, params)
      >>> float(u["w"]), bool(ms.has_updated(state))
      (-2.0, True)
    """

    def __init__(
        self,
        opt: optax.GradientTransformation,
        every_k_schedule: int | Callable[[jax.Array], jax.typing.ArrayLike],
        use_grad_mean: bool = True,
        should_skip_update_fn: Callable[..., Any] | None = None,
        accumulator_dtype: Any = "promote",
        *,
        allow_value_fn: bool = False,
        defer_axes: Any = None,
        noise_scale_decay: float | None = None,
    ):
        self._opt = optax.with_extra_args_support(opt)
        self._noise = noise_scale_decay is not None
        self._engine = _make_engine(
            self._opt,
            every_k_schedule,
            "mean" if use_grad_mean else "sum",
            accumulator_dtype,
            should_skip_update_fn,
            None,
            names=("every_k_schedule", "should_skip_update_fn"),
            defer_axes=defer_axes,
            allow_value_fn=allow_value_fn,
            owner="MultiSteps",
            noise_scale_decay=noise_scale_decay,
        )

    @property
    def inner_opt(self) -> optax.GradientTransformationExtraArgs:
        return self._opt

    def _state(self, window: _Window, skip_state: Any) -> Any:
        fields = dict(
            mini_step=window.micro_step,
            gradient_step=window.update_step,
            inner_opt_state=window.inner_state,
            acc_grads=window.accumulator,
            skip_state=skip_state,
            acc_value=window.value,
        )
        if self._noise:
            return MultiStepsNoiseState(**fields, noise_scale=window.noise)
        return MultiStepsState(**fields)

    def init(self, params: optax.Params) -> MultiStepsState:
        window = self._engine.init_window(params)
        return self._state(window, self._engine.init_skip_state(params))

    def update(
        self,
        updates: optax.Updates,
        state: MultiStepsState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, MultiStepsState]:
        warn_if_clipped_before("MultiSteps")
        # Unit weights: the window's weight sum is its accepted mini-step count.
        mini_step = jnp.asarray(state.mini_step, jnp.int32)
        value = getattr(state, "acc_value", ())
        # An optax state has no value slot: the window's value starts here.
        if (
            not isinstance(state, MultiStepsState | MultiStepsNoiseState)
            and "value" in extra_args
            and reads_value(self._opt, params, state.inner_opt_state)
        ):
            value = jnp.asarray(extra_args["value"], value_dtype(params))
        window = _Window(
            micro_step=mini_step,
            update_step=jnp.asarray(state.gradient_step, jnp.int32),
            accumulator=state.acc_grads,
            weight_sum=mini_step.astype(jnp.float32),
            inner_state=state.inner_opt_state,
            value=value,
            noise=state.noise_scale if self._noise else (),
        )
        new_updates, window, _, _, skip_state = self._engine.step(
            updates, window, params, None, False, extra_args
        )
        return new_updates, self._state(window, skip_state)

    def has_updated(self, state: MultiStepsState | Any) -> jax.Array:
        """True when ``state`` comes right after an update (optax's definition).

        ``state`` may also be held by Flax's ``nnx.Optimizer`` (wrapped arrays).
        """
        mini_step, gradient_step = map(
            jnp.asarray, (state.mini_step, state.gradient_step)
        )
        return jnp.logical_and(mini_step == 0, gradient_step > 0)

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        return optax.GradientTransformationExtraArgs(init=self.init, update=self.update)
