# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The fused DP step in a Flax nnx custom step: `clipped_value_and_grad` over
k micro-batches and ``dp_accumulate(inner, 1, ...)`` in one ``nnx.jit``,
against the same step written on plain pytrees."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optax_accum import privacy

nnx = pytest.importorskip("flax.nnx")

C, SIGMA, K, ROWS = 1.0, 1.0, 4, 32


def _dp_sgd(key):
    return privacy.dp_accumulate(
        optax.sgd(0.1), 1, l2_clip_norm=C, noise_multiplier=SIGMA,
        expected_batch_size=ROWS, key=key,
    )  # fmt: skip


# The step a guide shows: split off the parameters, clip per example over K
# micro-batches, and let the optimizer noise the sum once.
@nnx.jit
def train_step(model, optimizer, x, y):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, x, y):
        out = nnx.merge(graphdef, params, rest)(x)
        return jnp.mean((out - y) ** 2)

    vg = privacy.clipped_value_and_grad(loss_fn, C, K, batch_argnums=(1, 2))
    loss, grads = vg(params, x, y)
    optimizer.update(model, grads)
    return loss


def test_nnx_custom_fused_step_equals_the_pytree_step():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(ROWS, 5)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(ROWS, 2)), jnp.float32)
    model = nnx.Linear(5, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, _dp_sgd(jax.random.key(1)), wrt=nnx.Param)
    params = jax.tree.map(jnp.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))

    for _ in range(2):
        train_step(model, optimizer, x, y)

    def loss(p, x, y):
        return jnp.mean((x @ p["kernel"] + p["bias"] - y) ** 2)

    tx = _dp_sgd(jax.random.key(1))
    state = tx.init(params)
    vg = privacy.clipped_value_and_grad(loss, C, K, batch_argnums=(1, 2))
    for _ in range(2):
        u, state = tx.update(vg(params, x, y)[1], state, params)
        params = optax.apply_updates(params, u)
    trained = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for name in ("kernel", "bias"):
        np.testing.assert_allclose(
            np.asarray(trained[name]), np.asarray(params[name]), rtol=1e-5, atol=1e-6
        )
