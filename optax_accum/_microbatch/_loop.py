# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The fused loop of `microbatch`: k micro-batches of ``fun`` in one `lax.scan`.

The data path: all k weights first, in one vectorised pass (`_call.weights`),
then the `plan` of the loop (each micro-batch's multiplier), the loop
(`scan`: one micro-batch into the carry per step, `_add`) and the one
reduction after it (`_finish`).
Every k runs this one path; k = 1 (and any k with ``unroll`` >= k) runs it as
straight-line code, so it costs what the plain step costs and has no
semantics of its own. Each micro-batch's work is relaid for the CPU compiler
(`_layout`), and a micro-batch of weight 0 is skipped under `lax.cond`
(`_skips`: its forward pass alone runs where aux or state need it). One
micro-batch's arguments and one call of ``fun`` are `_call`'s.

What an accelerator's compiler needs from the loop body: each gradient reaches
the carry through a plain add (or a select against zero), so that XLA's
while-loop all-reduce code motion can sink the gradients' reduction out of the
loop, leaving one per step. So weights are computed before the loop and, where the
library differentiates (the loss face, in the global view), applied inside the
backward pass (`_call.differentiate`), never as a running mean or a
scale between the gradient and the add. A value-and-grad ``fun``'s gradients
are its own: they are weighted after it (cast to the buffer's precision
first), and on an accelerator the reduction then stays in the loop.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .. import _devices, _dtypes, _sharding, _weights
from .. import _noise_scale as ns
from .._loss_scale import ScaledGrads
from ._call import (
    Call,
    forward,
    gathered,
    microbatch_args,
    pinned,
    run,
    views,
    weights,
)
from ._layout import canonical_convolutions, split_arrays
from ._options import Context, Options


class Plan(NamedTuple):
    """How the loop weighs its micro-batches, fixed before it runs.

    ``weights`` (k,) are the admitted weights (None: unweighted);
    ``multipliers`` (k,) scale each micro-batch's gradient (None: 1);
    ``in_backward``: they are applied inside the backward pass (the loss face
    only); ``divisor`` divides the sum after the loop and the reduction over
    devices. With ``running`` (a buffer narrower than float32: in float16 a
    sum can overflow though the mean fits, in bfloat16 adding a small gradient
    to a large sum is lost) the loop keeps a running mean instead, as
    `accumulate` does: ``multipliers`` are its coefficients, and
    ``local_weight`` weighs the device's mean over devices.
    """

    weights: jax.Array | None
    multipliers: jax.Array | None
    in_backward: bool
    divisor: float
    running: bool = False
    local_weight: jax.Array | None = None


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


def plan(ws: jax.Array | None, shapes: Call, opts: Options, ctx: Context) -> Plan:
    """The multipliers and divisor of the loop for the weights ``ws`` (None:
    unweighted) (see `Plan`)."""
    devices = 1 if ctx.axes is None else lax.axis_size(ctx.axes)
    count = opts.k * devices
    # Device-local: each device holds 1/devices of every micro-batch.
    parts = devices if ctx.local else 1
    running = _narrow(shapes.grads, opts) and opts.reduction.runs_in_narrow_buffers()
    if running:
        return _running_plan(ws, opts, ctx)
    if ws is None:
        return Plan(None, None, False, opts.reduction.loop_divisor(count, parts))
    if ctx.axes is None:
        multipliers = opts.reduction.loop_scales(ws)
    else:  # over every device's weights: one all-gather of k scalars
        every = lax.all_gather(ws, ctx.axes)
        multipliers = opts.reduction.loop_scales(every)[lax.axis_index(ctx.axes)]
    # Only where the library differentiates, and the compiler reduces in the
    # loop (the global view): the weights then go inside the backward pass.
    in_backward = opts.differentiates and ctx.axes is None
    return Plan(ws, multipliers, in_backward, opts.reduction.loop_divisor(count, 1))


def _running_plan(ws: jax.Array | None, opts: Options, ctx: Context) -> Plan:
    """The running mean of a float16 buffer: its coefficients, and the
    device's weight (any scale common to the devices)."""
    if ws is None:
        unit = jnp.ones((opts.k,), jnp.float32)
        return Plan(None, _weights.running_shares(unit), False, 1.0, True, unit.sum())
    if ctx.axes is None:
        scaled = _weights.normalized(ws)
    else:  # scaled by the largest weight of any device
        every = _weights.normalized(lax.all_gather(ws, ctx.axes))
        scaled = every[lax.axis_index(ctx.axes)]
    coefficients = _weights.running_shares(scaled)
    return Plan(ws, coefficients, False, 1.0, True, scaled.sum())


def _narrow(grads: Any, opts: Options) -> bool:
    """Whether some gradient accumulates in a buffer narrower than float32
    (`_dtypes.is_narrow`), as `accumulate`'s running mean treats it."""
    dtypes = _dtypes.resolve(opts.accumulator_dtype, grads)
    return any(
        _dtypes.is_narrow(d)
        for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(dtypes), strict=True)
        if _dtypes.is_differentiable(g.dtype)
    )


