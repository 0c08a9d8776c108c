# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`linen_train_step` updates through the state's own ``apply_gradients``.

Issue 23, the Flax steps' contracts, item 2: a TrainState subclass that
overrides ``apply_gradients`` (an EMA of the parameters) keeps it on every
path: plain, with optimizer keyword arguments, and with an optimizer that
reads ``value`` (``reduce_on_plateau``). The reference is a hand-written
full-batch step.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax.training import train_state  # noqa: E402

from optax_accum.flax import linen_train_step  # noqa: E402

K, STEPS = 4, 4


class EmaState(train_state.TrainState):
    """Keeps an exponential moving average of the parameters."""

    ema: Any

    def apply_gradients(self, *, grads, **kwargs):
        new = super().apply_gradients(grads=grads, **kwargs)
        ema = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * p, self.ema, new.params)
        return new.replace(ema=ema)


def _net():
    return nn.Dense(1)


def _loss(params, rng, x, y):
    del rng
    return jnp.mean((_net().apply({"params": params}, x) - y) ** 2)


def _data():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(16, 1)) * 3, jnp.float32)
    return x, y


def _plateau():
    return optax.chain(
        optax.sgd(0.3),
        optax.contrib.reduce_on_plateau(factor=0.5, patience=0, accumulation_size=1),
    )


def _state(tx):
    params = _net().init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    return EmaState.create(apply_fn=None, params=params, tx=tx, ema=params)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["plain", "reads_value", "explicit_value"])
def test_linen_train_step_calls_the_states_apply_gradients(case):
    x, y = _data()
    make = (lambda: optax.adam(0.1)) if case == "plain" else _plateau
    state, ref = _state(make()), _state(make())
    tx = state.tx
    step = jax.jit(linen_train_step(_loss, K))
    for _ in range(STEPS):
        value, grads = jax.value_and_grad(_loss)(ref.params, None, x, y)
        kwargs = {} if case == "plain" else {"value": value}
        state, loss = step(state, x, y, **(kwargs if case == "explicit_value" else {}))
        updates, opt_state = ref.tx.update(grads, ref.opt_state, ref.params, **kwargs)
        params = optax.apply_updates(ref.params, updates)
        ema = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * p, ref.ema, params)
        ref = ref.replace(
            step=ref.step + 1, params=params, opt_state=opt_state, ema=ema
        )
        np.testing.assert_allclose(loss, value, rtol=1e-5)
    chex.assert_trees_all_close(
        (state.params, state.ema), (ref.params, ref.ema), rtol=1e-5, atol=1e-6
    )
    assert int(state.step) == STEPS and state.tx is tx
    assert type(state) is EmaState
