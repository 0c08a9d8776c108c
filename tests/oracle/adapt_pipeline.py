# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The pipeline's schedules as faces: the cell's loss as the last stage.

``first_fn`` hands the micro-batch's rows on, each of the ``S · repeats``
stages multiplies them by its parameter (1), and ``loss_fn`` is the cell's
token-mean loss (`runtime.loss`) with the cell's parameters as the last
stage's: so the value and the gradient of ``w`` are the model's, and the
pipeline's weighting, precision, keys, aux and data shards are what is
tested. It runs on `runtime.pipeline_mesh` (2 stages; 4 data shards with
``data_axes``), through `adapt_loop`'s driver.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from optax_accum import pipeline

from . import runtime as rt
from .cells import Cell

SCHEDULES = {
    "pipe-gpipe": "gpipe",
    "pipe-1f1b": "1f1b",
    "pipe-circular": "circular",
    "pipe-interleaved": "interleaved_1f1b",
    "pipe-zb": "zb_h1",
}


def first_fn(fp: Any, batch: dict) -> Any:
    del fp
    return batch["c"]


def stage_fn(sp: Any, h: Any, key: Any = None) -> Any:
    del key  # the stages draw nothing; the loss's draw is the model's
    return h * sp["s"].astype(h.dtype)


def build_fn(cell: Cell, options: dict[str, Any]) -> Any:
    """The face as ``f(params, c, m[, key])`` -> ``(value, {"w": grad})``."""
    loss = rt.loss(cell)
    kw = {k: v for k, v in options.items() if k != "noise_scale_decay"}
    if "weight_fn" in kw:
        kw["weight_fn"] = lambda b: rt.weight_fn(b["c"], b["m"])
    vg = pipeline.value_and_grad(
        first_fn,
        stage_fn,
        lambda lp, h, b, *key: loss(lp, h, b["m"], *key),
        cell.k,
        schedule=SCHEDULES[cell.face],
        repeats=cell.repeats,
        stage_axis=rt.STAGE,
        has_aux=cell.option == "has_aux",
        **kw,
    )
    dtype = rt.JNP_DTYPES[cell.dtype]

    def f(p, c, m, key=None):
        stages = {"s": jnp.ones((cell.num_stages,), dtype)}
        value, grads = vg(({}, stages, p), {"c": c, "m": m}, key)
        return value, grads[2]

    return f
