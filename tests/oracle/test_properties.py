# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Hypothesis: `accumulate` against a plain-numpy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_accum

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


@st.composite
def cases(draw):
    k = draw(st.integers(1, 5))
    windows = draw(st.integers(1, 3))
    shapes = draw(
        st.lists(
            st.lists(st.integers(1, 4), min_size=0, max_size=3), min_size=1, max_size=3
        )
    )
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    reduction = draw(st.sampled_from(["mean", "sum"]))
    weighted = draw(st.booleans())
    weights = [
        draw(st.floats(0.1, 10.0)) if weighted else 1.0 for _ in range(k * windows)
    ]
    seed = draw(st.integers(0, 2**16))
    return (
        k,
        windows,
        [tuple(s) for s in shapes],
        dtype,
        reduction,
        weighted,
        weights,
        seed,
    )


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(cases())
def test_matches_numpy_reference(case):
    k, windows, shapes, dtype, reduction, weighted, weights, seed = case
    rng = np.random.default_rng(seed)
    params = [jnp.zeros(s, DTYPES[dtype]) for s in shapes]
    tx = optax_accum.accumulate(optax.identity(), k, reduction=reduction)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for w in range(windows):
        grads = [
            [rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(k)
        ]
        # Round to the input dtype first: the reference sees what we see.
        grads = [
            [np.asarray(jnp.asarray(g, DTYPES[dtype]), np.float64) for g in gs]
            for gs in grads
        ]
        ws = weights[w * k : (w + 1) * k]
        for i in range(k):
            g = [jnp.asarray(a, DTYPES[dtype]) for a in grads[i]]
            u, state = update(g, state, params, weight=ws[i] if weighted else None)
            if i < k - 1:
                for leaf in u:
                    np.testing.assert_array_equal(np.asarray(leaf, np.float32), 0)
        for j in range(len(shapes)):
            total = sum(ws[i] * grads[i][j] for i in range(k))
            expected = total / sum(ws) if reduction == "mean" else total
            assert u[j].dtype == DTYPES[dtype]
            np.testing.assert_allclose(
                np.asarray(u[j], np.float64),
                expected,
                rtol=TOL[dtype],
                atol=TOL[dtype] * max(1.0, np.max(np.abs(expected), initial=0.0)),
            )
        assert int(state.update_step) == w + 1
