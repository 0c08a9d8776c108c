# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The fused loop of `microbatch`: k micro-batches of ``fun`` in one `lax.scan`.

Module-level parts, each one step of the data path: the batch size, the
copy-free micro-batch views, one micro-batch's arguments, one call of
``fun``, the weights of all k micro-batches (one vectorised pass before the
loop), the loop (`scan`) and the loop-free path for k = 1 (`single`).

What an accelerator's compiler needs from the loop body: each gradient reaches
the carry through a plain add (or a select against zero), so that XLA's
while-loop all-reduce code motion can sink the gradients' reduction out of the
loop, leaving one per step. So weights are computed before the loop and, in
the global view, applied inside the backward pass (`_call_scaled`), never as a
running mean or a scale between the gradient and the add.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import _compiler, _devices, _dtypes, _sharding, _weights
from . import _noise_scale as ns
from ._loss_scale import ScaledGrads
from ._microbatch_options import Context, Options, check_fun_output


class Call(NamedTuple):
    """One call of ``fun`` on one micro-batch."""

    value: Any
    grads: Any
    aux: Any
    state: Any
    scaled: ScaledGrads | None  # fun returned ScaledGrads (fp16 loss scaling)


class Plan(NamedTuple):
    """How the loop weighs its micro-batches, fixed before it runs.

    ``weights`` (k,) are the admitted weights (None: unweighted);
    ``multipliers`` (k,) scale each micro-batch's gradient; ``in_backward``:
    they are applied inside the backward pass; ``divisor`` divides the sum
    after the loop (and the reduction over devices); ``per_step`` scales each
    unweighted micro-batch where the buffer's range needs it (fp16).
    """

    weights: jax.Array | None
    multipliers: jax.Array | None
    in_backward: bool
    divisor: float
    per_step: float | None


class Carry(NamedTuple):
    value: Any
    grads: Any
    noise: tuple  # (sum w|g|^2, n, sum w), or ()
    loss_scale: tuple  # (loss scale, all finite) for ScaledGrads, or ()
    state: Any


class Loop(NamedTuple):
    """What the loop (or the k = 1 path) returns, reduced over devices."""

    value: Any
    grads: Any
    aux: Any
    weights: jax.Array | None
    state: Any
    noise: tuple  # (sum w|g|^2, n, sum w, |G_big|^2), or ()
    scaled: ScaledGrads | None  # the step's loss scale and finiteness


def batch_size(args: list, opts: Options) -> int:
    """The batch size of the ``batch_argnums`` arguments, checked."""
    n = len(args)
    for i in (*opts.batch_idx, *opts.rng_idx):
        if i >= n:
            raise ValueError(
                f"argument index {i} (from `batch_argnums` or `rng_argnums`) "
                f"is out of range for {n} positional arguments."
            )
    sizes = {}
    for i in opts.batch_idx:
        for path, x in jax.tree_util.tree_leaves_with_path(args[i]):
            if jnp.ndim(x) == 0:
                raise ValueError(
                    f"batch argument {i} has a scalar leaf at "
                    f"{jax.tree_util.keystr(path)}: every batch leaf needs "
                    "a leading batch axis."
                )
            sizes[f"argument {i}{jax.tree_util.keystr(path)}"] = jnp.shape(x)[0]
    if not sizes:
        raise ValueError(f"the batch arguments {opts.batch_idx} have no array leaves.")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"batch leaves must share their leading size, got {sizes}.")
    size = next(iter(sizes.values()))
    if size % opts.k:
        raise ValueError(
            f"the batch size {size} is not divisible by `num_microbatches`={opts.k}."
        )
    return size


