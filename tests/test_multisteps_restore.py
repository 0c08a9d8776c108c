# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""An ``optax.MultiSteps`` state continued by our `MultiSteps` (issue 33, §2).

`MultiSteps.from_optax` gives the state the structure that every update
returns, so a ``lax.scan`` loop takes it; with any of our options the state
continues as one that was ours from the start, and a window restored mid-way
never hands the inner optimizer a value it was not given.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import optax_accum
from tests.helpers.lanes import sweep

K = 4
PRE = 2  # accepted mini-steps before the hand-over: mid-window
SKIP = optax.skip_not_finite


def _recording():
    """An inner optimizer that reads ``value``: ``w`` gets the window's
    gradient, ``b`` the value it was given."""

    def update(updates, state, params=None, *, value, **extra_args):
        del params, extra_args
        return {"w": updates["w"], "b": jnp.zeros_like(updates["b"]) + value}, state

    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)


def _inner(name):
    if name == "recording":
        return _recording()
    # reduce_on_plateau reads `value`: its scale depends on every value.
    return optax.chain(
        optax.sgd(0.5), optax.contrib.reduce_on_plateau(patience=1, factor=0.5)
    )


PARAMS = {"w": jnp.zeros(3), "b": jnp.zeros([])}
# Calls after the hand-over: (rejected, close_window). A rejected call has a
# NaN gradient (rejected by the skip function) and a value nobody may see.
SCENARIOS = {
    "plain": [(False, False)] * 6,
    "close_after_accepted": [(False, True)] + [(False, False)] * 5,
    "close_after_rejected": [(True, True)] + [(False, False)] * 6,
    "rejected_then_k": [(True, False), (True, True)] + [(False, False)] * 6,
}


def _calls(scenario, skip):
    """The calls after the hand-over, and the closes a continued state can
    honour: none while the restored window has seen no value."""
    calls, effective = [], []
    rng = np.random.default_rng(0)
    m, restored, seen, later = PRE, True, 0, iter([5.0, 2.0, 7.0, 1.0, 6.0, 0.5])
    for rejected, close in SCENARIOS[scenario]:
        rejected = rejected and skip is not None
        grad = np.full(3, np.nan) if rejected else rng.normal(size=3)
        # The restored window's values all equal the ones before the
        # hand-over, so its mean since the hand-over is its whole mean.
        value = 99.0 if rejected else (3.0 if restored else next(later))
        if not rejected:
            m, seen = m + 1, seen + 1
        honoured = close and not (restored and seen == 0)
        if m > 0 and (m >= K or honoured) and not (restored and seen == 0):
            m, restored = 0, False
        calls.append((grad, value, close))
        effective.append((grad, value, honoured))
    return calls, effective


def _before():
    rng = np.random.default_rng(1)
    return [(rng.normal(size=3), 3.0, False) for _ in range(PRE)]


def _run(ms, state, calls):
    update = jax.jit(
        lambda s, g, v, c: ms.update(
            {"w": g, "b": jnp.float32(0)}, s, PARAMS, value=v, close_window=c
        )
    )
    emitted = []
    for grad, value, close in calls:
        u, state = update(
            state, jnp.asarray(grad, jnp.float32), jnp.float32(value), close
        )
        if bool(ms.has_updated(state)):
            emitted.append(u)
    return emitted, state


def _handed_over(opts, inner):
    theirs = optax.MultiSteps(inner, K, **opts)
    state = theirs.init(PARAMS)
    for grad, value, _ in _before():
        g = {"w": jnp.asarray(grad, jnp.float32), "b": jnp.float32(0)}
        _, state = theirs.update(g, state, PARAMS, value=jnp.float32(value))
    assert int(state.mini_step) == PRE
    return state


@pytest.mark.parametrize(
    ("skip", "inner", "scenario"),
    sweep(
        [
            (skip, inner, scenario)
            for skip in (None, SKIP)
            for inner in ("recording", "plateau")
            for scenario in SCENARIOS
            if skip is not None or "rejected" not in scenario
        ],
        fast=[
            (SKIP, "recording", "close_after_rejected"),
            (SKIP, "plateau", "rejected_then_k"),
            (None, "plateau", "close_after_accepted"),
        ],
    ),
)
def test_continues_as_a_state_ours_from_the_start(skip, inner, scenario):
    opts = {"should_skip_update_fn": skip}
    ms = optax_accum.MultiSteps(_inner(inner), K, **opts)
    calls, effective = _calls(scenario, skip)
    state = ms.from_optax(_handed_over(opts, _inner(inner)), PARAMS)
    got, state = _run(ms, state, calls)
    # The reference: ours from the start, on the closes the continued state
    # could honour (a close before the restored window saw a value is not).
    ref, ref_state = _run(ms, ms.init(PARAMS), _before() + effective)
    ref = ref[len(ref) - len(got) :]
    assert len(got) >= 2 and len(ref) == len(got)
    # optax's running mean and ours round alike to within an ulp or two.
    chex.assert_trees_all_close(got, ref, rtol=1e-6)
    chex.assert_trees_all_close(
        state.inner_opt_state, ref_state.inner_opt_state, rtol=1e-6
    )
    if inner == "recording":  # never the rejected calls' 99, never a stale 0
        assert all(0.5 <= float(u["b"]) <= 7.0 for u in got)


