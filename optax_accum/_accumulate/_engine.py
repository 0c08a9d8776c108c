# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The accumulation engine shared by `accumulate` and the `MultiSteps` drop-in.

`Engine.step` is one micro-step, and reads as the data path:

    admit the micro-batch -> accumulate it -> at a boundary: reduce over
    devices -> inner optimizer -> its updates; on a hold step: zeros ->
    the next window.

The parts it calls each live with their concept: the mean/sum arithmetic in
`_reduction`, the weight contract in `_weights`, local vs per-device windows
in `_devices`, the extra args in `_extra_args`, the k of a window in
`_schedules`, the skip decision in `_skip`, the noise scale in `_noise_scale`,
buffers and their shardings in `_sharding`, and the zeros of a hold step in
`_compiler`. The front-ends validate their options, in their own names, and
hand the engine checked parts; the public states map onto `Window`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from .. import _compiler, _dtypes, _extra_args, _partial_sums, _sharding, _weights
from .. import _noise_scale as ns
from .. import _offload as memory
from .._checks import bool_scalar
from .._devices import Devices
from .._reduction import Mean, Sum
from . import _hold, _skip, _value_since


class Window(NamedTuple):
    """What the engine reads and writes; both public states map onto it.

    ``weight`` is the mean of the window's accepted weights (so that it cannot
    overflow), per device under an axis name; the window's total weight is
    ``micro_step * weight``.
    """

    micro_step: jax.Array
    update_step: jax.Array
    accumulator: optax.Updates
    weight: jax.Array
    inner_state: optax.OptState
    # The value slot: a scalar, a `_value_since.ValueSince` (restored without
    # one), or () if ``inner`` ignores value.
    value: Any = ()
    noise: Any = ()


class Admitted(NamedTuple):
    """One micro-batch, as `Engine._admit` let it in.

    ``weight`` is 0 where the micro-batch contributes nothing: rejected
    (``accept`` false), or a bad weight on one device of several.
    """

    grads: optax.Updates
    weight: jax.Array
    accept: jax.Array
    close: jax.Array
    skip_state: Any
    args: _extra_args.WindowArgs


class Step(NamedTuple):
    """What one micro-step returns to the front-end."""

    updates: optax.Updates
    window: Window
    stepped: jax.Array
    skipped: jax.Array
    skip_state: Any


