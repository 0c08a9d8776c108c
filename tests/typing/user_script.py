# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""A typed user script that calls every face with keywords (issue 33, §5).

``tests/test_typing.py`` runs mypy on it (no error), and on a copy with a
misspelt keyword (an error naming it). It also runs, as a smoke test of the
calls it type-checks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training import train_state

import optax_accum
from optax_accum.flax import linen_train_step, nnx_train_step


def loss(params: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((x @ params - y) ** 2)


def count(x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.float32(x.shape[0])


def main() -> None:
    params = jnp.zeros((2, 1))
    x, y = jnp.ones((8, 2)), jnp.ones((8, 1))

    # The fused faces: every keyword is visible to the checker.
    fun = optax_accum.microbatch(
        jax.value_and_grad(loss),
        4,
        batch_argnums=(1, 2),
        has_aux=False,
        reduction="mean",
        weight_fn=count,
        accumulator_dtype="promote",
        rng_argnums=(),
        noise_scale_decay=None,
    )
    value, grads = fun(params, x, y)
    assert jnp.ndim(value) == 0
    vg = optax_accum.microbatch_value_and_grad(
        loss, 4, argnums=0, batch_argnums=(1, 2), reduction="sum"
    )
    _, grads = vg(params, x, y)

    # The optimizer faces.
    tx = optax_accum.accumulate(
        optax.adam(1e-3), 2, reduction="mean", skip_fn=optax_accum.skip_not_finite
    )
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    ms = optax_accum.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    ms_state = ms.from_optax(optax.MultiSteps(optax.sgd(0.1), 2).init(params), params)
    _, ms_state = ms.update(grads, ms_state, params)
    bool(optax_accum.has_updated(ms_state))

    # The Flax steps.
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def nnx_loss(m: nnx.Linear, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((m(x) - y) ** 2)

    step = nnx_train_step(nnx_loss, 2, reduction="mean", accumulator_dtype=None)
    step(model, optimizer, x, y)

    def linen_loss(
        p: dict[str, jax.Array], rng: jax.Array | None, x: jax.Array, y: jax.Array
    ) -> jax.Array:
        return loss(p["w"], x, y)

    ts = train_state.TrainState.create(
        apply_fn=lambda *a: None, params={"w": params}, tx=optax.sgd(0.1)
    )
    lstep = linen_train_step(linen_loss, 2, reduction="mean", weight_fn=count)
    ts, _ = lstep(ts, x, y)


if __name__ == "__main__":
    main()