def scan(fun, args: list, kwargs: dict, state: Any, opts: Options, ctx: Context):
    """The fused loop: a `Loop`, reduced over ``ctx.axes`` if any."""
    batch_views = views(args, opts)
    pin = pinned(args, opts)
    margs0 = microbatch_args(args, batch_views, jnp.int32(0), opts, ctx, pin)
    full = jax.eval_shape(lambda s: run(fun, margs0, kwargs, s, opts), state)
    # Integer inputs' float0 gradients skip the loop and come back as they are.
    shapes = full._replace(grads=_dtypes.without_float0(full.grads))
    ws = None  # all k weights first, in one vectorised pass
    if opts.weight_fn is not None:
        ws = weights(batch_views, opts, _dtypes.weight_dtype(shapes.grads))
    how = plan(ws, shapes, opts, ctx)
    skips = _skips(how, shapes, opts, ctx, args)
    looped = gathered(args, opts)  # param_gather="once": gathered here

    def step(carry: Carry, margs: list, i: jax.Array, selected: bool):
        seed = how.multipliers[i] if how.in_backward else None
        out = run(fun, margs, kwargs, carry.state, opts, seed)
        grads = _dtypes.without_float0(out.grads)
        if looped is not args:  # back to the parameters' sharding
            grads = _sharding.reshard_like(grads, shapes.grads)
        out = out._replace(grads=grads)
        rows = _rows(margs, opts)
        return _add(carry, out, i, how, opts, ctx, rows, selected), out.aux

    def skip(carry: Carry, margs: list, i: jax.Array):
        # A weight-0 micro-batch adds nothing; it still gives its aux and
        # advances the state, from the forward pass alone (the loss face).
        aux, new_state = None, carry.state
        if opts.has_aux or opts.stateful:
            aux, new_state = forward(fun, margs, kwargs, carry.state, opts)
        return carry._replace(state=new_state), aux

    # Each micro-batch's work is relaid for the CPU (`_layout`): in a loop
    # body or a branch, XLA leaves its convolutions in slow layouts.
    compute = canonical_convolutions(lambda c, m, i: step(c, m, i, skips))
    skip_relaid = canonical_convolutions(skip)

    def body(carry: Carry, i: jax.Array):
        margs = microbatch_args(looped, batch_views, i, opts, ctx, pin)
        if not skips:
            return compute(carry, margs, i)
        real = jnp.asarray(how.weights)[i] > 0
        # Only arrays are the cond's operands; other leaves (an Equinox
        # model's functions) stay Python values, closed over.
        arrays, fill = split_arrays(margs)
        on, off = (
            lambda c, a, j, f=f: f(c, fill(a), j) for f in (compute, skip_relaid)
        )
        return lax.cond(real, on, off, carry, arrays, i)

    init = _init(shapes, state, opts)
    carry, aux = _loop(body, init, opts.k, trips(opts))
    out = _finish(carry, aux, how, shapes, opts, ctx)
    return out._replace(grads=_dtypes.with_float0(out.grads, full.grads))


def trips(opts: Options) -> int:
    """Micro-batches per trip of the loop (``unroll``); k: straight-line code,
    as for k = 1 always (one micro-batch is the plain step, with no loop)."""
    if isinstance(opts.unroll, bool):
        return opts.k if opts.unroll else 1
    return min(opts.unroll, opts.k)


def _loop(body, init: Carry, k: int, unroll: int):
    """``lax.scan(body, init, arange(k), unroll=unroll)``; with ``unroll`` k,
    straight-line code (``lax.scan`` keeps a loop of one trip for k = 1)."""
    if unroll < k:
        return lax.scan(body, init, jnp.arange(k, dtype=jnp.int32), unroll=unroll)
    carry, auxs = init, []
    for i in range(k):
        carry, aux = body(carry, jnp.int32(i))
        auxs.append(aux)
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *auxs)


def _skips(how: Plan, shapes: Call, opts: Options, ctx: Context, args: list) -> bool:
    """Whether a weight-0 micro-batch is skipped under `lax.cond` (no work).

    Where its outputs are unused: on the loss face, whose forward pass alone
    still gives the aux and the state, and for a value-and-grad ``fun``
    without aux, state or loss scale (whose aux and state only a whole call
    gives, and whose overflow a step observes). And off any mesh: on a mesh
    the compiler reduces each micro-batch's gradients over the devices inside
    the loop, and a conditional between that reduction and the carry would
    keep XLA from moving it out of the loop (see "Why the body is a plain
    add" in the design guide); per device (``shard_map``) a branch could also
    differ between devices that run ``fun``'s collectives together.
    """
    if how.weights is None or ctx.axes is not None or _on_mesh(args, opts):
        return False
    if opts.differentiates:
        return True
    return not (opts.has_aux or opts.stateful or shapes.scaled is not None)


