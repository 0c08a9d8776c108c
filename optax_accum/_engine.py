# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The accumulation engine shared by `accumulate` and the `MultiSteps` drop-in.

One micro-step reads grads -> accumulate -> (at a boundary) reduce -> inner ->
updates: the accumulator arithmetic (weighted running mean or weighted sum),
the window counters, the skip and weight checks and the single `lax.cond` that
runs the inner optimizer on boundary micro-steps only. Sharding is asked of
`_layout`, the gradient noise scale of `_noise_scale`, the window's extra
arguments of `_extra_args`; the public states map onto `_Window`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax
from jax import lax

from . import _layout
from . import _noise_scale as ns
from ._extra_args import check_value, check_value_fn, reads_value, value_dtype
from ._validation import (
    accumulator_dtype_for,
    canonical_accumulator_dtype,
    check_close_window,
    check_every_k,
    check_reduction,
    check_skip_fn,
    check_weight,
    normalize_skip_result,
    weight_ok,
)

EveryK = int | Callable[[jax.Array], jax.typing.ArrayLike]


class SkipFn(Protocol):
    """Decides whether a micro-batch's gradients are rejected.

    Called as ``skip_fn(grads, update_step, params)``. Returns a boolean scalar
    (``True`` rejects the micro-batch), or an optax-style tuple
    ``(should_skip, skip_state)`` whose second element is stored in the state.
    """

    def __call__(
        self, grads: optax.Updates, update_step: jax.Array, params: optax.Params | None
    ) -> jax.Array | tuple[jax.Array, Any]: ...


class _Window(NamedTuple):
    """What the engine reads and writes; both public states map onto it."""

    micro_step: jax.Array
    update_step: jax.Array
    accumulator: optax.Updates
    weight_sum: jax.Array
    inner_state: optax.OptState
    value: Any = ()  # the value slot: a scalar, or () if ``inner`` ignores value
    noise: Any = ()


class _Engine(NamedTuple):
    init_window: Callable[[optax.Params], _Window]
    step: Callable[..., tuple[optax.Updates, _Window, jax.Array, jax.Array, Any]]
    init_skip_state: Callable[[optax.Params], Any]


def _split_extra_args(extra_args: dict[str, Any]) -> tuple[dict, dict]:
    """Splits extra args into array pytrees (cond operands) and the rest."""
    dynamic, static = {}, {}
    for key, value in extra_args.items():
        leaves = jax.tree.leaves(value)
        if leaves and all(isinstance(x, jax.Array) for x in leaves):
            dynamic[key] = value
        else:
            static[key] = value
    return dynamic, static


def _zeros(shapes: Any, counter: jax.Array) -> Any:
    """Exact zeros for each leaf, each written by its own broadcast.

    XLA merges identical broadcasts and then copies the one buffer into each
    output. ``counter`` is a traced int32 that is never negative, so
    ``counter == -(i + 1)`` is always false, but XLA cannot prove it: each
    leaf gets a distinct scalar source and its own write-only broadcast.
    """
    leaves, treedef = jax.tree.flatten(shapes)
    zeros = [
        _layout.broadcast(jnp.where(counter == -(i + 1), 1, 0).astype(s.dtype), s)
        for i, s in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, zeros)


