# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The Flax steps, `nnx_train_step` and `linen_train_step`, on a cell.

The model is the linear one of `data` (a single parameter ``w``); each step
is one optimizer update over k micro-batches. Returns each step's loss, aux
and parameters, and the tracker with ``noise``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

from optax_accum.flax import linen_train_step, nnx_train_step

from . import data
from . import runtime as rt
from .adapt_loop import NOISE_FIELDS, _aux, _options, zero_tracker
from .cells import Cell


class Linear(nnx.Module):
    def __init__(self, w: jax.Array):
        self.w = nnx.Param(w)


def _nnx(cell: Cell, inputs: data.Inputs):
    loss = rt.loss(cell)
    fn = lambda model, c, m: loss({"w": model.w[...]}, c, m)
    step = rt.cached(
        (cell.structure(), "nnx"),
        lambda: nnx.jit(
            nnx_train_step(
                fn, cell.k, has_aux=cell.option == "has_aux", **_options(cell, True)
            )
        ),
    )
    model = Linear(rt.params(cell, inputs.w0)["w"])
    optimizer = nnx.Optimizer(model, rt.inner(cell), wrt=nnx.Param)

    def call(c, m, key, tracker):
        del key
        noise = cell.option == "noise"
        kw = {"noise_scale": tracker} if noise else {}
        out = step(model, optimizer, c, m, **kw)
        out, tracker = out if noise else (out, tracker)
        return out, model.w[...], tracker

    return call


def _linen(cell: Cell, inputs: data.Inputs):
    step = rt.cached((cell.structure(), "linen"), lambda: _linen_step(cell))
    state = [
        train_state.TrainState.create(
            apply_fn=None,
            params={"w": rt.params(cell, inputs.w0)["w"]},
            tx=rt.inner(cell),
        )
    ]

    def call(c, m, key, tracker):
        new, loss, aux, tracker = step(state[0], c, m, key, tracker)
        if cell.mode == "pmap":  # replicated after the reduction
            new, loss, tracker = rt.first_device((new, loss, tracker))
        state[0] = new
        out = (loss, aux) if cell.option == "has_aux" else loss
        return out, new.params["w"], tracker

    return call


def _linen_step(cell: Cell):
    """``(state, c, m, key, tracker) -> (state, loss, aux, tracker)``,
    compiled for the cell's mode (inside ``shard_map`` or ``pmap`` for
    ``axis_name``)."""
    loss = rt.loss(cell)
    rng, noise = cell.option == "rng", cell.option == "noise"
    fn = lambda p, key, c, m: loss(p, c, m, key if rng else None)
    step = linen_train_step(
        fn, cell.k, has_aux=cell.option == "has_aux", **_options(cell, True)
    )

    def body(state, c, m, key, tracker):
        kw = {"noise_scale": tracker} if noise else {}
        out = step(state, c, m, rng=key if rng else None, **kw)
        value, aux = out[1] if cell.option == "has_aux" else (out[1], None)
        return out[0], value, aux, out[2] if noise else tracker

    if cell.mode == "pmap":
        return jax.pmap(body, rt.AXIS, in_axes=(None, 0, 0, None, None))
    if cell.mode != "axis_name":
        return jax.jit(body)
    row = P(rt.AXIS)
    return jax.jit(
        jax.shard_map(
            body,
            mesh=rt.mesh(),
            in_specs=(P(), row, row, P(), P()),
            out_specs=(P(), P(), row, P()),
        )
    )


def run(cell: Cell, inputs: data.Inputs) -> dict[str, Any]:
    with rt.context(cell):
        call = (_nnx if cell.face == "nnx" else _linen)(cell, inputs)
        tracker = zero_tracker()  # never None: see `adapt_loop.run`
        steps = []
        for t in range(len(inputs.m)):
            c = rt.place(cell, inputs.c[t], rt.JNP_DTYPES[cell.dtype], rows=True)
            m = rt.place(cell, inputs.m[t], jnp.float32, rows=True)
            out, w, tracker = call(c, m, data.step_key(cell, t), tracker)
            value, aux = out if cell.option == "has_aux" else (out, None)
            step = {"value": float(rt.to_np(value)), "params": np.array(rt.to_np(w))}
            if aux is not None:
                step["aux"] = _aux(cell, aux)
            steps.append(step)
    out: dict[str, Any] = {"steps": steps}
    if cell.option == "noise":
        out["noise"] = {f: float(getattr(tracker, f)) for f in NOISE_FIELDS}
    return out
