# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The DP step on 8 CPU devices: data parallel (``shard_map`` with
``axis_name``, and a global-view mesh) and FSDP give the one-device update
for the same key: the noise is drawn once, not once per device, and
replicated parameters stay identical."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import privacy

from .reference import data, loss
from .reference import per_example as reference_per_example

N, C, B, SIGMA, K = 8, 1.0, 64.0, 2.0, 2


def _tx(axis_name=None, sigma=SIGMA):
    return privacy.dp_accumulate(
        optax.adam(0.1), K, l2_clip_norm=C, noise_multiplier=sigma,
        expected_batch_size=B, key=jax.random.key(11), axis_name=axis_name,
    )  # fmt: skip


_vg = privacy.clipped_value_and_grad(loss, C, 2, batch_argnums=(1, 2))


def _one_device(params, xs, ys, sigma=SIGMA):
    tx = _tx(sigma=sigma)
    state = tx.init(params)

    @jax.jit
    def step(p, s, x, y):
        u, s = tx.update(_vg(p, x, y)[1], s, p)
        return optax.apply_updates(p, u), s

    for x, y in zip(xs, ys, strict=True):
        params, state = step(params, state, x, y)
    return params


def _batches(dim=3):
    params, x, y = data(rows=2 * K * 32, dim=dim, scale=2.0)
    return params, np.split(x, 2 * K), np.split(y, 2 * K)  # two windows of K calls


def _close(a, b, rtol=1e-5):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=1e-6)


def test_shard_map_axis_name_equals_one_device_and_params_stay_identical():
    params, xs, ys = _batches()
    mesh = jax.make_mesh((N,), ("d",))
    tx = _tx(axis_name="d")
    specs = optax_accum.state_specs(jax.eval_shape(tx.init, params), "d")
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def step(p, s, x, y):
        u, s = tx.update(_vg(p, x, y)[1], s, p)  # this device's clipped sum
        p = optax.apply_updates(p, u)
        return p, s, jax.tree.map(lambda a: a[None], p)  # each device's copy

    step = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), specs, P("d"), P("d")),
            out_specs=(P(), specs, P("d")),
        )
    )  # fmt: skip
    state, p = init(params), params
    shard = NamedSharding(mesh, P("d"))
    for x, y in zip(xs, ys, strict=True):
        p, state, copies = step(
            p, state, jax.device_put(x, shard), jax.device_put(y, shard)
        )
    for leaf in jax.tree.leaves(copies):  # every device holds the same params
        np.testing.assert_array_equal(
            np.asarray(leaf), np.asarray(leaf)[:1].repeat(N, 0)
        )
    _close(p, _one_device(params, xs, ys))
    # the noise is the one device's, not N draws: its scale is sigma C / B
    noiseless = _one_device(params, xs, ys, sigma=0.0)
    assert not np.allclose(np.asarray(p["w"]), np.asarray(noiseless["w"]))
    # after the boundary no device keeps its clipped sum (issue 39, finding 4)
    for a in jax.tree.leaves(state.accumulator):
        np.testing.assert_array_equal(np.asarray(a), 0.0)


def test_global_view_data_parallel_equals_one_device():
    params, xs, ys = _batches()
    mesh = jax.make_mesh((N,), ("d",))
    tx = _tx()
    state = tx.init(params)
    shard = NamedSharding(mesh, P("d"))

    @jax.jit
    def step(p, s, x, y):
        u, s = tx.update(_vg(p, x, y)[1], s, p)
        return optax.apply_updates(p, u), s

    p = params
    for x, y in zip(xs, ys, strict=True):
        p, state = step(p, state, jax.device_put(x, shard), jax.device_put(y, shard))
    _close(p, _one_device(params, xs, ys))


