# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The model's answer for a cell, in the shape an adapter returns.

This is where a cell's options become the model's arguments: the skip
function, the k schedule, ``close_window``, the noise decay; the units come
from `data.units`. For the fused faces it also computes ``aux`` (stacked per
micro-batch; per device with ``axis_name``) and, for the Flax steps, the
parameters after each optimizer update.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import data, model
from .adapt_stream import model_k
from .cells import Cell
from .runtime import DECAY


def _skip(cell: Cell) -> Any:
    if cell.option == "skip_fn":
        return model.skip_not_finite
    if cell.option == "skip_large":
        return model.skip_large_updates(data.MAX_NORM)
    return None


def stream(cell: Cell, inputs: data.Inputs) -> dict[str, Any]:
    calls = [data.units(cell, inputs, t, inputs.w0) for t in range(len(inputs.m))]
    decay = DECAY if cell.option == "noise" else None
    out = model.run_stream(
        calls,
        model_k(cell),
        cell.reduction == "mean",
        model.INNER[cell.inner](),
        skip=_skip(cell),
        close=list(inputs.close),
        mapped=cell.mapped,
        decay=decay,
    )
    result = {"updates": out.updates, "updated": out.updated}
    result["idle_rejections"] = out.idle_rejections
    result["num_skipped"] = out.num_skipped if cell.face == "accumulate" else None
    if decay is not None:
        result["noise"] = model.noise_read(out.noise)
    return result


def loop(cell: Cell, inputs: data.Inputs) -> dict[str, Any]:
    """Per call: value, gradient, aux; the noise tracker; Flax: parameters."""
    mean = cell.reduction == "mean"
    decay = DECAY if cell.option == "noise" else None
    noise = model.Noise() if decay is not None else None
    inner = model.INNER[cell.inner]()
    w, state = inputs.w0.copy(), inner.init(inputs.w0.shape)
    steps = []
    for t in range(len(inputs.m)):
        out = model.run_loop(data.units(cell, inputs, t, w), mean, noise, decay)
        noise = out.noise
        step = {"value": out.value, "grad": out.grad, "value_scale": out.value_scale}
        if cell.option == "has_aux":
            step["aux"] = aux(cell, inputs, t, w)
        if cell.face in ("nnx", "linen"):
            u, state = inner.update(out.grad, state)
            w = w + u
            step["params"] = w.copy()
            del step["grad"]
        steps.append(step)
    result: dict[str, Any] = {"steps": steps}
    if noise is not None:
        result["noise"] = noise._asdict()
    return result


def privacy(cell: Cell, inputs: data.Inputs) -> dict[str, Any]:
    """Per call: the pre-noise sum and the mean loss over real examples."""
    from .adapt_privacy import CLIP_NORM

    steps = []
    for t in range(len(inputs.m)):
        grads, values, real = data.examples(cell, inputs, t, inputs.w0)
        grad, value = model.clipped_sum(grads, values, real, CLIP_NORM)
        with np.errstate(invalid="ignore"):
            scale = (
                float(np.nan_to_num(np.mean(np.abs(values[real]))))
                if real.any()
                else 0.0
            )
        steps.append({"value": value, "grad": grad, "value_scale": scale})
    return {"steps": steps}


def aux(cell: Cell, inputs: data.Inputs, t: int, w: np.ndarray) -> dict[str, Any]:
    """``fun``'s aux per micro-batch: its token-mean features and per-row
    losses (per device of a mapped axis). In the device-local mode the
    features are the weighted mean of the devices' (a device part of weight
    0 contributes nothing), unspecified where no part has a positive
    weight (``defined`` false)."""
    c, m = inputs.c[t], inputs.m[t]
    n = len(m)
    dev = np.arange(n) // (n // cell.devices)
    mb = np.arange(n) % cell.k
    groups = range(cell.devices) if cell.mapped else [None]
    out = [
        [_micro(cell, c, m, w, (mb == i) & _on(dev, d), dev) for i in range(cell.k)]
        for d in groups
    ]
    arrays = {key: np.array([[x[key] for x in g] for g in out]) for key in out[0][0]}
    return arrays if cell.mapped else {k: v[0] for k, v in arrays.items()}


def _on(dev: np.ndarray, d: int | None) -> np.ndarray:
    return np.ones_like(dev, bool) if d is None else dev == d


def _feat(c: np.ndarray, m: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return (m @ c) / m.sum()


def _micro(cell: Cell, c, m, w, sel, dev) -> dict[str, Any]:
    rows = c[sel] @ w
    if cell.mode != "data_axes":
        return {"feat": _feat(c[sel], m[sel]), "rows": rows, "defined": True}
    parts = [sel & (dev == d) for d in range(cell.devices)]
    weights = [model.admitted(m[p].sum()) if cell.weighted else 1.0 for p in parts]
    kept = [
        (wd, _feat(c[p], m[p])) for wd, p in zip(weights, parts, strict=True) if wd > 0
    ]
    total = sum(wd for wd, _ in kept)
    feat = (
        sum(wd * f for wd, f in kept) / total if kept else np.full(c.shape[1], np.nan)
    )
    return {"feat": feat, "rows": rows, "defined": bool(kept)}
