# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Micro-batch weights that are NaN, infinite or negative.

A traced bad weight cannot raise: it rejects its micro-batch, which counts as
skipped and leaves the window as if never seen. A constant one raises.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -1.0])
def test_bad_traced_weight_rejects_the_micro_batch(bad):
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    update = jax.jit(tx.update)
    params = {"a": jnp.zeros([])}
    state = tx.init(params)
    u, state = update({"a": jnp.float32(1.0)}, state, params, weight=1.0)
    u, state = update({"a": jnp.float32(5.0)}, state, params, weight=bad)
    assert float(u["a"]) == 0.0 and not optax_accum.has_updated(state)
    u, state = update({"a": jnp.float32(3.0)}, state, params, weight=1.0)
    assert float(u["a"]) == -2.0  # the mean of 1 and 3
    assert int(state.num_skipped) == 1


@pytest.mark.parametrize("bad", [float("nan"), -2.0, np.float32(np.inf)])
def test_constant_bad_weight_raises(bad):
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    params = {"a": jnp.zeros([])}
    with pytest.raises(ValueError, match="`weight` must be finite and >= 0"):
        tx.update({"a": jnp.float32(1.0)}, tx.init(params), params, weight=bad)


@pytest.mark.parametrize("bad", [-1.0, np.nan, 1e39, 1e-40])
def test_concrete_jax_array_bad_weight_raises_like_a_constant(bad):
    # Eagerly, a jax.Array's value is known: it raises as the Python value
    # does (jnp.float32(1e39) is inf). Under jit it is traced and rejected.
    with np.errstate(over="ignore"):
        bad = jnp.float32(bad)
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    params = {"a": jnp.zeros([])}
    state = tx.init(params)
    with pytest.raises(ValueError, match="`weight`"):
        tx.update({"a": jnp.float32(1.0)}, state, params, weight=bad)
    _, state = jax.jit(tx.update)({"a": jnp.float32(1.0)}, state, params, weight=bad)
    # A traced subnormal weight is flushed to 0: weight 0, not a rejection.
    assert int(state.num_skipped) == (0 if 0 < float(bad) < 1e-38 else 1)


def test_concrete_float64_weight_that_overflows_float32_raises():
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    params = {"a": jnp.zeros([])}
    with jax.enable_x64(True):
        state = tx.init(params)
        with pytest.raises(ValueError, match="overflows float32"):
            tx.update(params, state, params, weight=jnp.asarray(1e39, jnp.float64))
