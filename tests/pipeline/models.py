# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""A tiny staged model for the pipeline tests and its sequential reference.

``first_fn`` embeds, each stage is a residual tanh layer, ``loss_fn`` a
linear head with a masked squared error (a token mean over ``mask``). The
reference is ``jax.value_and_grad`` of the stages applied one after another
on the whole batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

D_IN, WIDTH, D_OUT = 3, 8, 2


def first_fn(fp, batch):
    return jnp.tanh(batch["x"] @ fp["w"])


def stage_fn(sp, h):
    return h + jnp.tanh(h @ sp["w"] + sp["b"])


def loss_fn(lp, h, batch):
    err = jnp.sum((h @ lp["w"] - batch["y"]) ** 2, axis=-1)
    mask = batch["mask"]
    return jnp.sum(err * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def weight_fn(batch):
    return jnp.sum(batch["mask"])


def stage(sp, j):
    return jax.tree.map(lambda v: v[j], sp)


def sequential(params, batch, stage_fn=stage_fn, first_fn=first_fn, loss_fn=loss_fn):
    fp, sp, lp = params
    h = first_fn(fp, batch)
    for j in range(jax.tree.leaves(sp)[0].shape[0]):
        h = stage_fn(stage(sp, j), h)
    return loss_fn(lp, h, batch)


def make(num_stages, rows, seed=0, width=WIDTH, ragged=False):
    """``(params, batch)``; ``ragged``: a mask with unequal counts per row group."""
    k = jax.random.split(jax.random.key(seed), 6)
    fp = {"w": jax.random.normal(k[0], (D_IN, width)) / np.sqrt(D_IN)}
    sp = {
        "w": jax.random.normal(k[1], (num_stages, width, width)) / np.sqrt(width),
        "b": jax.random.normal(k[2], (num_stages, width)) * 0.1,
    }
    lp = {"w": jax.random.normal(k[3], (width, D_OUT)) / np.sqrt(width)}
    mask = np.ones(rows, np.float32)
    if ragged:
        mask = (np.random.default_rng(seed).random(rows) < 0.6).astype(np.float32)
        mask[:2] = 1.0
    batch = {
        "x": jax.random.normal(k[4], (rows, D_IN)),
        "y": jax.random.normal(k[5], (rows, D_OUT)),
        "mask": jnp.asarray(mask),
    }
    return (fp, sp, lp), batch


def max_rel_error(got, want) -> float:
    """The largest ``|got - want| / max|want|`` over the leaves (per leaf scale)."""
    errs = [
        float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))))
        / max(float(np.max(np.abs(np.asarray(w, np.float64)))), 1e-30)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    ]
    return max(errs)


def assert_close(got, want, rtol=1e-5):
    """Every leaf of ``got`` equals ``want`` at ``rtol`` elementwise, with an
    absolute floor of ``rtol`` times the leaf's largest value."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        w = np.asarray(w, np.float64)
        scale = max(float(np.max(np.abs(w))), 1e-30)
        np.testing.assert_allclose(
            np.asarray(g, np.float64), w, rtol=rtol, atol=rtol * scale
        )
