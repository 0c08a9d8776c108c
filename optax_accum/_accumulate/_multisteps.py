# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`MultiSteps`: a drop-in for ``optax.MultiSteps`` built on our engine.

Constructor, methods and state fields match optax's, and so do the state's
semantics (``acc_grads`` is the running mean with ``use_grad_mean``, the sum
otherwise), so optax states, and optax checkpoints, restore into it: with our
extra features off the state flattens to optax's leaves under optax's names.
Two differences, both for speed: the inner optimizer runs only on boundary
steps, inside ``lax.cond``, and ``acc_grads`` is not zeroed after an update
(``mini_step == 0`` marks it empty and the next mini-step overwrites it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .. import _checks, _dtypes, _extra_args, _reduction, _schedules
from .. import _noise_scale as ns
from .._devices import Devices
from .._typing import AccumulatorDType, AxisName
from . import _skip, _value_since
from ._clip_warning import warn_if_clipped_before
from ._engine import Engine, Window, check_state


class MultiStepsState(NamedTuple):
    """State of `MultiSteps`: optax's ``MultiStepsState`` fields, then ours.

    Attributes:
      mini_step: accepted mini-steps in the current window.
      gradient_step: number of updates emitted so far.
      inner_opt_state: the wrapped optimizer's state.
      acc_grads: the running mean (or sum) of the window's gradients; stale
        (not zeroed) when ``mini_step == 0``.
      skip_state: what ``should_skip_update_fn`` returned as its second output.
      acc_value: ours, after optax's fields: the window's running ``value``
        (the loss passed to ``update``) when the wrapped optimizer reads it
        (``reduce_on_plateau``, line searches), else ``()``. In a state
        continued from an optax one (which holds no values), a pair
        ``(value, count)``: the values since then, and how many.
      noise_scale: ours: a `NoiseScaleState` with ``noise_scale_decay``, else
        ``()``.
      updated: ours: with ``should_skip_update_fn``, a boolean scalar, whether
        the call that produced the state emitted an update (optax's fields
        cannot tell a rejected mini-step after an update from the update);
        else ``()``.

    Our fields default to ``()``, and a field that is ``()`` is not part of
    the pytree: with our features off, the state has exactly optax's leaves
    under optax's field names, so a checkpoint of an ``optax.MultiSteps``
    state (Orbax, for one) restores into ``jax.eval_shape(ms.init, params)``.
    """

    mini_step: jax.typing.ArrayLike
    gradient_step: jax.typing.ArrayLike
    inner_opt_state: Any
    acc_grads: Any
    skip_state: Any = ()
    acc_value: Any = ()
    noise_scale: Any = ()
    updated: Any = ()

    def to_optax(self) -> optax.MultiStepsState:
        """This state as ``optax.MultiSteps`` reads it (our fields dropped).

        Our ``acc_grads`` is stale, not zero, at an empty window
        (``mini_step == 0``), and optax adds the next gradient to it, so
        handing our state to ``optax.MultiSteps`` directly gives a wrong
        update (the sum, with ``use_grad_mean=False``, counts the previous
        window again; the mean is off by a rounding of the stale buffer).
        This zeroes it where the window is empty, once, at the hand-over:
        zeroing it on every update instead would cost a pass over the
        accumulator per mini-step.

        Returns:
          An ``optax.MultiStepsState`` that ``optax.MultiSteps`` (with the
          same options) continues as it would its own: exactly at an empty
          window, to the rounding of the running mean mid-window.
        """
        empty = jnp.asarray(self.mini_step) == 0
        acc_grads = jax.tree.map(
            lambda a: jnp.where(empty, jnp.zeros_like(a), a), self.acc_grads
        )
        return optax.MultiStepsState(
            mini_step=self.mini_step,
            gradient_step=self.gradient_step,
            inner_opt_state=self.inner_opt_state,
            acc_grads=acc_grads,
            skip_state=self.skip_state,
        )


_OURS = frozenset(("acc_value", "noise_scale", "updated"))


def _is_off(x: Any) -> bool:
    return isinstance(x, tuple) and not x


def _flatten_with_keys(state: MultiStepsState):
    names = tuple(
        n for n in state._fields if n not in _OURS or not _is_off(getattr(state, n))
    )
    return [(jax.tree_util.GetAttrKey(n), getattr(state, n)) for n in names], names


def _flatten(state: MultiStepsState):
    children, names = _flatten_with_keys(state)
    return [c for _, c in children], names


def _unflatten(names: tuple[str, ...], children: Any) -> MultiStepsState:
    return MultiStepsState(**dict(zip(names, children, strict=True)))


# optax's fields always, ours only when on (a NamedTuple node keeps all).
jax.tree_util.register_pytree_with_keys(
    MultiStepsState, _flatten_with_keys, _unflatten, _flatten
)


def emitted(state: Any) -> jax.Array:
    """Whether the call that produced ``state`` (ours or optax's) emitted.

    Ours with a skip function records it. Without one every call is
    accepted, and optax's test is exact: right after an update the window is
    empty (an optax state with a skip function cannot say more than that
    test). Flax's ``nnx.Optimizer`` may hold the arrays wrapped.
    """
    updated = getattr(state, "updated", ())
    if not _is_off(updated):
        return jnp.asarray(updated)
    mini_step, gradient_step = map(jnp.asarray, (state.mini_step, state.gradient_step))
    return jnp.logical_and(mini_step == 0, gradient_step > 0)


class MultiSteps:
    """Accumulates gradients over ``every_k_schedule`` mini-steps; optax-compatible.

    Replace ``optax.MultiSteps`` by ``optax_accum.MultiSteps`` and nothing else
    changes, except that the inner optimizer no longer runs on hold steps.

    An ``optax.MultiSteps`` state continues in ours, mid-window too, and so
    does its checkpoint: with our features off, the state has optax's leaves
    under optax's names, so Orbax restores it into
    ``jax.eval_shape(ms.init, params)``. Our options may keep leaves that
    optax's state lacks (``updated`` with ``should_skip_update_fn``,
    ``acc_value`` where the wrapped optimizer reads ``value``,
    ``noise_scale``): restore into optax's structure,
    ``jax.eval_shape(lambda p: ms.init(p).to_optax(), params)``, and hand
    the result to `from_optax`, which fills them in, so the state keeps one
    structure from there on (a ``lax.scan`` carry must). The inner optimizer
    then still gets the window's value: over a whole window, the mean (the
    sum without ``use_grad_mean``) of its values, as ours does; in the window
    restored mid-way, the mean (or sum) of the values seen since the
    restore, as optax's state never held the ones before. The other
    way, hand optax ``state.to_optax()`` (`MultiStepsState.to_optax`), not
    our state itself: our ``acc_grads`` is not zeroed at an empty window.

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
        complex dtype, or ``None`` for the gradient's dtype; or a pytree
        prefix of the parameters with one of these per subtree.
      data_axes: as in `accumulate`: the mesh axes over which the gradients
        arrive unreduced (from `defer_reduction`), reduced once per update.
      noise_scale_decay: ``None`` (off) or the EMA decay in (0, 1) of the
        gradient noise scale, read with `noise_scale` (see `accumulate`).
        ``every_k_schedule`` may then be `adaptive_every_k`. The state's
        ``noise_scale`` field then holds a `NoiseScaleState`.
      allow_value_fn: accept a ``value_fn`` extra argument (line searches),
        vouching that it computes the whole window's loss; see `accumulate`.

    Extra arguments of ``update`` mean what they mean for `accumulate`:
    ``value`` is averaged over the window (optax's ``MultiSteps`` passes the
    last mini-step's), ``grad`` is the accumulated gradient, ``value_fn``
    needs ``allow_value_fn`` (or ``every_k_schedule=1``), and
    ``close_window`` (a boolean scalar) closes the window early. Every
    mini-step weighs 1, as in optax: ``weight=`` raises a TypeError (use
    `accumulate` for weighted micro-batches).

    Raises:
      TypeError: for an ``opt`` that is not an optimizer (e.g. the factory
        ``optax.adam`` uncalled), and the errors of `accumulate` in this
        class's argument names.

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
        accumulator_dtype: AccumulatorDType = "promote",
        *,
        allow_value_fn: bool = False,
        data_axes: AxisName | None = None,
        noise_scale_decay: float | None = None,
    ):
        _checks.optimizer(opt, "opt")
        self._opt = optax.with_extra_args_support(opt)
        self._engine = _engine_for(
            self._opt,
            every_k_schedule,
            use_grad_mean,
            should_skip_update_fn,
            accumulator_dtype,
            allow_value_fn,
            data_axes,
            noise_scale_decay,
        )

    @property
    def inner_opt(self) -> optax.GradientTransformationExtraArgs:
        return self._opt

    def init(self, params: optax.Params) -> MultiStepsState:
        window = self._engine.init_window(params)
        updated = () if self._engine.skip is None else jnp.zeros([], jnp.bool_)
        return _state(window, self._engine.init_skip_state(params), updated)

    def update(
        self,
        updates: optax.Updates,
        state: MultiStepsState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, MultiStepsState]:
        warn_if_clipped_before("MultiSteps")
        if "weight" in extra_args:
            raise TypeError(
                "`MultiSteps.update` takes no `weight`: like optax.MultiSteps, "
                "every mini-step weighs 1. For weighted micro-batches (e.g. "
                "token counts) use optax_accum.accumulate, whose update takes "
                "`weight=`."
            )
        close_window = extra_args.pop("close_window", False)
        state = self._complete(state, params, value="value" in extra_args)
        window = self._window(state)
        out = self._engine.step(updates, window, params, None, close_window, extra_args)
        updated = () if self._engine.skip is None else out.stepped
        return out.updates, _state(out.window, out.skip_state, updated)

    def from_optax(self, state: Any, params: optax.Params) -> MultiStepsState:
        """An ``optax.MultiSteps`` state (or a checkpoint of one) as ours.

        Fills in the leaves that our options keep and optax's state lacks, so
        that the result has the structure that every `update` returns (a
        ``lax.scan`` carry must keep its structure):

        - ``updated`` (with ``should_skip_update_fn``): optax's test,
          ``mini_step == 0`` after an update;
        - ``skip_state``: the skip function's initial one where optax's state
          holds another (no skip function there, or another one), ``()``
          without a skip function here;
        - ``acc_value`` (the wrapped optimizer reads ``value``): an empty
          `ValueSince`. The window then passes on the mean (or sum) of the
          values seen from here on: optax's state never held the earlier
          ones. A window restored mid-way that has seen no value yet does
          not close (neither by ``close_window`` nor at ``k``) until it has
          one: the inner optimizer never gets a value it was not given;
        - ``noise_scale`` (with ``noise_scale_decay``): a fresh estimate; a
          window restored mid-way measures nothing (its earlier micro-batch
          gradients are gone), the next ones do.

        `update` does the same to a state that lacks them, so a Python loop
        may pass optax's state directly; a ``lax.scan`` needs this first.

        Args:
          state: an ``optax.MultiStepsState``, or ours restored without some
            of our leaves (e.g. ``_replace(updated=(), acc_value=())``).
          params: the parameters (as passed to `update`).

        Returns:
          A `MultiStepsState` with every leaf that `update` returns.

        Raises:
          TypeError: if ``state`` has not optax's ``MultiStepsState`` fields.

        Examples:
          >>> import jax, jax.numpy as jnp, optax, optax_accum
          >>> opt = optax.sgd(1.0)
          >>> skip = {"should_skip_update_fn": optax.skip_not_finite}
          >>> theirs = optax.MultiSteps(opt, 2, **skip)
          >>> ours = optax_accum.MultiSteps(opt, 2, **skip)
          >>> params = {"w": jnp.zeros([])}
          >>> state = theirs.init(params)
          >>> _, state = theirs.update({"w": jnp.array(1.0)}, state, params)
          >>> state = ours.from_optax(state, params)
          >>> step = lambda s, g: (ours.update({"w": g}, s, params)[1], None)
          >>> state, _ = jax.lax.scan(step, state, jnp.array([3.0, 5.0]))
          >>> int(state.gradient_step), int(state.mini_step)
          (1, 1)
        """
        return self._complete(state, params, value=True)

    def _complete(self, state: Any, params: Any, *, value: bool) -> MultiStepsState:
        """``state`` with every leaf our options keep (see `from_optax`);
        ``value``: whether a value slot may be needed (a ``value`` is passed)."""
        check_state(state, optax.MultiStepsState._fields, "MultiSteps")
        engine = self._engine
        mini_step = jnp.asarray(state.mini_step, jnp.int32)
        skip_state, updated = state.skip_state, getattr(state, "updated", ())
        if engine.skip is None:
            skip_state = ()  # what every update returns (optax's had one)
        else:
            # An optax state without a skip function (or with another one)
            # holds another skip state than every update returns.
            fresh = jax.eval_shape(engine.init_skip_state, params)
            if jax.tree.structure(skip_state) != jax.tree.structure(fresh):
                skip_state = engine.init_skip_state(params)
            if _is_off(updated):
                updated = emitted(state)
        acc_value = getattr(state, "acc_value", ())
        if (
            _is_off(acc_value)
            and value
            and _extra_args.reads_value(self._opt, params, state.inner_opt_state)
        ):
            acc_value = _value_since.empty(_extra_args.value_dtype(params))
        noise = getattr(state, "noise_scale", ())
        if engine.noise_scale_decay is not None and _is_off(noise):
            noise = ns.init(engine.devices.slot, engine.adaptive)
            # Mid-window the earlier micro-batches' norms are gone: a NaN
            # count fails the measurement's test (count > 1) until the next
            # window resets it.
            noise = noise._replace(count=jnp.where(mini_step > 0, jnp.nan, noise.count))
        return MultiStepsState(
            mini_step=state.mini_step,
            gradient_step=state.gradient_step,
            inner_opt_state=state.inner_opt_state,
            acc_grads=state.acc_grads,
            skip_state=skip_state,
            acc_value=acc_value,
            noise_scale=noise,
            updated=updated,
        )

    def _window(self, state: MultiStepsState) -> Window:
        """Our (completed) state as the engine's window."""
        mini_step = jnp.asarray(state.mini_step, jnp.int32)
        # Unit weights: the window's mean weight is 1 once it holds one.
        weight_dtype = _dtypes.weight_dtype(state.acc_grads)
        return Window(
            micro_step=mini_step,
            update_step=jnp.asarray(state.gradient_step, jnp.int32),
            accumulator=state.acc_grads,
            weight=(mini_step > 0).astype(weight_dtype),
            inner_state=state.inner_opt_state,
            value=state.acc_value,
            noise=state.noise_scale,
        )

    def has_updated(self, state: MultiStepsState | Any) -> jax.Array:
        """Whether the call that produced ``state`` emitted an update.

        As `optax_accum.has_updated` reads it, and as `accumulate`'s: False
        after a mini-step that ``should_skip_update_fn`` rejected, even right
        after an update (where optax's own test, ``mini_step == 0``, says
        True). ``state`` may also be held by Flax's ``nnx.Optimizer``
        (wrapped arrays), or be optax's (then optax's test is used).
        """
        return emitted(state)

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        return optax.GradientTransformationExtraArgs(init=self.init, update=self.update)


def _state(window: Window, skip_state: Any, updated: Any) -> MultiStepsState:
    return MultiStepsState(
        mini_step=window.micro_step,
        gradient_step=window.update_step,
        inner_opt_state=window.inner_state,
        acc_grads=window.accumulator,
        skip_state=skip_state,
        acc_value=window.value,
        noise_scale=window.noise,
        updated=updated,
    )


def _engine_for(
    opt, every_k_schedule, use_grad_mean, should_skip_update_fn,
    accumulator_dtype, allow_value_fn, data_axes, noise_scale_decay,
) -> Engine:  # fmt: skip
    """`MultiSteps`' options, checked in its (optax's) names, as an engine."""
    _schedules.check(every_k_schedule, "every_k_schedule")
    reduction = "mean" if use_grad_mean else "sum"
    _skip.check(should_skip_update_fn, "should_skip_update_fn")
    data_axes = _checks.axis_names(data_axes, "data_axes") or ()
    adaptive = isinstance(every_k_schedule, _schedules.AdaptiveEveryK)
    _checks.needs_whole_gradients(
        data_axes, {"should_skip_update_fn": should_skip_update_fn}
    )
    one = _schedules.is_static_one(every_k_schedule)
    decay = ns.check_options(
        noise_scale_decay, adaptive, reduction, "every_k_schedule", data_axes,
        single=one, axis_name_option=False,
    )  # fmt: skip
    allow = bool(allow_value_fn) or one
    return Engine(
        inner=opt,
        k_of=_schedules.k_of(every_k_schedule, "every_k_schedule"),
        adaptive=every_k_schedule if adaptive else None,
        reduction=_reduction.get(reduction),
        accumulator_dtype=_dtypes.canonical(accumulator_dtype),
        skip=_skip.decider(should_skip_update_fn, "should_skip_update_fn"),
        devices=Devices(None),
        data_axes=data_axes,
        extra_args=functools.partial(
            _extra_args.read, allow_value_fn=allow, owner="MultiSteps"
        ),
        noise_scale_decay=decay,
    )
