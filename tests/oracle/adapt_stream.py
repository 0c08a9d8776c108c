# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`accumulate` and `MultiSteps` on a cell's stream of calls, in each mode.

Each call computes one micro-batch's gradient from its rows with
``jax.grad`` (per device inside ``shard_map`` for ``axis_name``, through
`defer_reduction` for ``data_axes``) and passes it, with its token count as
``weight``, to the face. Returns the updates, the `has_updated` flags, the
number of skipped micro-batches and what `noise_scale` reads.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import optax_accum

from . import data
from . import runtime as rt
from .cells import Cell


def k_schedule(cell: Cell) -> Any:
    """``every_k``: the cell's k, or with ``schedule`` k then k + 1."""
    if cell.option != "schedule":
        return cell.k
    return lambda step: jnp.where(step % 2 == 0, cell.k, cell.k + 1)


def model_k(cell: Cell):
    return lambda step: cell.k + (step % 2 if cell.option == "schedule" else 0)


def _skip_fn(cell: Cell) -> Any:
    if cell.option == "skip_fn":
        return optax_accum.skip_not_finite
    if cell.option == "skip_large":
        return optax_accum.skip_large_updates(data.MAX_NORM)
    return None


def build_tx(cell: Cell) -> optax.GradientTransformationExtraArgs:
    """The face, constructed with the cell's options (may refuse)."""
    decay = rt.DECAY if cell.option == "noise" else None
    data_axes = rt.AXIS if cell.mode == "data_axes" else None
    common = dict(accumulator_dtype=rt.ACCS[cell.acc], noise_scale_decay=decay)
    if cell.face == "accumulate":
        return optax_accum.accumulate(
            rt.inner(cell),
            k_schedule(cell),
            reduction=cell.reduction,
            skip_fn=_skip_fn(cell),
            axis_name=rt.AXIS if cell.mapped else None,
            data_axes=data_axes,
            **common,
        )
    extra = {"axis_name": rt.AXIS} if cell.mapped else {}
    return optax_accum.MultiSteps(
        rt.inner(cell),
        k_schedule(cell),
        use_grad_mean=cell.reduction == "mean",
        should_skip_update_fn=_skip_fn(cell),
        data_axes=data_axes,
        **common,
        **extra,
    ).gradient_transformation()


def _step(cell: Cell, tx) -> Any:
    """One call: the micro-batch's gradient, then the face's update."""
    loss = rt.loss(cell)

    def step(params, state, c, m, close):
        p = params
        if cell.mode == "data_axes":
            p = optax_accum.defer_reduction(params, rt.AXIS)
        if cell.mode == "axis_name":  # each device's own gradient: no psum
            p = jax.tree.map(lambda x: jax.lax.pcast(x, rt.AXIS, to="varying"), p)
        grads = jax.grad(lambda p: loss(p, c, m), allow_int=True)(p)
        kw = {"close_window": close} if cell.option == "close" else {}
        if cell.weighted:
            kw["weight"] = jnp.sum(m)
        u, state = tx.update(grads, state, params, **kw)
        return u["w"], state, optax_accum.has_updated(state)

    return step


def _compiled(cell: Cell, params):
    """``(init, step)``, compiled once per structure."""
    tx = build_tx(cell)
    step = _step(cell, tx)
    if cell.eager:
        return tx.init, step
    if cell.mode == "pmap":
        return jax.pmap(tx.init, rt.AXIS), jax.pmap(
            step, rt.AXIS, in_axes=(0, 0, 0, 0, None)
        )
    if cell.mode != "axis_name":
        return jax.jit(tx.init), jax.jit(step)
    specs = optax_accum.state_specs(jax.eval_shape(tx.init, params), rt.AXIS)
    smap = lambda f, i, o: jax.jit(
        jax.shard_map(f, mesh=rt.mesh(), in_specs=i, out_specs=o)
    )
    init = smap(tx.init, (P(),), specs)
    row = P(rt.AXIS)
    return init, smap(step, (P(), specs, row, row, P()), (P(), specs, P()))


def run(cell: Cell, inputs: data.Inputs) -> dict[str, Any]:
    """The face on the cell's calls: updates, flags, skips, noise scale."""
    with rt.context(cell):
        params = rt.params(cell, inputs.w0)
        if cell.mode == "pmap":  # one copy per device
            params = jax.tree.map(lambda x: jnp.stack([x] * cell.devices), params)
        init, step = rt.cached(
            (cell.structure(), "stream"), lambda: _compiled(cell, params)
        )
        state = init(params)
        ups, flags = [], []
        for t in range(len(inputs.m)):
            c = rt.place(cell, inputs.c[t], rt.JNP_DTYPES[cell.dtype], rows=True)
            m = rt.place(cell, inputs.m[t], jnp.float32, rows=True)
            u, state, flag = step(params, state, c, m, jnp.bool_(inputs.close[t]))
            if cell.mode == "pmap":
                u, flag = rt.first_device((u, flag))
            ups.append(rt.to_np(u))
            flags.append(bool(flag))
        out = {"updates": np.stack(ups), "updated": np.array(flags)}
        if cell.mode == "pmap":
            state = rt.first_device(state)
        out["num_skipped"] = _num_skipped(state)
        if cell.option == "noise":
            ns = optax_accum.noise_scale(state)
            out["noise"] = {f: float(getattr(ns, f)) for f in ns._fields if f != "k"}
    return out


def _num_skipped(state: Any) -> int | None:
    found = getattr(state, "num_skipped", None)
    return None if found is None else int(found)
