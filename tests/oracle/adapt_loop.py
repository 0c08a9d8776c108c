# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The fused faces on a cell's batches: `microbatch` (a value-and-grad
``fun``), the loss face ``microbatch_value_and_grad``, and the Flax steps.

Each runs `data.STEPS` calls on batches of k micro-batches; the value-and-
grad faces return each call's value, gradient and aux, the Flax steps each
call's loss, aux and the parameters after the update; with the ``noise``
option, the tracker after the last call.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import optax_accum

from . import data
from . import runtime as rt
from .cells import Cell

LOSS_FACE = "microbatch_value_and_grad"


def _options(cell: Cell, flax: bool = False) -> dict[str, Any]:
    kw = dict(
        reduction=cell.reduction,
        accumulator_dtype=rt.ACCS[cell.acc],
        noise_scale_decay=rt.DECAY if cell.option == "noise" else None,
    )
    if cell.weighted:
        kw["weight_fn"] = rt.weight_fn
    if cell.mapped:
        kw["axis_name"] = rt.AXIS
    if cell.mode == "data_axes":
        kw["data_axes"] = rt.AXIS
        if cell.option == "has_aux":  # declared, never guessed from a shape
            kw["aux_rows"] = {"rows": True, "feat": False}
    if not flax:
        kw.update(batch_argnums=(1, 2), has_aux=cell.option == "has_aux")
        if cell.option == "rng":
            kw["rng_argnums"] = 3
    return kw


def build_fn(cell: Cell) -> Any:
    """The face as ``f(params, c, m[, key][, noise_scale=])`` (may refuse)."""
    if cell.pipeline:
        from . import adapt_pipeline

        return adapt_pipeline.build_fn(cell, _options(cell, flax=True))
    loss = rt.loss(cell)
    if cell.face == "loss":
        if not hasattr(optax_accum, LOSS_FACE):
            pytest.skip(f"optax_accum.{LOSS_FACE} (the loss face) is not there yet")
        face = getattr(optax_accum, LOSS_FACE)
        return face(loss, cell.k, argnums=0, **_options(cell))
    vg = jax.value_and_grad(loss, has_aux=cell.option == "has_aux", allow_int=True)
    if cell.option == "clip":  # fun post-processes its own gradients
        clip = lambda g: jax.tree.map(lambda x: jnp.clip(x, -data.CLIP, data.CLIP), g)
        fun = lambda *a: (lambda out: (out[0], clip(out[1])))(vg(*a))
    else:
        fun = vg
    return optax_accum.microbatch(fun, cell.k, **_options(cell))


def _compiled(cell: Cell) -> Any:
    f = build_fn(cell)
    noise = cell.option == "noise"
    rng = cell.option == "rng"

    def call(p, c, m, key, tracker):
        args = (p, c, m, key) if rng else (p, c, m)
        out, tracker = f(*args, noise_scale=tracker) if noise else (f(*args), tracker)
        value, grads = out
        value, aux = value if cell.option == "has_aux" else (value, None)
        return value, grads["w"], aux, tracker

    if cell.mode == "pmap":
        return jax.pmap(call, rt.AXIS, in_axes=(None, 0, 0, None, None))
    if cell.mode != "axis_name":
        return jax.jit(call)
    row = P(rt.AXIS)
    return jax.jit(
        jax.shard_map(
            call,
            mesh=rt.mesh(),
            in_specs=(P(), row, row, P(), P()),
            out_specs=(P(), P(), row, P()),
        )
    )


def run(cell: Cell, inputs: data.Inputs) -> dict[str, Any]:
    with rt.context(cell):
        f = rt.cached((cell.structure(), "loop"), lambda: _compiled(cell))
        params = rt.params(cell, inputs.w0)
        # Always a tracker (passed through without the noise scale): jax.pmap
        # silently maps the wrong argument when one of them is None.
        tracker = zero_tracker()
        steps = []
        for t in range(len(inputs.m)):
            c = rt.place(cell, inputs.c[t], rt.JNP_DTYPES[cell.dtype], rows=True)
            m = rt.place(cell, inputs.m[t], jnp.float32, rows=True)
            key = data.step_key(cell, t)
            value, grad, aux, tracker = f(params, c, m, key, tracker)
            if cell.mode == "pmap":  # replicated after the reduction
                value, grad, tracker = rt.first_device((value, grad, tracker))
            step = {"value": float(rt.to_np(value)), "grad": rt.to_np(grad)}
            if aux is not None:
                step["aux"] = _aux(cell, aux)
            steps.append(step)
    out: dict[str, Any] = {"steps": steps}
    if cell.option == "noise":
        out["noise"] = {f: float(getattr(tracker, f)) for f in NOISE_FIELDS}
    return out


NOISE_FIELDS = (
    "grad_sq_ema",
    "trace_ema",
    "ema_norm",
    "windows",
    "b_small",
    "b_big",
    "last_grad_sq",
    "last_trace",
)


def zero_tracker() -> optax_accum.NoiseScaleState:
    """A tracker before its first window (what ``None`` starts from)."""
    f, i = (lambda: jnp.zeros([], jnp.float32)), (lambda: jnp.zeros([], jnp.int32))
    return optax_accum.NoiseScaleState(
        f(), f(), f(), f(), f(), i(), f(), f(), f(), f(), i()
    )


def _aux(cell: Cell, aux: Any) -> dict[str, np.ndarray]:
    feat, rows = rt.to_np(aux["feat"]), rt.to_np(aux["rows"])
    if cell.mode == "axis_name":  # stacked by device: (devices * k, ...)
        feat = feat.reshape(cell.devices, cell.k, *feat.shape[1:])
        rows = rows.reshape(cell.devices, cell.k, *rows.shape[1:])
    return {"feat": feat, "rows": rows}
