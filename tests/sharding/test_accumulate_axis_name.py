# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`accumulate(..., axis_name=...)` under pmap and shard_map on 8 CPU devices."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from tests.helpers import hlo as _hlo
from tests.helpers.lanes import sweep
from tests.helpers.models import mlp_loss, mlp_params, regression_data

N = 8
K = 3


def _full_batch_reference(tx, params, x, y, windows):
    state = tx.init(params)
    for w in range(windows):
        xb, yb = x[w], y[w]
        g = jax.grad(mlp_loss)(
            params, xb.reshape(-1, xb.shape[-1]), yb.reshape(-1, yb.shape[-1])
        )
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
    return params


def _data(windows):
    # (windows, K micro-batches, N devices * 2 rows, features)
    x, y = regression_data(windows * K * N * 2, seed=4)
    return x.reshape(windows, K, N * 2, -1), y.reshape(windows, K, N * 2, -1)


def _all_reduces(hlo: str) -> tuple[int, int]:
    """(all-reduces inside conditional branches, all-reduces elsewhere)."""
    comps, _ = _hlo.computations(hlo)
    inside = _hlo.reachable(comps, _hlo.branch_roots(comps))
    return _hlo.count(comps, inside), _hlo.count(comps, set(comps) - inside)


@pytest.mark.slow
@pytest.mark.parametrize("reduction", sweep(["mean", "sum"], fast=["sum"]))
def test_pmap_matches_single_device_full_batch(reduction):
    windows = 2
    x, y = _data(windows)
    params = mlp_params()
    inner = optax.adam(1e-2)
    tx = optax_accum.accumulate(inner, K, axis_name="d", reduction=reduction)

    def step(p, s, xb, yb):
        g = jax.grad(mlp_loss)(p, xb, yb)  # local gradient: no pmean
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    pstep = jax.pmap(step, axis_name="d")
    rep = jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), params)
    state = jax.pmap(tx.init, axis_name="d")(rep)
    p = rep
    for w in range(windows):
        for i in range(K):
            p, state = pstep(
                p, state, x[w, i].reshape(N, 2, -1), y[w, i].reshape(N, 2, -1)
            )
    if reduction == "mean":
        ref = _full_batch_reference(inner, params, x, y, windows)
    else:
        # The sum over K micro-batches and N devices of per-shard mean gradients.
        scaled = optax.chain(optax.scale(K * N), inner)
        ref = _full_batch_reference(scaled, params, x, y, windows)
    for d in (0, N - 1):
        chex.assert_trees_all_close(
            jax.tree.map(lambda a, d=d: a[d], p), ref, rtol=1e-5, atol=1e-6
        )
    hlo = (
        pstep.lower(p, state, x[0, 0].reshape(N, 2, -1), y[0, 0].reshape(N, 2, -1))
        .compile()
        .as_text()
    )
    assert _all_reduces(hlo) == (1, 0)


def _shard_map_step(tx, mesh, specs):
    def step(p, s, xb, yb, weight):
        # Varying params make jax.grad return the device-local gradient.
        g = jax.grad(mlp_loss)(jax.lax.pcast(p, "d", to="varying"), xb, yb)
        u, s = tx.update(g, s, p, weight=weight[0])
        return optax.apply_updates(p, u), s

    return jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), specs, P("d"), P("d"), P("d")),
            out_specs=(P(), specs),
        )
    )


def test_shard_map_matches_single_device_full_batch_and_reduces_once():
    windows = 2
    x, y = _data(windows)
    params = mlp_params()
    inner = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2))
    tx = optax_accum.accumulate(inner, K, axis_name="d")
    mesh = jax.make_mesh((N,), ("d",))
    specs = optax_accum.state_specs(jax.eval_shape(tx.init, params), "d")
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    step = _shard_map_step(tx, mesh, specs)
    shard = NamedSharding(mesh, P("d"))
    ones = jax.device_put(jnp.ones(N), shard)
    state, p = init(params), params
    assert state.accumulator[0]["w"].shape == (N, 6, 8)
    for w in range(windows):
        for i in range(K):
            xb, yb = (jax.device_put(a[w, i], shard) for a in (x, y))
            p, state = step(p, state, xb, yb, ones)
    ref = _full_batch_reference(inner, params, x, y, windows)
    chex.assert_trees_all_close(p, ref, rtol=1e-5, atol=1e-6)
    hlo = step.lower(p, state, xb, yb, ones).compile().as_text()
    # One (combined) all-reduce per update, inside the boundary branch.
    assert _all_reduces(hlo) == (1, 0)


@pytest.mark.slow
def test_shard_map_token_weights_across_devices():
    # Devices hold different numbers of valid rows; weights make it exact.
    tx = optax_accum.accumulate(optax.sgd(1.0), 2, axis_name="d")
    mesh = jax.make_mesh((N,), ("d",))
    params = mlp_params()
    specs = optax_accum.state_specs(jax.eval_shape(tx.init, params), "d")
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def masked_loss(p, x, y, m):
        h = x
        for i, layer in enumerate(p):
            h = h @ layer["w"] + layer["b"]
            if i < len(p) - 1:
                h = jnp.tanh(h)
        per_row = jnp.mean((h - y) ** 2, axis=-1)
        return jnp.sum(per_row * m) / jnp.maximum(jnp.sum(m), 1)

    def step(p, s, xb, yb, mb):
        g = jax.grad(masked_loss)(jax.lax.pcast(p, "d", to="varying"), xb, yb, mb)
        u, s = tx.update(g, s, p, weight=jnp.sum(mb))
        return u, s

    sm = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), specs, P("d"), P("d"), P("d")),
            out_specs=(P(), specs),
        )
    )
    x, y = regression_data(2 * N * 4, seed=5)
    x, y = x.reshape(2, N * 4, -1), y.reshape(2, N * 4, -1)
    rng = np.random.default_rng(0)
    m = jnp.asarray(rng.random((2, N * 4)) < 0.4, jnp.float32)
    shard = NamedSharding(mesh, P("d"))
    state = init(params)
    for i in range(2):
        u, state = sm(params, state, *(jax.device_put(a[i], shard) for a in (x, y, m)))
    full = jax.grad(masked_loss)(
        params, x.reshape(-1, 6), y.reshape(-1, 3), m.reshape(-1)
    )
    chex.assert_trees_all_close(
        u, jax.tree.map(jnp.negative, full), rtol=1e-5, atol=1e-7
    )