def views(args: list, opts: Options) -> dict[int, Any]:
    """Each batch argument as ``(B/k, k, ...)``: micro-batch ``i`` is column
    ``i`` (rows ``i, i+k, ...``), a free reshape that keeps the rows' sharding."""
    k = opts.k

    def view(x):
        x = _sharding.splittable(x, k)
        return x.reshape(x.shape[0] // k, k, *x.shape[1:])

    return {i: jax.tree.map(view, args[i]) for i in opts.batch_idx}


def microbatch_args(
    args: list, batch_views: dict, i: Any, opts: Options, ctx: Context, pin: bool
) -> list:
    """The positional arguments of micro-batch ``i``."""
    margs = list(args)
    if pin:
        fixed = [j for j in range(len(args)) if j not in opts.batch_idx]
        held = _compiler.pin_to_iteration([args[j] for j in fixed], i)
        for j, x in zip(fixed, held, strict=True):
            margs[j] = x
    for j in opts.batch_idx:
        margs[j] = jax.tree.map(
            lambda v: lax.dynamic_index_in_dim(v, i, 1, keepdims=False),
            batch_views[j],
        )
    device = lax.axis_index(ctx.axes) if ctx.local else None
    for j in opts.rng_idx:

        def fold(key):
            key = jax.random.fold_in(key, i)
            return key if device is None else jax.random.fold_in(key, device)

        margs[j] = jax.tree.map(fold, args[j])
    return margs


def call(fun: Any, args: list, kwargs: dict, state: Any, opts: Options) -> Call:
    """One call of ``fun``, its output checked and taken apart."""
    if opts.stateful:
        out, state = fun(*args, state=state, **kwargs)
    else:
        out = fun(*args, **kwargs)
    if isinstance(out, ScaledGrads):
        value, aux = out.value if opts.has_aux else (out.value, None)
        return Call(value, out.grads, aux, state, out)
    check_fun_output(out, opts.has_aux)
    (value, aux), grads = out if opts.has_aux else ((out[0], None), out[1])
    return Call(value, grads, aux, state, None)


def _call_scaled(fun, args: list, kwargs, state, opts: Options, seed) -> Call:
    """``fun``'s value differentiated with the cotangent ``seed``.

    The gradient of ``seed * value`` w.r.t. the first argument is computed
    here, so the scale sits inside the backward pass, before the compiler's
    reduction of the gradient over the data axes; ``fun``'s own gradients are
    dead code that XLA removes. Used where `backward_scalable` holds.
    """

    def value_of(first):
        out = call(fun, [first, *args[1:]], kwargs, state, opts)
        return out.value, (out.value, out.aux, out.state)

    _, vjp, (value, aux, new_state) = jax.vjp(value_of, args[0], has_aux=True)
    (grads,) = vjp(seed.astype(value.dtype))
    return Call(value, grads, aux, new_state, None)


def backward_scalable(args: list, shapes: Call, opts: Options, ctx: Context) -> bool:
    """Whether the weights can go inside the backward pass: the global view,
    ``fun`` a value-and-grad function of its first argument (gradients shaped
    like it, as ``jax.value_and_grad(loss)``'s are) and a float32 or float64
    value."""
    if opts.weight_fn is None or ctx.axes is not None or shapes.scaled is not None:
        return False
    if 0 in opts.batch_idx or 0 in opts.rng_idx:
        return False
    if jnp.dtype(shapes.value.dtype) not in (jnp.float32, jnp.float64):
        return False
    first, grads = args[0], shapes.grads
    if jax.tree.structure(first) != jax.tree.structure(grads):
        return False
    return all(
        jnp.shape(p) == g.shape
        and jnp.result_type(p) == g.dtype
        and _dtypes.is_differentiable(g.dtype)
        for p, g in zip(jax.tree.leaves(first), jax.tree.leaves(grads), strict=True)
    )


def weights(batch_views: dict, opts: Options, dtype: Any) -> jax.Array:
    """All k micro-batches' weights in one vectorised pass, admitted: a NaN,
    infinite or negative weight weighs 0 (`_weights`' contract)."""

    def weight_of(*columns):
        w = opts.weight_fn(*columns)
        if jnp.ndim(w) != 0:
            raise ValueError(
                f"`weight_fn` must return a scalar, got shape {jnp.shape(w)}."
            )
        return jnp.asarray(w, dtype)

    columns = [batch_views[i] for i in opts.batch_idx]
    return _weights.admitted(jax.vmap(weight_of, in_axes=1)(*columns))


def plan(args, batch_views, shapes: Call, opts: Options, ctx: Context) -> Plan:
    """The weights, multipliers and divisor of the loop (see `Plan`)."""
    devices = 1 if ctx.axes is None else lax.axis_size(ctx.axes)
    count = opts.k * devices
    narrow = _narrow(shapes.grads, opts)
    if opts.weight_fn is None:
        per_step = opts.reduction.unweighted_step(opts.k, narrow)
        divisor = 1.0 if not opts.reduction.is_mean else float(count)
        divisor = divisor if per_step is None else float(devices)
        return Plan(None, None, False, divisor, per_step)
    ws = weights(batch_views, opts, _dtypes.weight_dtype(shapes.grads))
    if ctx.axes is None:
        multipliers = opts.reduction.loop_scales(ws, narrow)
    else:  # over every device's weights: one all-gather of k scalars
        every = lax.all_gather(ws, ctx.axes)
        multipliers = opts.reduction.loop_scales(every, narrow)
        multipliers = multipliers[lax.axis_index(ctx.axes)]
    in_backward = backward_scalable(args, shapes, opts, ctx)
    divisor = opts.reduction.loop_divisor(count, narrow)
    return Plan(ws, multipliers, in_backward, divisor, None)


def _narrow(grads: Any, opts: Options) -> bool:
    """Whether some gradient accumulates in a float16-range buffer, where a
    sum of k micro-batches can overflow though their mean fits."""
    return any(
        jnp.finfo(_dtypes.for_gradient(g.dtype, opts.accumulator_dtype)).max < 1e6
        for g in jax.tree.leaves(grads)
        if _dtypes.is_differentiable(g.dtype)
    )


def scan(fun, args: list, kwargs: dict, state: Any, opts: Options, ctx: Context):
    """The fused loop: a `Loop`, reduced over ``ctx.axes`` if any."""
    batch_views = views(args, opts)
    pin = ctx.axes is None and _pin(args, opts)
    margs0 = microbatch_args(args, batch_views, jnp.int32(0), opts, ctx, pin)
    shapes = jax.eval_shape(lambda s: call(fun, margs0, kwargs, s, opts), state)
    how = plan(args, batch_views, shapes, opts, ctx)

    def body(carry: Carry, i: jax.Array):
        margs = microbatch_args(args, batch_views, i, opts, ctx, pin)
        if how.in_backward:
            out = _call_scaled(
                fun, margs, kwargs, carry.state, opts, how.multipliers[i]
            )
        else:
            out = call(fun, margs, kwargs, carry.state, opts)
        return _add(carry, out, i, how, opts, ctx, _rows(margs, opts)), out.aux

    init = _init(shapes, state, opts)
    carry, aux = lax.scan(body, init, jnp.arange(opts.k, dtype=jnp.int32))
    return _finish(carry, aux, how, shapes, opts, ctx)


def _pin(args: list, opts: Options) -> bool:
    """Whether to keep FSDP gathers per micro-batch (see `_compiler`)."""
    if opts.param_gather is not None:
        return opts.param_gather == "per_micro_batch"
    batch_axes = _sharding.row_axes([args[i] for i in opts.batch_idx])
    others = [a for i, a in enumerate(args) if i not in opts.batch_idx]
    return bool(batch_axes and _sharding.sharded_over(others, sorted(batch_axes)))


def _rows(margs: list, opts: Options) -> int:
    """Rows of a micro-batch as ``fun`` sees it (the noise scale's unit)."""
    return jnp.shape(jax.tree.leaves(margs[opts.batch_idx[0]])[0])[0]


def _varying_like(x: jax.Array, s: Any) -> jax.Array:
    """``x`` varying over the manual axes ``s`` (a ShapeDtypeStruct) varies
    over, as a ``shard_map`` loop carry must be."""
    vary = tuple(getattr(s.manual_axis_type, "varying", ()) or ())
    return lax.pcast(x, vary, to="varying") if vary else x


def _match(new: jax.Array, old: jax.Array) -> jax.Array:
    """``new`` varying over whatever manual axes ``old`` varies over."""
    vary = jax.typeof(old).mat.varying
    missing = tuple(a for a in vary if a not in jax.typeof(new).mat.varying)
    return lax.pcast(new, missing, to="varying") if missing else new


def _zeros(s: Any, dtype: Any) -> jax.Array:
    return _varying_like(_sharding.zeros_for(s, dtype), s)


def _init(shapes: Call, state: Any, opts: Options) -> Carry:
    value = jax.tree.map(lambda s: _zeros(s, _dtypes.compute(s.dtype)), shapes.value)
    grads = jax.tree.map(
        lambda s: _zeros(s, _dtypes.for_gradient(s.dtype, opts.accumulator_dtype)),
        shapes.grads,
    )
    noise = ()
    if opts.decay is not None:
        like = jax.tree.leaves(shapes.grads)[0]
        noise = tuple(_varying_like(z, like) for z in ns.zero_stats()[:3])
    loss_scale = ()
    if shapes.scaled is not None:
        scale = jax.tree.map(lambda s: _zeros(s, s.dtype), shapes.scaled.loss_scale)
        finite = _varying_like(jnp.bool_(True), shapes.scaled.finite)
        loss_scale = (scale, finite)
    return Carry(value, grads, noise, loss_scale, state)


def _add(carry: Carry, out: Call, i, how: Plan, opts: Options, ctx: Context, rows):
    """One micro-batch into the carry: a plain add (or a select with zero)."""
    if how.weights is None:
        step = how.per_step

        def add(a, x):
            if step is None:
                return a + x.astype(a.dtype)
            wide = _dtypes.compute(a.dtype)
            return (a.astype(wide) + x.astype(wide) * step).astype(a.dtype)

        grads = jax.tree.map(add, carry.grads, out.grads)
        value = jax.tree.map(add, carry.value, out.value)
        sq = ns.squared_norm(out.grads) if opts.decay is not None else None
        w_noise = jnp.float32(rows)
    else:
        m, keep = how.multipliers[i], how.weights[i] > 0
        g = (
            out.grads
            if how.in_backward
            else jax.tree.map(lambda x: _times(x, m), out.grads)
        )

        def add(a, x):
            # Weight 0 contributes nothing, even an all-padding micro-batch's
            # 0/0 = NaN: select, not multiply.
            return a + jnp.where(keep, x.astype(a.dtype), jnp.zeros((), a.dtype))

        grads = jax.tree.map(add, carry.grads, g)
        value = jax.tree.map(
            add, carry.value, jax.tree.map(lambda v: _times(v, m), out.value)
        )
        sq = None
        if opts.decay is not None:
            sq = ns.squared_norm(out.grads)
            sq = _weights.ratio(sq, (m * m).astype(sq.dtype)) if how.in_backward else sq
        w_noise = how.weights[i]
    noise = carry.noise
    if sq is not None:
        noise = tuple(map(_match, ns.window_sums(noise, sq, w_noise), noise))
    loss_scale = _loss_scale_step(carry.loss_scale, out, ctx)
    return Carry(value, grads, noise, loss_scale, out.state)


def _times(x: jax.Array, m: jax.Array) -> jax.Array:
    wide = _dtypes.compute(x.dtype)
    return x.astype(wide) * m.astype(wide)


def _loss_scale_step(ls: tuple, out: Call, ctx: Context) -> tuple:
    """The step's loss scale: as adjusted by the first micro-batch that
    overflowed, if one did (on any device), else by the last; all finite."""
    if out.scaled is None:
        return ls
    finite = out.scaled.finite
    if ctx.axes is not None:  # all devices agree, as their scales must
        finite = lax.psum(jnp.logical_not(finite).astype(jnp.int32), ctx.axes) == 0
    scale, all_finite = ls
    # Until an overflow, follow each micro-batch; from the first, keep its.
    scale = jax.tree.map(
        lambda new, old: jnp.where(all_finite, new, old), out.scaled.loss_scale, scale
    )
    return scale, all_finite & finite


def _finish(carry: Carry, aux, how: Plan, shapes: Call, opts: Options, ctx: Context):
    """After the loop: the one reduction over devices, then the divisor."""
    value, grads, noise = carry.value, carry.grads, carry.noise
    if ctx.axes is not None:
        (value, grads), _, noise = _devices.psum_window(
            (value, grads), None, ctx.axes, mean=False, extras=noise
        )
    if how.divisor != 1.0:
        value, grads = jax.tree.map(lambda a: a / how.divisor, (value, grads))
    if opts.decay is not None:
        noise = (*noise, ns.squared_norm(grads))
    value = jax.tree.map(lambda a, s: a.astype(s.dtype), value, shapes.value)
    grads = jax.tree.map(lambda a, s: a.astype(s.dtype), grads, shapes.grads)
    scaled = None
    if carry.loss_scale:
        scale, finite = carry.loss_scale
        scaled = ScaledGrads(None, None, scale, finite)
    return Loop(value, grads, aux, how.weights, carry.state, noise, scaled)


def single(fun, args: list, kwargs: dict, state: Any, opts: Options, ctx: Context):
    """k = 1: no loop; under ``ctx.axes`` the one weighted reduction."""
    out = call(fun, args, kwargs, state, opts)
    aux = jax.tree.map(lambda a: jnp.expand_dims(a, 0), out.aux)
    value, grads, noise = out.value, out.grads, ()
    w = None
    if opts.weight_fn is not None and (ctx.axes is not None or opts.decay is not None):
        batch_views = views(args, opts)
        w = weights(batch_views, opts, _dtypes.weight_dtype(grads))[0]
    w_noise = jnp.float32(_rows(args, opts)) if w is None else w
    if opts.decay is not None:
        noise = ns.window_sums(ns.zero_stats()[:3], ns.squared_norm(grads), w_noise)
    if ctx.axes is not None:
        (value, grads), noise = _reduce_single((value, grads), w, noise, opts, ctx)
    if opts.decay is not None:
        noise = (*noise, ns.squared_norm(grads))
    return Loop(value, grads, aux, None, out.state, noise, out.scaled)


def _reduce_single(tree, w, noise, opts: Options, ctx: Context):
    """The weighted reduction of one micro-batch per device (k = 1)."""
    w = jnp.float32(1.0) if w is None else w
    mean = opts.reduction.is_mean

    def weighted(x):
        wide = x.astype(_dtypes.compute(x.dtype))
        # Select, not multiply: a weight-0 device's NaN must not spread.
        return jnp.where(w > 0, wide if mean else w * wide, 0)

    wide_tree = jax.tree.map(weighted, tree)
    out, _, noise = _devices.psum_window(
        wide_tree, w if mean else None, ctx.axes, mean=mean, extras=noise
    )
    return jax.tree.map(lambda a, x: a.astype(x.dtype), out, tree), noise
