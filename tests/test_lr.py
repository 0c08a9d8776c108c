# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Tests for `scale_learning_rate` and the ``every_k`` schedules
(`batch_size_warmup`, `adaptive_every_k`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from tests.helpers.lanes import sweep


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


@pytest.mark.parametrize(
    ("init", "final", "warmup"),
    sweep(
        [
            (1, 4097, 1_000_000),  # issue 23: -1837 at step 600,000 (int32 overflow)
            (1, 4096, 10_000_000),
            (8, 8192, 3_000_000),
            (4096, 2, 10_000_000),  # a decreasing ramp
            (3, 100_000, 7),
        ],
        fast=[(1, 4097, 1_000_000), (4096, 2, 10_000_000)],
    ),
)
def test_warmup_is_exact_and_monotone_for_long_ramps(init, final, warmup):
    every_k = optax_accum.batch_size_warmup(1, init, final, warmup)
    rng = np.random.default_rng(0)
    steps = np.concatenate(
        [
            np.linspace(0, warmup, 100_001).astype(np.int64),
            rng.integers(0, warmup + 1, 100_000),
            [warmup - 1, warmup, warmup + 1, 2 * warmup, 2**31 - 1],
        ]
    )
    steps = np.unique(np.minimum(steps, 2**31 - 1))
    got = np.asarray(jax.jit(jax.vmap(every_k))(jnp.asarray(steps, jnp.int32)))
    # Python integers do not overflow: the reference ramp.
    ramp = lambda t: init + (final - init) * min(int(t), warmup) // warmup
    want = np.array([ramp(t) for t in steps])
    np.testing.assert_array_equal(got, want)
    assert np.all(np.diff(got) * np.sign(final - init) >= 0)


def test_warmup_issue_23_values():
    every_k = optax_accum.batch_size_warmup(1, 1, 4097, 1_000_000)
    assert int(every_k(600_000)) == 2458
    assert int(every_k(2_000_000)) == 4097


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((1, 1, 4096, 2**30), "`warmup_steps`.*too long"),
        ((1, 1, 2**31, 10), "`batch_size`.*int32"),
    ],
)
def test_warmup_refuses_ramps_beyond_int32(args, match):
    with pytest.raises(ValueError, match=match):
        optax_accum.batch_size_warmup(*args)


def test_a_schedule_returning_k_beyond_int32_is_refused():
    tx = optax_accum.accumulate(optax.sgd(0.1), lambda step: 2**31)
    params = {"w": jnp.zeros(3)}
    with pytest.raises(ValueError, match=r"`every_k\(step\)`.*int32"):
        tx.update({"w": jnp.ones(3)}, tx.init(params), params)


def test_adaptive_max_k_beyond_int32_is_refused():
    with pytest.raises(ValueError, match=r"`max_k`.*int32"):
        optax_accum.adaptive_every_k(2, 2**31)


def _adaptive_updates(tx, params, grads):
    state = tx.init(params)
    update = jax.jit(tx.update)
    for g in grads:
        _, state = update({"w": g}, state, params)
    return state


@pytest.mark.parametrize("face", ["accumulate", "MultiSteps"])
@pytest.mark.parametrize("init_k", [None, 2])
def test_adaptive_min_k_1_on_one_device_is_refused(face, init_k):
    # Issue 23: a window of one micro-batch on one device measures nothing, so
    # k stayed at 1 for good (with init_k=1 nothing was ever measured).
    every_k = optax_accum.adaptive_every_k(1, 8, init_k=init_k)
    if face == "accumulate":
        tx = optax_accum.accumulate(optax.sgd(0.1), every_k, noise_scale_decay=0.9)
    else:
        tx = optax_accum.MultiSteps(optax.sgd(0.1), every_k, noise_scale_decay=0.9)
    params = {"w": jnp.zeros(3)}
    with pytest.raises(ValueError, match=r"min_k=1.*one device.*`min_k` >= 2"):
        _adaptive_updates(tx, params, [jnp.ones(3)])


def test_adaptive_min_k_2_on_one_device_measures():
    every_k = optax_accum.adaptive_every_k(2, 8)
    tx = optax_accum.accumulate(optax.sgd(0.1), every_k, noise_scale_decay=0.9)
    rng = np.random.default_rng(1)
    grads = [jnp.asarray(1.0 + rng.normal(size=3), jnp.float32) for _ in range(40)]
    ns = optax_accum.noise_scale(_adaptive_updates(tx, {"w": jnp.zeros(3)}, grads))
    assert int(ns.windows) > 0 and np.isfinite(float(ns.b_simple))


def test_adaptive_min_k_1_over_devices_measures_every_window():
    # With axis_name the devices supply the small batches: a window of one
    # micro-batch per device is measured, so min_k=1 stays allowed.
    devices = 4
    mesh = jax.make_mesh((devices,), ("d",), devices=jax.devices()[:devices])
    every_k = optax_accum.adaptive_every_k(1, 8)
    tx = optax_accum.accumulate(
        optax.sgd(0.1), every_k, axis_name="d", noise_scale_decay=0.9
    )
    params = {"w": jnp.zeros(3)}
    specs = optax_accum.state_specs(jax.eval_shape(tx.init, params), "d")

    def run(gs, state):
        def body(state, g):
            _, state = tx.update({"w": g[0]}, state, params)
            return state, optax_accum.has_updated(state)

        return jax.lax.scan(body, state, gs)

    init = jax.shard_map(
        lambda: tx.init(params), mesh=mesh, in_specs=(), out_specs=specs
    )
    run = jax.shard_map(
        run, mesh=mesh, in_specs=(P(None, "d"), specs), out_specs=(specs, P())
    )
    gs = 1.0 + jax.random.normal(jax.random.key(0), (6, devices, 3))
    gs = jax.device_put(gs, NamedSharding(mesh, P(None, "d")))
    state, updated = jax.jit(run)(gs, jax.jit(init)())
    ns = optax_accum.noise_scale(state)
    # k stays 1 while B_simple <= the 4 examples of a step; every window counts.
    assert int(ns.windows) == int(np.sum(updated)) > 0