@pytest.mark.parametrize(
    "option",
    sweep(["skip", "value", "noise", "all"], fast=["all"]),
)
def test_from_optax_gives_a_state_lax_scan_carries(option, tmp_path):
    # Issue 33: `acc_value` went from () to ValueSince (and `updated` from ()
    # to a bool) on the first update, so a lax.scan loop failed.
    opts = {
        "should_skip_update_fn": SKIP if option in ("skip", "all") else None,
        "noise_scale_decay": 0.5 if option in ("noise", "all") else None,
    }
    inner = _inner("plateau" if option in ("value", "all") else "recording")
    ms = optax_accum.MultiSteps(inner, K, **opts)
    theirs = {k: v for k, v in opts.items() if k == "should_skip_update_fn"}
    state = _handed_over(theirs, inner)
    # The documented restore: as optax's state, then `from_optax`.
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", state)
        target = jax.eval_shape(lambda p: ms.init(p).to_optax(), PARAMS)
        state = ms.from_optax(ckptr.restore(tmp_path / "ckpt", target), PARAMS)
    rng = np.random.default_rng(2)
    grads = jnp.asarray(rng.normal(size=(2 * K + 1, 3)), jnp.float32)
    values = jnp.asarray(rng.uniform(1, 2, size=2 * K + 1), jnp.float32)

    def step(s, xs):
        g, v = xs
        u, s = ms.update({"w": g, "b": jnp.float32(0)}, s, PARAMS, value=v)
        return s, u

    scanned, scanned_u = jax.lax.scan(step, state, (grads, values))
    looped, looped_u = state, []
    for g, v in zip(grads, values, strict=True):
        looped, u = step(looped, (g, v))
        looped_u.append(u)
    chex.assert_trees_all_close(
        scanned_u, jax.tree.map(lambda *x: jnp.stack(x), *looped_u), rtol=1e-6
    )
    chex.assert_trees_all_close(scanned, looped, rtol=1e-6)
    assert int(scanned.gradient_step) == 2


def test_noise_scale_measures_the_windows_after_the_hand_over():
    # An optax state with `noise_scale_decay` once failed with AttributeError
    # ('tuple' object has no attribute 'sq_sum'). The window restored
    # mid-way measures nothing; the next ones measure what ours does.
    inner = optax.sgd(0.1)
    ms = optax_accum.MultiSteps(inner, K, noise_scale_decay=0.5)
    state = _handed_over({}, inner)
    rng = np.random.default_rng(3)
    calls = [(rng.normal(size=3), 1.0, False) for _ in range(K - PRE + K)]
    got, state = _run(ms, state, calls)  # optax's state, no from_optax
    ref, ref_state = _run(ms, ms.init(PARAMS), _before() + calls)
    chex.assert_trees_all_close(got, ref, rtol=1e-6)
    ns, ref_ns = state.noise_scale, ref_state.noise_scale
    assert int(ns.windows) == int(ref_ns.windows) - 1 == 1
    np.testing.assert_allclose(ns.last_grad_sq, ref_ns.last_grad_sq, rtol=1e-5)
    np.testing.assert_allclose(ns.last_trace, ref_ns.last_trace, rtol=1e-5)


@pytest.mark.parametrize(
    ("theirs", "ours"),
    [(None, SKIP), (SKIP, None), (SKIP, optax_accum.skip_large_updates(10.0))],
    ids=["skip_only_ours", "skip_only_theirs", "another_skip"],
)
def test_from_optax_gives_the_skip_state_every_update_returns(theirs, ours):
    inner = _inner("recording")
    ms = optax_accum.MultiSteps(inner, K, should_skip_update_fn=ours)
    state = ms.from_optax(
        _handed_over({"should_skip_update_fn": theirs}, inner), PARAMS
    )
    rng = np.random.default_rng(4)
    grads = jnp.asarray(rng.normal(size=(K, 3)), jnp.float32)

    def step(s, g):
        u, s = ms.update({"w": g, "b": jnp.float32(0)}, s, PARAMS, value=1.0)
        return s, u

    scanned, _ = jax.lax.scan(step, state, grads)  # one structure throughout
    assert jax.tree.structure(scanned) == jax.tree.structure(state)
    assert (int(scanned.gradient_step), int(scanned.mini_step)) == (1, PRE)