def _make_engine(
    inner: optax.GradientTransformation,
    every_k: EveryK,
    reduction: str,
    accumulator_dtype: Any,
    skip_fn: SkipFn | None,
    axis_name: Any,
    names: tuple[str, str] = ("every_k", "skip_fn"),
    defer_axes: Any = None,
    allow_value_fn: bool = False,
    owner: str = "accumulate",
    noise_scale_decay: float | None = None,
) -> _Engine:
    """Builds the engine; ``names`` are the caller's names for every_k, skip_fn."""
    k_arg, skip_arg = names
    defer = _layout.axes_of(defer_axes)
    if defer and axis_name is not None:
        raise ValueError(
            "Pass either `axis_name` (inside shard_map/pmap) or `defer_axes` "
            f"(global view), not both: got axis_name={axis_name!r}, "
            f"defer_axes={defer_axes!r}."
        )
    inner = optax.with_extra_args_support(inner)
    decay = ns.check_decay(noise_scale_decay)
    if decay is not None and defer:
        raise ValueError(
            "`noise_scale_decay` needs each device's micro-batch gradients, which "
            "`defer_axes` leaves as unreduced partial sums: use one or the other "
            f"(got defer_axes={defer_axes!r})."
        )
    schedule = every_k if isinstance(every_k, ns.AdaptiveEveryK) else None
    if schedule is None:
        check_every_k(every_k, arg=k_arg)
    check_skip_fn(skip_fn, skip_arg)
    check_reduction(reduction)
    ns.check_engine_args(decay, schedule, reduction, k_arg)
    acc_dtype = canonical_accumulator_dtype(accumulator_dtype)
    mean = reduction == "mean"
    # With an axis name, device-local leaves carry a leading axis of length 1,
    # so that under shard_map they stack into a global (num_devices, ...) array.
    slot = () if axis_name is None else (1,)

    def acc_like(x: jax.Array) -> jax.Array:
        # Each buffer has its parameter's sharding (unreduced over the
        # deferred axes): never a replicated copy of a sharded parameter.
        dtype = accumulator_dtype_for(jnp.result_type(x), acc_dtype)
        zeros = _layout.zeros_like(x, dtype, _layout.deferrable(x, defer))
        return jnp.reshape(zeros, slot + jnp.shape(x)) if slot else zeros

    def local(x: Any) -> Any:
        return jax.tree.map(lambda a: jnp.reshape(a, slot + jnp.shape(a)), x)

    def init_window(params: optax.Params) -> _Window:
        inner_state = inner.init(params)
        value = ()
        if reads_value(inner, params, inner_state):
            value = jnp.zeros(slot, value_dtype(params))
        return _Window(
            micro_step=jnp.zeros([], jnp.int32),
            update_step=jnp.zeros([], jnp.int32),
            accumulator=jax.tree.map(acc_like, params),
            weight_sum=jnp.zeros(slot, jnp.float32),
            inner_state=inner_state,
            value=value,
            noise=() if decay is None else ns.init(slot, schedule),
        )

    def init_skip_state(params: optax.Params) -> Any:
        if skip_fn is None:
            return ()
        zeros = jax.tree.map(jnp.zeros_like, params)
        _, skip_state = normalize_skip_result(
            skip_fn(zeros, jnp.zeros([], jnp.int32), params), skip_arg
        )
        return local(skip_state)

    def current_k(update_step: jax.Array) -> jax.Array:
        if callable(every_k):
            k = every_k(update_step)
            check_every_k(k, from_schedule=True, arg=k_arg)
            return jnp.maximum(jnp.asarray(k, jnp.int32), 1)
        return jnp.asarray(every_k, jnp.int32)

    def step(grads, window: _Window, params, weight, close_window, extra_args):
        acc_tree = jax.tree.structure(window.accumulator)
        if jax.tree.structure(grads) != acc_tree:
            raise ValueError(
                "`grads` must have the tree structure of the parameters the "
                f"state was initialised with: expected {acc_tree}, got "
                f"{jax.tree.structure(grads)}."
            )
        for g, a in zip(
            jax.tree.leaves(grads), jax.tree.leaves(window.accumulator), strict=True
        ):
            if slot + jnp.shape(g) != jnp.shape(a):
                raise ValueError(
                    "`grads` leaf shapes must match the state's accumulator: got "
                    f"{jnp.shape(g)}, expected {jnp.shape(a)[len(slot) :]}."
                )
        _layout.check_like(grads, window.accumulator, len(slot))
        w = check_weight(weight)
        close_window = check_close_window(close_window)
        extra_args = dict(extra_args)
        check_value_fn(extra_args, allow_value_fn, owner)
        # Over a window, `value` and `grad` describe the large batch: the value
        # is accumulated in its slot (if `inner` reads it), `grad` replaced.
        has_value = not isinstance(window.value, tuple) and "value" in extra_args
        value_in = check_value(extra_args.pop("value")) if has_value else None
        pass_grad = extra_args.pop("grad", None) is not None

        # A weight that is not finite or is negative rejects the micro-batch.
        # With an axis name and no skip_fn, agreeing would cost an all-reduce
        # per micro-step: the device's micro-batch then just weighs 0.
        bad_weight = jnp.logical_not(weight_ok(w))
        if skip_fn is None:
            skip_state = ()
            should_skip = bad_weight if axis_name is None else jnp.bool_(False)
        else:
            should_skip, skip_state = normalize_skip_result(
                skip_fn(grads, window.update_step, params), skip_arg
            )
            should_skip = jnp.logical_or(should_skip, bad_weight)
            if axis_name is not None:
                # Every device must agree, or their windows (and collectives)
                # would diverge: one scalar all-reduce per micro-step.
                should_skip = lax.psum(should_skip.astype(jnp.int32), axis_name) > 0
        accept = jnp.logical_not(should_skip)

        k = window.noise.k if schedule else current_k(window.update_step)
        first = window.micro_step == 0
        w = jnp.where(jnp.logical_and(accept, jnp.logical_not(bad_weight)), w, 0.0)
        w_old = jnp.where(first, 0.0, window.weight_sum.reshape([]))
        w_new = w_old + w
        # Nothing has been added while the weights sum to 0: the next
        # contribution overwrites the (stale) buffer.
        fresh = w_old == 0
        # A micro-batch of weight 0 contributes nothing, whatever its values
        # (a 0/0 = NaN token mean of an all-padding micro-batch): select, not
        # multiply, as 0 * NaN = NaN.
        contributes = w > 0
        if mean:
            coef = jnp.where(w_new > 0, w / jnp.where(w_new > 0, w_new, 1.0), 0.0)

        # One fused elementwise pass per leaf. The first micro-batch of a
        # window overwrites the accumulator, so a reset is never read.
        def add(g, a):
            g = jnp.reshape(g, slot + jnp.shape(g)).astype(a.dtype)
            if mean:
                new = jnp.where(fresh, g, _layout.lerp(a, g, coef))
            else:
                wg = _layout.scale(g, w)
                new = jnp.where(fresh, wg, a + wg)
            return jnp.where(contributes, new, a)

        micro = window.micro_step + accept.astype(jnp.int32)
        emit = jnp.logical_and(micro > 0, jnp.logical_or(micro >= k, close_window))

        dynamic, static = _split_extra_args(extra_args)

        def inner_update(g, inner_state, params, dynamic):
            return inner.update(g, inner_state, params, **static, **dynamic)

        def window_args(dynamic, g, value):
            """The extra args of the window: its gradient and value."""
            dynamic = dict(dynamic)
            if pass_grad:
                dynamic["grad"] = g
            if value_in is not None:
                dynamic["value"] = value.astype(value_in.dtype)
            return dynamic

        def reduced(tree, w_sum, stats=()):
            """The window's reduction over devices: the tree, the total weight
            and ``stats`` (device-local scalars), in one all-reduce."""
            tree = jax.tree.map(lambda a: a.reshape(a.shape[len(slot) :]), tree)
            # The deferred data-parallel reduction, once per update.
            tree = jax.tree.map(_layout.finish, tree)
            # A device (or window) whose weights sum to 0 holds a stale buffer.
            local_tree = jax.tree.map(lambda a: jnp.where(w_sum > 0, a, 0), tree)
            if axis_name is None:
                return local_tree, w_sum, stats
            if mean:
                # One all-reduce for the weighted sum and the weight together.
                local_sum = jax.tree.map(
                    lambda a: w_sum.astype(a.dtype) * a, local_tree
                )
                total_sum, total, stats = lax.psum((local_sum, w_sum, stats), axis_name)
                return (
                    jax.tree.map(
                        lambda a: jnp.where(
                            total > 0, a / jnp.where(total > 0, total, 1), 0
                        ),
                        total_sum,
                    ),
                    total,
                    stats,
                )
            return lax.psum((local_tree, w_sum, stats), axis_name)

        def cast_like(tree, like):
            def cast(x, y):
                # PRNG keys (noisy_sgd) and other extended dtypes stay as they are.
                if x.dtype == y.dtype or jnp.issubdtype(y.dtype, jax.dtypes.extended):
                    return x
                return x.astype(y.dtype)

            return jax.tree.map(cast, tree, like)

        # The accumulator is updated in place outside the cond, and never
        # reset: a window's first micro-batch overwrites it (``fresh`` above).
        # The cond only reads it and writes the updates and the inner state.
        # Routing the accumulator through the cond, or a separate reset pass,
        # costs XLA a full copy of it per micro-step.
        acc = jax.tree.map(add, grads, window.accumulator)
        value_acc = window.value
        if value_in is not None:
            value_acc = add(value_in, window.value)
        noise = window.noise
        if decay is not None:
            noise = ns.observe(noise, grads, w, first)
        local_stats = ns.local_stats(noise)

        def updates_of(g, inner_state, params):
            g = jax.tree.map(_layout.finish, g)  # what the boundary passes on
            zero_value = jnp.zeros([], jnp.float32)
            return inner_update(
                g, inner_state, params, window_args(dynamic, g, zero_value)
            )[0]

        updates_shape = jax.eval_shape(updates_of, grads, window.inner_state, params)

        def hold(inner_state):
            return _zeros(updates_shape, window.update_step), inner_state, False

        def on_boundary(acc, value_acc, w_sum, inner_state, params, dynamic, local):
            (g, value), total, sums = reduced((acc, value_acc), w_sum, local)
            stats = ns.boundary_stats(g, (*sums, total)) if local else ()
            g = cast_like(g, grads)

            def step_inner(g, value, inner_state, params, dynamic):
                dynamic = window_args(dynamic, g, value)
                updates, new_inner = inner_update(g, inner_state, params, dynamic)
                return updates, cast_like(new_inner, inner_state), True

            def skip_inner(g, value, inner_state, params, dynamic):
                del g, value, params, dynamic
                return hold(inner_state)

            if axis_name is None:  # the predicate already checked the weight
                return (*step_inner(g, value, inner_state, params, dynamic), stats)
            # A window whose weights sum to 0 (all padding) steps nothing.
            out = lax.cond(
                total > 0,
                step_inner,
                skip_inner,
                g,
                value,
                inner_state,
                params,
                dynamic,
            )
            return (*out, stats)

        def on_hold(acc, value_acc, w_sum, inner_state, params, dynamic, local):
            del acc, value_acc, w_sum, params, dynamic
            return (*hold(inner_state), ns.zero_stats() if local else ())

        # Without an axis name the total weight is known here: a window whose
        # weights sum to 0 emits zeros and leaves the inner state untouched.
        run = emit if axis_name is not None else jnp.logical_and(emit, w_new > 0)
        updates, inner_state, stepped, stats = lax.cond(
            run,
            on_boundary,
            on_hold,
            acc,
            value_acc,
            w_new,
            window.inner_state,
            params,
            dynamic,
            local_stats,
        )
        stepped = jnp.asarray(stepped, jnp.bool_)
        if decay is not None:
            devices = 1 if axis_name is None else lax.axis_size(axis_name)
            noise = ns.close(noise, emit, stats, decay, schedule, devices)
        new_window = _Window(
            micro_step=jnp.where(emit, 0, micro).astype(jnp.int32),
            update_step=(window.update_step + stepped.astype(jnp.int32)).astype(
                jnp.int32
            ),
            accumulator=acc,
            weight_sum=jnp.where(emit, 0.0, w_new).astype(jnp.float32).reshape(slot),
            inner_state=inner_state,
            value=value_acc,
            noise=noise,
        )
        return updates, new_window, stepped, jnp.logical_not(accept), local(skip_state)

    return _Engine(init_window, step, init_skip_state)
