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