def test_fsdp_noise_in_each_shard_equals_one_device_without_gather():
    dim = 2 * N
    params, xs, ys = _batches(dim)
    mesh = jax.make_mesh((N,), ("d",))
    fsdp = {"w": NamedSharding(mesh, P("d")), "b": NamedSharding(mesh, P())}
    tx = _tx()
    sharded = jax.device_put(params, fsdp)
    state = jax.jit(tx.init, out_shardings=optax_accum.state_shardings(tx, sharded))(
        sharded
    )
    assert state.accumulator["w"].sharding.spec == P("d")

    @jax.jit
    def step(p, s, x, y):
        u, s = tx.update(_vg(p, x, y)[1], s, p)
        return optax.apply_updates(p, u), s

    p = sharded
    with jax.set_mesh(mesh):  # the library's convention on an Explicit mesh
        for x, y in zip(xs, ys, strict=True):
            p, state = step(p, state, x, y)
        # the update alone (accumulate, noise, Adam) gathers nothing
        g = jax.device_put(jax.tree.map(jnp.ones_like, params), fsdp)
        hlo = jax.jit(tx.update).lower(g, state, p).compile().as_text()
    assert p["w"].sharding.spec == P("d")
    _close(p, _one_device(params, xs, ys))
    assert "all-gather" not in hlo, [
        line for line in hlo.splitlines() if "all-gather" in line
    ]


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_fsdp_noise_is_drawn_shard_by_shard(axis_type):
    # The threefry bits are generated per shard (u32[D / N]); a replicated draw
    # followed by a slice would generate u32[D] on every device.
    d = 4096
    mesh = jax.make_mesh((N,), ("d",), axis_types=(getattr(AxisType, axis_type),))
    tx = privacy.dp_accumulate(
        optax.sgd(1.0), 1, l2_clip_norm=C, noise_multiplier=SIGMA,
        expected_batch_size=B, key=jax.random.key(0),
    )  # fmt: skip
    with jax.set_mesh(mesh):
        p = jax.device_put({"w": jnp.zeros(d)}, NamedSharding(mesh, P("d")))
        state = jax.jit(tx.init, out_shardings=optax_accum.state_shardings(tx, p))(p)
        hlo = jax.jit(tx.update).lower(p, state, p).compile().as_text()
        u, _ = jax.jit(tx.update)(p, state, p)
    sizes = {int(n) for n in re.findall(r"u32\[(\d+)\]", hlo)}
    assert d // N in sizes and d not in sizes, sizes
    assert "all-gather" not in hlo
    one = tx.update({"w": jnp.zeros(d)}, tx.init({"w": jnp.zeros(d)}), None)[0]
    np.testing.assert_array_equal(np.asarray(u["w"]), np.asarray(one["w"]))


def test_data_parallel_noise_std_is_one_devices():
    # Zero gradients on 8 devices: the update is the noise alone. Drawn once
    # after the reduction, its std is sigma C / B; drawn per device and summed
    # it would be sqrt(8) times that.
    d = 4096
    mesh = jax.make_mesh((N,), ("d",))
    tx = privacy.dp_accumulate(
        optax.sgd(1.0), 1, l2_clip_norm=C, noise_multiplier=SIGMA,
        expected_batch_size=B, key=jax.random.key(3), axis_name="d",
    )  # fmt: skip
    params = {"w": jnp.zeros(d)}
    specs = optax_accum.state_specs(jax.eval_shape(tx.init, params), "d")
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def step(p, s):
        g = jax.tree.map(
            lambda a: jax.lax.pcast(jnp.zeros_like(a), "d", to="varying"), p
        )
        u, _ = tx.update(g, s, p)
        return jax.tree.map(lambda a: a[None], u)

    step = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs), out_specs=P("d"))
    )
    u = np.asarray(step(params, init(params))["w"])
    assert (u == u[:1]).all()  # the same draw on every device
    assert abs(u[0].std() / (SIGMA * C / B) - 1) < 0.05


def test_pmap_axis_name_equals_one_device():
    params, xs, ys = _batches()
    tx = _tx(axis_name="d")

    def step(p, s, x, y):
        u, s = tx.update(_vg(p, x, y)[1], s, p)
        return optax.apply_updates(p, u), s

    rep = jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *np.shape(a))), params)
    state = jax.pmap(tx.init, axis_name="d")(rep)
    pstep = jax.pmap(step, axis_name="d")
    p = rep
    for x, y in zip(xs, ys, strict=True):
        p, state = pstep(p, state, x.reshape(N, -1, 3), y.reshape(N, -1))
    for leaf in jax.tree.leaves(p):
        leaf = np.asarray(leaf)
        np.testing.assert_array_equal(leaf, leaf[:1].repeat(N, 0))
    _close(jax.tree.map(lambda a: a[0], p), _one_device(params, xs, ys))


def _train_placed(tx, p, xs, ys, rows):
    """``p`` (placed) after the DP step on each batch, its rows placed ``rows``;
    the state built in ``state_shardings``. Under the caller's mesh."""
    state = jax.jit(tx.init, out_shardings=optax_accum.state_shardings(tx, p))(p)

    @jax.jit
    def step(p, s, x, y):
        u, s = tx.update(_vg(p, x, y)[1], s, p)
        return optax.apply_updates(p, u), s

    for x, y in zip(xs, ys, strict=True):
        p, state = step(p, state, jax.device_put(x, rows), jax.device_put(y, rows))
    return p


