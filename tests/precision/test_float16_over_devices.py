# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""A float16 accumulator never overflows in the reduction over devices where
the mean fits, on either face (`accumulate` and `microbatch` share it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum


def _mesh(n):
    return jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])


def test_accumulate_weighted_mean_over_devices_does_not_overflow():
    # Each device's weighted term, 256 * 300, is over float16's 65504.
    mesh = _mesh(2)
    tx = optax_accum.accumulate(
        optax.sgd(1.0), 2, accumulator_dtype=jnp.float16, axis_name="d"
    )
    params = {"w": jnp.zeros(())}
    specs = optax_accum.state_specs(jax.eval_shape(tx.init, params), "d")
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def step(p, s, g, w):
        u, s = tx.update({"w": g[0]}, s, p, weight=w[0])
        return u["w"][None], s

    sm = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), specs, P("d"), P("d")),
            out_specs=(P("d"), specs),
        )
    )
    shard = NamedSharding(mesh, P("d"))
    put = lambda a: jax.device_put(jnp.asarray(a, jnp.float32), shard)
    state = init(params)
    # The case: gradients of 300 with weight 512, on both devices.
    for _ in range(2):
        u, state = sm(params, state, put([300.0, 300.0]), put([512.0, 512.0]))
    np.testing.assert_array_equal(np.asarray(u), [-300.0, -300.0])
    # Unequal weights: device 1 sees 300 (weight 512), then 100 (weight 1536).
    for g1, w1 in ((300.0, 512.0), (100.0, 1536.0)):
        u, state = sm(params, state, put([300.0, g1]), put([512.0, w1]))
    expected = (3 * 512 * 300 + 1536 * 100) / (3 * 512 + 1536)
    np.testing.assert_allclose(np.asarray(u), [-expected] * 2, rtol=1e-3)
    assert state.accumulator["w"].dtype == jnp.float16


def test_microbatch_running_mean_over_devices_does_not_overflow():
    mesh = _mesh(2)

    def fun(w, x):
        return jax.value_and_grad(lambda w: jnp.mean(x * w))(w)

    mb = optax_accum.microbatch(fun, 8, accumulator_dtype=jnp.float16, axis_name="d")
    sm = jax.jit(
        jax.shard_map(
            lambda w, x: mb(w, x)[1][None],
            mesh=mesh,
            in_specs=(P(), P("d")),
            out_specs=P("d"),
        )
    )
    x = np.full((32,), 1e4, np.float16)
    x[:16] = 3e4  # device means 3e4 and 1e4: their sum, 4e4 * 8, overflows
    x = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("d")))
    g = np.asarray(sm(jnp.float16(1.0), x), np.float32)
    np.testing.assert_allclose(g, [2e4, 2e4], rtol=1e-3)
