# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Tests for `scale_learning_rate` and `batch_size_warmup`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum


@pytest.mark.parametrize(
    ("lr", "base", "new", "rule", "expected"),
    [
        (0.1, 256, 1024, "linear", 0.4),
        (0.1, 256, 64, "linear", 0.025),
        (3e-4, 32, 128, "sqrt", 6e-4),
        (1e-3, 100, 900, "sqrt", 3e-3),
        (0.5, 7, 7, "sqrt", 0.5),
        (2, 10, 15, "linear", 3.0),
    ],
)
def test_scale_float_matches_hand_computed(lr, base, new, rule, expected):
    out = optax_accum.scale_learning_rate(lr, base, new, rule=rule)
    assert isinstance(out, float)
    assert out == pytest.approx(expected, rel=1e-12)


def test_default_rule_is_linear():
    assert optax_accum.scale_learning_rate(1.0, 4, 12) == 3.0


def test_scale_array_stays_array():
    out = optax_accum.scale_learning_rate(jnp.asarray(0.25, jnp.float32), 2, 8)
    assert isinstance(out, jax.Array)
    assert out.dtype == jnp.float32
    assert float(out) == 1.0


@pytest.mark.parametrize("rule", ["linear", "sqrt"])
def test_scale_schedule(rule):
    base = optax.cosine_decay_schedule(0.1, decay_steps=100)
    factor = {"linear": 4.0, "sqrt": 2.0}[rule]
    scaled = optax_accum.scale_learning_rate(base, 64, 256, rule=rule)
    assert callable(scaled)
    steps = jnp.arange(0, 120, 7)
    np.testing.assert_allclose(
        jax.vmap(scaled)(steps), factor * jax.vmap(base)(steps), rtol=1e-6
    )
    # Usable as an optax learning rate, traced inside jit.
    tx = optax.sgd(scaled)
    params = jnp.ones(3)
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)(jnp.ones(3), state)
    np.testing.assert_allclose(updates, -factor * 0.1 * np.ones(3), rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"learning_rate": "0.1"}, TypeError, "`learning_rate`.*'0.1'"),
        ({"learning_rate": True}, TypeError, "`learning_rate`"),
        ({"learning_rate": [0.1]}, TypeError, "`learning_rate`"),
        ({"learning_rate": -0.1}, ValueError, "`learning_rate`.*-0.1"),
        ({"learning_rate": float("nan")}, ValueError, "`learning_rate`.*nan"),
        ({"base_batch_size": 0}, ValueError, "`base_batch_size`.*0"),
        ({"base_batch_size": 2.5}, TypeError, "`base_batch_size`.*2.5"),
        ({"batch_size": -4}, ValueError, "`batch_size`.*-4"),
        ({"batch_size": "64"}, TypeError, "`batch_size`"),
        ({"rule": "square"}, ValueError, "`rule`.*'square'"),
    ],
)
def test_scale_bad_input(kwargs, error, match):
    args = {"learning_rate": 0.1, "base_batch_size": 32, "batch_size": 64}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        optax_accum.scale_learning_rate(**args)


def test_warmup_values_hand_computed():
    every_k = optax_accum.batch_size_warmup(16, 16, 112, warmup_steps=4)
    # k goes from 1 to 7 over 4 updates: 1 + floor(6 t / 4).
    got = [int(every_k(t)) for t in range(7)]
    assert got == [1, 2, 4, 5, 7, 7, 7]
    assert every_k(jnp.asarray(2, jnp.int32)).dtype == jnp.int32


def _windows(every_k, num_micro_steps):
    """Runs `accumulate` on gradient 1, 2, 3, ... and returns the windows."""
    tx = optax_accum.accumulate(optax.sgd(1.0), every_k=every_k)
    params = {"w": jnp.zeros([])}
    state = tx.init(params)
    update = jax.jit(tx.update)
    windows, current, emitted = [], [], []
    for i in range(1, num_micro_steps + 1):
        u, state = update({"w": jnp.asarray(float(i))}, state, params)
        current.append(i)
        if bool(optax_accum.has_updated(state)):
            windows.append(current)
            emitted.append(float(u["w"]))
            current = []
    return windows, emitted


def test_warmup_with_accumulate_gives_expected_windows():
    every_k = optax_accum.batch_size_warmup(8, 8, 32, warmup_steps=3)
    windows, emitted = _windows(every_k, 1 + 2 + 3 + 4 + 4)
    assert windows == [[1], [2, 3], [4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]]
    # SGD(1) on the window mean: the update is minus the mean of each window.
    assert emitted == [-1.0, -2.5, -5.0, -8.5, -12.5]


def test_warmup_with_multisteps_gives_expected_windows():
    every_k = optax_accum.batch_size_warmup(4, 8, 16, warmup_steps=2)
    ms = optax_accum.MultiSteps(optax.sgd(1.0), every_k_schedule=every_k)
    params = jnp.zeros([])
    state = ms.init(params)
    boundaries = []
    for i in range(1, 13):
        _, state = ms.update(jnp.asarray(float(i)), state, params)
        if bool(ms.has_updated(state)):
            boundaries.append(i)
    # k = 2, 3, 4, 4: windows end after micro-steps 2, 5, 9, 13.
    assert boundaries == [2, 5, 9]


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((8, 12, 32, 3), ValueError, "`init_batch_size`.*multiple.*12"),
        ((8, 8, 36, 3), ValueError, "`batch_size`.*multiple.*36"),
        ((0, 8, 32, 3), ValueError, "`microbatch_size`"),
        ((8, 8, 32, 0), ValueError, "`warmup_steps`"),
        ((8, 8, 32.0, 3), TypeError, "`batch_size`"),
    ],
)
def test_warmup_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        optax_accum.batch_size_warmup(*args)