def test_fsdp_and_data_parallel_on_a_2d_mesh_equal_one_device():
    # The batch over "data", the weight matrix over "model" (a scalar
    # parameter too, whose per-example gradients are sharded like the rows).
    params, x, y = data(rows=32, dim=8, scale=2.0)
    xs, ys = np.split(x, 2), np.split(y, 2)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    tx = _tx()
    with jax.set_mesh(mesh):
        p = jax.device_put(
            params,
            {"w": NamedSharding(mesh, P("model")), "b": NamedSharding(mesh, P())},
        )
        p = _train_placed(tx, p, xs, ys, NamedSharding(mesh, P("data")))
    assert p["w"].sharding.spec == P("model")
    _close(p, _one_device(params, xs, ys))


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_fsdp_over_the_batch_axis_equals_one_device(axis_type):
    """ZeRO-3: the weights and the batch's rows sharded over the same axis.
    On an Explicit mesh the per-example vmap refused the sharded unmapped
    parameters ("Unmapped values passed to vmap cannot be sharded along the
    mesh axis you are vmapping over"); they are gathered per micro-batch."""
    params, x, y = data(rows=32, dim=8, scale=2.0)
    xs, ys = np.split(x, 2), np.split(y, 2)
    mesh = jax.make_mesh((N,), ("d",), axis_types=(getattr(AxisType, axis_type),))
    tx = _tx()
    with jax.set_mesh(mesh):
        fsdp = {"w": NamedSharding(mesh, P("d")), "b": NamedSharding(mesh, P())}
        rows = NamedSharding(mesh, P("d"))
        p = _train_placed(tx, jax.device_put(params, fsdp), xs, ys, rows)
    if axis_type == "Explicit":
        assert p["w"].sharding.spec == P("d")
    _close(p, _one_device(params, xs, ys))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("data_devices", [1, 2])
def test_tensor_parallel_clip_takes_the_whole_gradients_norm(data_devices, bias):
    # Issue 39, finding 3: inside shard_map, with w split over a model axis,
    # each device clipped its shard by the shard's own norm. The norm is over
    # the whole per-example gradient: the shards' squares summed over "model".
    model, dim, rows = 4, 8, 8
    params, x, y = data(rows=rows, dim=dim, scale=2.0)
    if not bias:
        params = {**params, "b": np.float32(0.0)}
    mesh = jax.make_mesh((data_devices, model), ("data", "model"))
    shard = dim // model

    def loss_tp(p, x, y):  # w's shard; the forward sums the shards' products
        i = jax.lax.axis_index("model")
        cols = jax.lax.dynamic_slice_in_dim(x, i * shard, shard, axis=1)
        r = jax.lax.psum(cols @ p["w"], "model") - y
        r = r + p["b"] if bias else r
        return 0.5 * jnp.mean(r**2)

    vg = privacy.clipped_value_and_grad(loss_tp, C, 2, batch_argnums=(1, 2))
    specs = {"w": P("model"), "b": P()} if bias else {"w": P("model")}
    if not bias:
        params = {"w": params["w"]}
    f = jax.jit(
        jax.shard_map(
            lambda p, x, y: jax.lax.psum(vg(p, x, y)[1], "data"), mesh=mesh,
            in_specs=(specs, P("data"), P("data")), out_specs=specs,
        )
    )  # fmt: skip
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    placed = {n: put(params[n], specs[n]) for n in params}
    grads = f(placed, put(x, P("data")), put(y, P("data")))
    gw, gb, _ = reference_per_example({"b": 0.0, **params}, x, y)
    norms = np.hypot(np.linalg.norm(gw, axis=1), gb if bias else 0.0)
    assert (norms > C).sum() >= rows // 2  # the clip is active
    scale = np.minimum(1.0, C / norms)
    ref = {"w": np.sum(gw * scale[:, None], axis=0)}
    if bias:
        ref["b"] = np.sum(gb * scale)
    for a, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6)


def test_tensor_parallel_noise_is_drawn_per_model_shard_and_shared_over_data():
    """Inside ``shard_map`` with ``w`` split over ``model``, each model shard
    draws its own noise (one key for all repeated the noise in every shard, so
    the difference of two shards' updates carried none), and the data
    replicas draw the same (the window's sum is reduced over ``data``)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    dim = 4 * 2048
    tx = privacy.dp_accumulate(
        optax.sgd(-1.0), K, l2_clip_norm=C, noise_multiplier=SIGMA,
        expected_batch_size=B, key=jax.random.key(11), axis_name="data",
    )  # fmt: skip

    def step(w):
        s = tx.init({"w": w})
        for _ in range(K):  # one window
            u, s = tx.update({"w": jnp.zeros_like(w)}, s, {"w": w})
        return u["w"][None]

    run = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=P("model"), out_specs=P("data", "model"),
    ))  # fmt: skip
    u = np.asarray(run(jax.device_put(jnp.zeros(dim), NamedSharding(mesh, P("model")))))
    np.testing.assert_array_equal(u[0], u[1])  # the data replicas agree
    shards = u[0].reshape(4, -1)
    for i in range(1, 4):
        assert not np.allclose(shards[0], shards[i])
        # independent shards: their difference has twice the variance
        assert np.std(shards[0] - shards[i]) == pytest.approx(
            np.sqrt(2) * SIGMA * C / B, rel=0.06
        )
    assert np.std(u[0]) == pytest.approx(SIGMA * C / B, rel=0.05)
