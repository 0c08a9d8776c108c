# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Large-batch optimizers (LAMB, LARS) under accumulation equal their large batch.

LAMB and LARS scale each layer's update by a trust ratio computed from the
update and the parameters, so they are sensitive to which gradient they see:
the mean of k micro-batch gradients, presented once per window, must give the
step the optimizer takes on the full batch. Both faces (`accumulate` and the
`MultiSteps` drop-in) are checked against the plain optimizer on the full
batch over several windows, with weight decay and a learning-rate schedule
(which must count windows, not micro-batches).
"""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optax_accum
from tests.helpers.lanes import sweep
from tests.helpers.models import mlp_loss, mlp_params, regression_data

K, MICRO, WINDOWS = 4, 6, 4


def _schedule():
    return optax.linear_schedule(0.05, 0.01, transition_steps=WINDOWS)


OPTIMIZERS = {
    "lamb": lambda: optax.lamb(_schedule(), weight_decay=1e-2),
    "lars": lambda: optax.lars(
        _schedule(), weight_decay=1e-2, trust_coefficient=0.5, momentum=0.9
    ),
}

FACES = {
    "accumulate": lambda inner: optax_accum.accumulate(inner, K),
    "MultiSteps": lambda inner: optax_accum.MultiSteps(
        inner, every_k_schedule=K
    ).gradient_transformation(),
}


def _step(tx):
    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(mlp_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def _large_batch_run(tx, params, x, y):
    """The reference: one optimizer step per window, on the full window."""
    step, state = _step(tx), tx.init(params)
    trajectory = []
    for w in range(WINDOWS):
        rows = slice(w * K * MICRO, (w + 1) * K * MICRO)
        params, state = step(params, state, x[rows], y[rows])
        trajectory.append(params)
    return trajectory


def _displacement(params, start):
    # Compare how far training moved the parameters, so that a small update
    # cannot hide inside the tolerance on the parameters themselves.
    return jax.tree.map(jnp.subtract, params, start)


@pytest.mark.parametrize(
    ("name", "face"),
    sweep(itertools.product(OPTIMIZERS, FACES), fast=[("lamb", "MultiSteps")]),
)
def test_accumulated_large_batch_optimizer_equals_full_batch(name, face):
    x, y = regression_data(WINDOWS * K * MICRO, seed=3)
    start = mlp_params(2)
    reference = _large_batch_run(OPTIMIZERS[name](), start, x, y)

    tx = FACES[face](OPTIMIZERS[name]())
    step, state, params = _step(tx), tx.init(start), start
    for w in range(WINDOWS):
        for i in range(K):
            rows = slice((w * K + i) * MICRO, (w * K + i + 1) * MICRO)
            params, state = step(params, state, x[rows], y[rows])
        chex.assert_trees_all_close(
            _displacement(params, start),
            _displacement(reference[w], start),
            rtol=1e-5,
            atol=1e-7,
        )


@pytest.mark.parametrize("name", sweep(OPTIMIZERS, fast=["lamb"]))
def test_small_steps_are_not_the_large_batch_step(name):
    # Guards the test above: k small LAMB/LARS steps per window differ from
    # the large-batch step by far more than its tolerance.
    x, y = regression_data(WINDOWS * K * MICRO, seed=3)
    start = mlp_params(2)
    reference = _large_batch_run(OPTIMIZERS[name](), start, x, y)
    small = OPTIMIZERS[name]()
    step, state, params = _step(small), small.init(start), start
    for i in range(K):
        rows = slice(i * MICRO, (i + 1) * MICRO)
        params, state = step(params, state, x[rows], y[rows])
    moved = jax.tree.leaves(_displacement(params, start))
    expected = jax.tree.leaves(_displacement(reference[0], start))
    gaps = [
        float(jnp.max(jnp.abs(a - b))) for a, b in zip(moved, expected, strict=True)
    ]
    assert max(gaps) > 1e-3