def test_skip_fn_agrees_across_devices_with_one_scalar_all_reduce():
    tx = optax_accum.accumulate(
        optax.sgd(1.0), 2, axis_name="d", skip_fn=optax_accum.skip_not_finite
    )
    params = {"a": jnp.zeros(2)}
    rep = jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), params)
    state = jax.pmap(tx.init, axis_name="d")(rep)
    update = jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name="d")
    g = np.ones((N, 2), np.float32)
    g[3, 0] = np.nan  # one device sees a NaN: every device skips the micro-batch
    u, state = update({"a": jnp.asarray(g)}, state, rep)
    np.testing.assert_array_equal(np.asarray(u["a"]), np.zeros((N, 2)))
    np.testing.assert_array_equal(np.asarray(state.micro_step), np.zeros(N))
    np.testing.assert_array_equal(np.asarray(state.num_skipped), np.ones(N))
    hlo = update.lower({"a": jnp.asarray(g)}, state, rep).compile().as_text()
    inside, outside = _all_reduces(hlo)
    assert (inside, outside) == (1, 1)


_SKIP = optax_accum.skip_large_updates(50.0)


@functools.cache
def _skip_large_step(n):
    """One `update` of SGD(1), k = 1, `skip_large_updates(50)`, on ``n``
    devices, compiled once: the update and the state."""
    tx = optax_accum.accumulate(optax.sgd(1.0), 1, axis_name="d", skip_fn=_SKIP)
    mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])
    params = jnp.zeros(())
    specs = optax_accum.state_specs(jax.eval_shape(tx.init, params), "d")

    def step(g, w):
        u, s = tx.update(g[0], tx.init(params), params, weight=w[0])
        return u[None], s

    sm = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=(P("d"), specs)
        )
    )
    shard = NamedSharding(mesh, P("d"))
    put = lambda a: jax.device_put(jnp.asarray(a, jnp.float32), shard)
    return lambda grads, weights: sm(put(grads), put(weights))


@pytest.mark.slow
@pytest.mark.parametrize(
    "grads, weights, skipped",
    [
        ([60.0, 10.0], [1.0, 1.0], False),  # the micro-batch's 35, not 60
        ([60.0, 50.0], [1.0, 1.0], True),  # 55
        ([60.0, 10.0], [4.0, 1.0], False),  # 50: on the bound
        ([60.0, 10.0], [5.0, 1.0], True),  # 51.7
        ([40.0, float("nan")], [1.0, 0.0], False),  # padding left out
    ],
)
def test_skip_large_updates_judges_the_micro_batch_gradient_in_both_modes(
    grads, weights, skipped
):
    u, state = _skip_large_step(len(grads))(grads, weights)
    w = np.asarray(weights)
    mean = np.sum(np.where(w > 0, w * np.asarray(grads), 0.0)) / np.sum(w)
    # The global view: one device, the micro-batch's gradient as jax.grad gives it.
    glob = optax_accum.accumulate(optax.sgd(1.0), 1, skip_fn=_SKIP)
    g_u, g_state = glob.update(jnp.float32(mean), glob.init(jnp.zeros(())), None)
    assert bool(g_state.num_skipped) == skipped
    np.testing.assert_allclose(np.asarray(u), [float(g_u)] * len(grads), rtol=1e-6)
    np.testing.assert_array_equal(state.num_skipped, int(skipped))
    np.testing.assert_allclose(state.skip_state["norm"], mean, rtol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_axis_name_over_data_with_a_tensor_parallel_model_axis(reduction):
    """Issue 39, finding 3: inside ``shard_map`` on a (data 2 x model 4) mesh
    with ``w`` split over ``model``, the boundary's update varies over
    ``model`` once the data axis is reduced; the hold branch's zeros must too
    (the ``cond`` refused the branches' types)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    tx = optax_accum.accumulate(optax.sgd(0.1), 2, reduction=reduction,
                                axis_name="data")  # fmt: skip
    grads = jnp.arange(2 * 8.0).reshape(2, 8)  # one row per data device

    def step(w, g):
        s = tx.init({"w": w})
        first, s = tx.update({"w": g[0]}, s, {"w": w})
        second, s = tx.update({"w": 2 * g[0]}, s, {"w": w})
        return first["w"][None], second["w"][None]

    run = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(P("model"), P("data", "model")),
        out_specs=(P("data", "model"), P("data", "model")),
    ))  # fmt: skip
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    first, second = run(put(jnp.zeros(8), P("model")), put(grads, P("data", "model")))
    window = 3 * grads.sum(0)  # both calls of both data devices
    if reduction == "mean":
        window = window / 4
    np.testing.assert_array_equal(first, np.zeros((2, 8)))
    np.testing.assert_allclose(second, np.stack([-0.1 * window] * 2), rtol=1e-6)