KOf = Callable[[jax.Array, Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class Engine:
    """A checked configuration, built by a front-end; see `step`.

    Attributes:
      inner: the inner optimizer (with extra-args support).
      k_of: ``(update_step, noise) -> k`` of the window it opens.
      adaptive: the `AdaptiveEveryK` schedule, if any (fed by the noise scale).
      reduction: the `Mean` or `Sum` strategy.
      accumulator_dtype: the canonical accumulator dtype policy (scalar or
        `_dtypes.PerLeaf`).
      skip: the checked skip function (`_skip.Decider`), if any.
      devices: local, or per device of an axis name.
      data_axes: mesh axes over which the gradients arrive unreduced.
      extra_args: how to read one call's extra args,
        ``(extra_args, *, value_slot) -> WindowArgs`` (`_extra_args.read`).
      noise_scale_decay: the noise-scale EMA decay, or None.
      clear_sums: zero the window's sums in the boundary branch, so that no
        state leaf holds them once the window is emitted (the privacy wing:
        the clipped sum is secret until it is noised). Off elsewhere: the
        next window overwrites the stale buffer without a pass of its own.
    """

    inner: optax.GradientTransformationExtraArgs
    k_of: KOf
    adaptive: Any
    reduction: Mean | Sum
    accumulator_dtype: Any
    skip: _skip.Decider | None
    devices: Devices
    data_axes: tuple[str, ...]
    extra_args: Callable[..., _extra_args.WindowArgs]  # (extra_args, *, value_slot)
    noise_scale_decay: float | None
    clear_sums: bool = False

    # ---- the state ---------------------------------------------------------

    def init_window(self, params: optax.Params) -> Window:
        inner_state = self.inner.init(params)
        dtypes = _dtypes.resolve(self.accumulator_dtype, params)
        accumulator = jax.tree.map(self._buffer_like, params, dtypes)
        slot = self.devices.slot
        value = ()
        if _extra_args.reads_value(self.inner, params, inner_state):
            value = jnp.zeros(slot, _extra_args.value_dtype(params))
        noise = ()
        if self.noise_scale_decay is not None:
            noise = ns.init(slot, self.adaptive)
        return Window(
            micro_step=jnp.zeros([], jnp.int32),
            update_step=jnp.zeros([], jnp.int32),
            accumulator=accumulator,
            weight=jnp.zeros(slot, _dtypes.weight_dtype(accumulator)),
            inner_state=inner_state,
            value=value,
            noise=noise,
        )

    def _buffer_like(self, x: jax.Array, dtype: Any) -> jax.Array:
        """The accumulator leaf of a parameter: its sharding (unreduced over
        the data axes), never a replicated copy of a sharded parameter."""
        deferred = _sharding.deferrable(x, self.data_axes)
        zeros = _sharding.zeros_like(x, dtype, deferred)
        return self.devices.local(zeros)

    def init_skip_state(self, params: optax.Params) -> Any:
        if self.skip is None:
            return ()
        zeros = jax.tree.map(jnp.zeros_like, params)
        step, one = jnp.zeros([], jnp.int32), jnp.ones([], jnp.float32)
        _, skip_state = self.skip(zeros, step, params, one, Devices())
        return self.devices.local(skip_state)

    # ---- one micro-step ----------------------------------------------------

    def step(self, grads, window: Window, params, weight, close_window, extra_args):
        """grads -> accumulate -> (boundary: reduce -> inner -> updates)."""
        with jax.named_scope("optax_accum/accumulate"):
            _check_grads(grads, window.accumulator, self.devices)
            mb = self._admit(grads, window, params, weight, close_window, extra_args)
            acc, mean_weight, value = self._accumulate(mb, window)
            noise = window.noise
            if self.noise_scale_decay is not None:
                noise = ns.observe(noise, mb.grads, mb.weight, window.micro_step == 0)
            micro = window.micro_step + mb.accept.astype(jnp.int32)
            k = self.k_of(window.update_step, window.noise)
            emit = (micro > 0) & ((micro >= k) | mb.close)
            if isinstance(value, _value_since.ValueSince) and mb.args.value is not None:
                # A window restored mid-way holds no value until it sees one:
                # it stays open, so the inner never gets a value it was not
                # given (`MultiSteps.from_optax`).
                emit = emit & (value.count > 0)
            updates, inner_state, stepped, stats, acc = self._update_or_hold(
                emit, mb, window, params, acc, _value_since.current(value),
                mean_weight, micro, noise,
            )  # fmt: skip
            if self.noise_scale_decay is not None:
                noise = ns.close(
                    noise,
                    emit,
                    stats,
                    self.noise_scale_decay,
                    self.adaptive,
                    self.devices.count(),
                )
            new_window = Window(
                micro_step=jnp.where(emit, 0, micro).astype(jnp.int32),
                update_step=window.update_step + stepped.astype(jnp.int32),
                accumulator=acc,
                weight=jnp.where(emit, 0, mean_weight)
                .astype(window.weight.dtype)
                .reshape(self.devices.slot),
                inner_state=inner_state,
                value=value,
                noise=noise,
            )
            skipped = jnp.logical_not(mb.accept)
            return Step(updates, new_window, stepped, skipped, mb.skip_state)

    def _admit(self, grads, window, params, weight, close_window, extra_args):
        """The checks, the extra args and the skip decision for one call."""
        w = _weights.check(weight, window.weight.dtype)
        close = bool_scalar(close_window, "close_window")
        value_slot = _value_since.is_slot(window.value)
        args = self.extra_args(extra_args, value_slot=value_slot)
        bad_weight = jnp.logical_not(_weights.usable(w))
        w = _weights.admitted(w)
        if self.skip is None:
            skip_state = ()
            # Per device, agreeing would cost an all-reduce per micro-step:
            # a bad weight there just weighs 0 (`_weights`' contract).
            should_skip = jnp.bool_(False) if self.devices.mapped else bad_weight
        else:
            step = window.update_step
            should_skip, skip_state = self.skip(grads, step, params, w, self.devices)
            # Every device must agree, or their windows (and collectives)
            # would diverge: one scalar all-reduce per micro-step.
            should_skip = self.devices.agree(should_skip | bad_weight)
        accept = jnp.logical_not(should_skip)
        w = jnp.where(accept, w, jnp.zeros_like(w))
        skip_state = self.devices.local(skip_state)
        return Admitted(grads, w, accept, close, skip_state, args)

    def _accumulate(self, mb: Admitted, window: Window):
        """The micro-batch into the window: one fused pass per leaf.

        The accumulator is updated in place, outside the boundary's cond, and
        never reset: the window's first contribution overwrites the stale
        buffer (``fresh``). Routing it through the cond, or a reset pass,
        costs XLA a full copy of it per micro-step. A weight-0 micro-batch
        contributes nothing, whatever its values: select, not multiply, as
        0 * NaN = NaN.
        """
        first = window.micro_step == 0
        old = jnp.where(first, 0, window.weight.reshape([]))
        new, coef = _weights.running_mean(old, window.micro_step + 1, mb.weight)
        new = jnp.where(mb.accept, new, old)
        fresh = old == 0
        contributes = mb.weight > 0

        def add(g, a):
            if _dtypes.is_float0(g):  # an integer input's gradient: nothing
                return a
            g = jnp.reshape(g, self.devices.slot + jnp.shape(g))
            written = jnp.where(
                fresh,
                self.reduction.first(g, mb.weight),
                self.reduction.step(a, g, coef, mb.weight),
            )
            return jnp.where(contributes, written.astype(a.dtype), a)

        acc = jax.tree.map(add, mb.grads, window.accumulator)
        value = window.value
        if isinstance(value, _value_since.ValueSince) and mb.args.value is not None:
            value = _value_since.add(
                value, mb.args.value, first, mb.weight, self.reduction
            )
        elif mb.args.value is not None:
            value = add(mb.args.value, window.value)
        return acc, new, value

    def _update_or_hold(
        self, emit, mb, window, params, acc, value, weight, micro, noise
    ):
        """The single branch: the inner optimizer on boundary steps only (a
        `lax.cond`, a loop of at most one trip on GPU: `_compiler.boundary_cond`;
        with ``clear_sums``, the window's sums zeroed there too)."""
        # Both branches return the inner state where `offload` keeps it,
        # whatever memory it arrived in (a restore, a user's write).
        inner_state = memory.settle(
            self.inner, window.inner_state, mb.grads if params is None else params
        )
        shapes = jax.eval_shape(
            functools.partial(self._inner_updates, mb.args),
            mb.grads,
            inner_state,
            params,
            mb.args.dynamic,
        )
        # Without an axis name the total weight is known here: a window whose
        # weights sum to 0 emits zeros and leaves the inner state untouched.
        run = emit if self.devices.mapped else emit & (weight > 0)
        local_stats = ns.local_stats(noise)

        def boundary(acc, value, weight, micro, inner_state, params, dynamic, stats):
            with jax.named_scope("optax_accum/boundary"):
                out = self._boundary(
                    mb, shapes, acc, value, weight, micro, inner_state, params,
                    dynamic, stats,
                )  # fmt: skip
                # Only with clear_sums does the accumulator leave the cond.
                return (
                    *out,
                    jax.tree.map(_hold.zeros_like, acc) if self.clear_sums else (),
                )

        def hold(acc, value, weight, micro, inner_state, params, dynamic, stats):
            emitted = jax.eval_shape(
                boundary, acc, value, weight, micro, inner_state, params, dynamic,
                stats,
            )[0]  # fmt: skip
            del value, weight, micro, params, dynamic
            zeros = _hold.updates(shapes, window.update_step, emitted)
            stats = ns.zero_stats() if stats else ()
            return zeros, inner_state, False, stats, acc if self.clear_sums else ()

        operands = (
            acc, value, weight, micro, inner_state, params, mb.args.dynamic,
            local_stats,
        )  # fmt: skip
        updates, inner_state, stepped, stats, cleared = _compiler.boundary_cond(
            run, boundary, hold, *operands, carried=4
        )
        acc = cleared if self.clear_sums else acc
        return updates, inner_state, jnp.asarray(stepped, jnp.bool_), stats, acc

    def _inner_updates(self, args, grads, inner_state, params, dynamic):
        """What the boundary emits (traced for the hold step's zeros)."""
        g = jax.tree.map(_window_gradient, grads)
        kwargs = _extra_args.for_inner(args, dynamic, g, jnp.float32(0))
        return self.inner.update(g, inner_state, params, **kwargs)[0]

    def _boundary(
        self, mb, shapes, acc, value, weight, micro, inner_state, params, dynamic,
        stats,
    ):  # fmt: skip
        """Reduce over devices -> inner -> its updates."""
        (g, value), total, sums = self._reduce((acc, value), weight, micro, stats)
        noise_stats = ns.boundary_stats(g, (*sums, total)) if stats else ()
        g = _like(g, mb.grads)

        def step_inner(g, value, inner_state, params, dynamic):
            kwargs = _extra_args.for_inner(mb.args, dynamic, g, value)
            updates, new_inner = self.inner.update(g, inner_state, params, **kwargs)
            new_inner = memory.keep(_like(new_inner, inner_state), inner_state)
            return updates, new_inner, True

        def skip_inner(g, value, inner_state, params, dynamic):
            # The zeros vary over the manual axes the inner's updates vary
            # over (a tensor-parallel leaf over the model axis, once the
            # data axes are reduced): the branches' types must agree.
            emitted = jax.eval_shape(step_inner, g, value, inner_state, params, dynamic)
            return (
                _hold.updates(shapes, micro, emitted[0]),
                inner_state,
                False,
            )

        if not self.devices.mapped:  # the predicate already checked the weight
            return (*step_inner(g, value, inner_state, params, dynamic), noise_stats)
        # A window whose weights sum to 0 on every device steps nothing.
        out = lax.cond(
            total > 0, step_inner, skip_inner, g, value, inner_state, params, dynamic
        )
        return (*out, noise_stats)

    def _reduce(self, tree, weight, micro, stats):
        """The window over devices: the tree, its total weight and the noise
        sums, in one all-reduce (``weight`` is the device's mean weight)."""
        tree = self.devices.unslot(tree)
        tree = jax.tree.map(_partial_sums.finish, tree)  # the deferred reduction
        # A device (or window) whose weights sum to 0 holds a stale buffer.
        tree = jax.tree.map(lambda a: jnp.where(weight.reshape([]) > 0, a, 0), tree)
        share = weight.reshape([]) / self.devices.count()  # cannot overflow
        tree, total, stats = self.devices.reduce(
            tree, share, mean=self.reduction.is_mean, extras=stats
        )
        total = total * self.devices.count() * micro.astype(total.dtype)
        return tree, total, stats


def check_state(state: Any, fields: tuple[str, ...], owner: str) -> None:
    """``state`` must be the optimizer's state (e.g. not the parameters passed
    in its place: ``update(grads, params, state)``)."""
    missing = [f for f in fields if not hasattr(state, f)]
    if missing:
        raise TypeError(
            f"`state` must be {owner}'s state (from its `init` or a previous "
            f"`update`), got a {type(state).__name__} without "
            f"`{missing[0]}`. The call is `update(grads, state, params)`: "
            "were `state` and `params` swapped?"
        )


def _check_grads(grads: Any, accumulator: Any, devices: Devices) -> None:
    """The gradients must match the state: structure, shapes, shardings."""
    tree = jax.tree.structure(accumulator)
    if jax.tree.structure(grads) != tree:
        raise ValueError(
            "`grads` must have the tree structure of the parameters the "
            f"state was initialised with: expected {tree}, got "
            f"{jax.tree.structure(grads)}."
        )
    slot = devices.slot
    paths = jax.tree_util.tree_leaves_with_path(grads)
    for (path, g), a in zip(paths, jax.tree.leaves(accumulator), strict=True):
        if slot + jnp.shape(g) != jnp.shape(a):
            raise ValueError(
                "`grads` leaf shapes must match the state's accumulator: got "
                f"{jnp.shape(g)}, expected {jnp.shape(a)[len(slot) :]} at "
                f"`grads{jax.tree_util.keystr(path)}`."
            )
    _sharding.check_like(grads, accumulator, len(slot))


def _window_gradient(g: Any) -> Any:
    """What the boundary passes on for a leaf shaped like ``g``."""
    return _partial_sums.finish(g) if not _dtypes.is_float0(g) else g


def _like(tree: Any, like: Any) -> Any:
    """``tree`` in ``like``'s dtypes: the reduced gradient in the gradients'
    dtypes, the inner state in its own (PRNG keys and other extended dtypes
    stay as they are; integer inputs' gradients stay float0)."""

    def cast(x, y):
        y_dtype = getattr(y, "dtype", None)
        if y_dtype is None:
            return x
        if y_dtype == jax.dtypes.float0:
            return np.zeros(np.shape(y), jax.dtypes.float0)
        if x.dtype == y_dtype or jnp.issubdtype(y_dtype, jax.dtypes.extended):
            return x
        return x.astype(y_dtype)

    return jax.tree.map(cast, tree, like)