def _on_mesh(args: list, opts: Options) -> bool:
    """Whether the step runs under a mesh (``jax.set_mesh``) or its batch
    is typed with one (an Explicit mesh)."""
    if not jax.sharding.get_abstract_mesh().empty:
        return True
    leaves = jax.tree.leaves([args[i] for i in opts.batch_idx])
    return any(
        not jax.typeof(x).sharding.mesh.empty
        for x in leaves
        if isinstance(x, jax.Array)
    )


def _rows(margs: list, opts: Options) -> int:
    """Rows of a micro-batch as ``fun`` sees it (the noise scale's unit)."""
    return jnp.shape(jax.tree.leaves(margs[opts.batch_idx[0]])[0])[0]


def _zeros(s: Any, dtype: Any) -> jax.Array:
    return _sharding.match_varying(_sharding.zeros_for(s, dtype), s)


def _init(shapes: Call, state: Any, opts: Options) -> Carry:
    value = jax.tree.map(lambda s: _zeros(s, _dtypes.compute(s.dtype)), shapes.value)
    dtypes = _dtypes.resolve(opts.accumulator_dtype, shapes.grads)
    grads = jax.tree.map(_zeros, shapes.grads, dtypes)
    noise = ()
    if opts.decay is not None:
        like = jax.tree.leaves(shapes.grads)[0]
        noise = tuple(_sharding.match_varying(z, like) for z in ns.zero_stats()[:3])
    loss_scale = ()
    if shapes.scaled is not None:
        scale = jax.tree.map(lambda s: _zeros(s, s.dtype), shapes.scaled.loss_scale)
        finite = _sharding.match_varying(jnp.bool_(True), shapes.scaled.finite)
        loss_scale = (scale, finite)
    return Carry(value, grads, noise, loss_scale, state)


def _add(
    carry: Carry,
    out: Call,
    i,
    how: Plan,
    opts: Options,
    ctx: Context,
    rows,
    selected: bool = False,
):
    """One micro-batch into the carry: a plain add (or a select with zero;
    ``selected``: the micro-batch is known to weigh more than 0)."""
    weighted = how.weights is not None
    keep = how.weights[i] > 0 if weighted and not selected else None
    m = None if how.multipliers is None else how.multipliers[i]
    if how.running:
        w = how.weights[i] if weighted else jnp.float32(1)

        def add(a, x):
            new = opts.reduction.step(a, x, m, w).astype(a.dtype)
            return new if keep is None else jnp.where(keep, new, a)

        g, v = out.grads, out.value
    else:

        def add(a, x):
            x = x.astype(a.dtype)
            if keep is None:
                return a + x
            # Weight 0 contributes nothing, even an all-padding micro-batch's
            # 0/0 = NaN: select against zero (which the compiler can sink out
            # of the loop with the add), not multiply.
            return a + jnp.where(keep, x, jnp.zeros((), a.dtype))

        g = out.grads
        if weighted and not how.in_backward:
            g = jax.tree.map(lambda x, a: _times(x, m, a), g, carry.grads)
        v = out.value
        if m is not None:
            v = jax.tree.map(lambda x, a: _times(x, m, a), v, carry.value)
    grads = jax.tree.map(add, carry.grads, g)
    value = jax.tree.map(add, carry.value, v)
    noise = carry.noise
    if opts.decay is not None:
        sq = ns.squared_norm(out.grads)
        if how.in_backward:  # the gradient came scaled by m
            sq = _weights.ratio(sq, (m * m).astype(sq.dtype))
        w_noise = how.weights[i] if weighted else jnp.float32(rows)
        sums = ns.window_sums(noise, sq, w_noise)
        noise = tuple(map(_sharding.match_varying, sums, noise))
    loss_scale = _loss_scale_step(carry.loss_scale, out, ctx)
    return Carry(value, grads, noise, loss_scale, out.state)


def _times(x: jax.Array, m: jax.Array, buffer: jax.Array) -> jax.Array:
    """``x`` cast to its buffer's precision first, then weighed by ``m``:
    one rounding, the buffer's, as the unweighted sum has."""
    wide = _dtypes.compute(jnp.promote_types(x.dtype, buffer.dtype))
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
            (value, grads),
            how.local_weight if how.running else None,
            ctx.axes,
            mean=opts.reduction.is_mean,
            extras=noise,
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
