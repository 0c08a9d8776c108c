# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""dtypes under `accumulate`: the accumulator promotes, never demotes.

The parameter x gradient dtype matrix (float32, float16, bfloat16) accumulates
in float32 and returns updates in the gradient's dtype; state dtypes are stable
under ``lax.scan``; ``accumulator_dtype=None`` keeps the gradient's dtype.
Complex gradients keep their imaginary part and float64 stays float64, checked
on optax's own aliases wrapped with k = 1.
"""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from tests.helpers.lanes import sweep
from tests.helpers.models import mlp_loss, mlp_params, regression_data

_DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]


@pytest.mark.parametrize(
    ("grad_dtype", "param_dtype"),
    sweep(
        itertools.product(_DTYPES, _DTYPES),
        fast=[(jnp.bfloat16, jnp.float16)],
    ),
)
def test_dtype_matrix(grad_dtype, param_dtype):
    k = 4
    inner = optax.adam(1e-2)
    tx = optax_accum.accumulate(inner, k)
    params = jax.tree.map(lambda p: p.astype(param_dtype), mlp_params())
    x, y = regression_data(4 * k)
    inner_state, state = inner.init(params), tx.init(params)
    grads_list = []
    for i in range(k):
        g = jax.grad(mlp_loss)(
            params,
            x[4 * i : 4 * i + 4].astype(param_dtype),
            y[4 * i : 4 * i + 4].astype(param_dtype),
        )
        g = jax.tree.map(lambda a: a.astype(grad_dtype), g)
        grads_list.append(g)
        u, state = jax.jit(tx.update)(g, state, params)
        for a in jax.tree.leaves(state.accumulator):
            assert a.dtype == jnp.float32
    ref_u, _ = inner.update(grads_list[0], inner_state, params)
    chex.assert_trees_all_equal_dtypes(u, ref_u)
    # The mean, accumulated in fp32, then passed through Adam in grad_dtype.
    mean = jax.tree.map(
        lambda *gs: (sum(g.astype(jnp.float32) for g in gs) / k).astype(grad_dtype),
        *grads_list,
    )
    expected, _ = inner.update(mean, inner_state, params)
    tol = {jnp.float32: 1e-5, jnp.float16: 2e-3, jnp.bfloat16: 2e-2}[grad_dtype]
    chex.assert_trees_all_close(
        jax.tree.map(lambda a: a.astype(jnp.float32), u),
        jax.tree.map(lambda a: a.astype(jnp.float32), expected),
        rtol=tol,
        atol=tol * 1e-2,
    )
    new_params = optax.apply_updates(params, u)
    chex.assert_trees_all_equal_dtypes(new_params, params)


def test_state_dtypes_are_stable_under_scan():
    tx = optax_accum.accumulate(optax.adam(1e-3), 2)
    params = {"a": jnp.zeros([3], jnp.bfloat16)}

    def body(state, _):
        _, state = tx.update(
            {"a": jnp.ones([3], jnp.bfloat16)}, state, params, weight=2
        )
        return state, None

    state, _ = jax.lax.scan(body, tx.init(params), jnp.arange(5))
    assert state.accumulator["a"].dtype == jnp.float32
    assert int(state.update_step) == 2


def test_accumulator_dtype_none_keeps_the_gradient_dtype():
    tx = optax_accum.accumulate(optax.sgd(1.0), 2, accumulator_dtype=None)
    state = tx.init({"a": jnp.zeros(2, jnp.bfloat16)})
    assert state.accumulator["a"].dtype == jnp.bfloat16


def test_complex_gradients_keep_their_imaginary_part():
    params = {"z": jnp.array([1 + 2j, -1j], jnp.complex64)}
    grads = {"z": jnp.array([0.5 - 1j, 2 + 3j], jnp.complex64)}
    tx, ref = optax_accum.accumulate(optax.adam(0.1), 1), optax.adam(0.1)
    u, _ = tx.update(grads, tx.init(params), params)
    ref_u, _ = ref.update(grads, ref.init(params), params)
    chex.assert_trees_all_close(u, ref_u, rtol=1e-6)
    assert tx.init(params).accumulator["z"].dtype == jnp.complex64


def test_float64_gradients_accumulate_in_float64():
    with jax.enable_x64(True):
        params = {"a": jnp.array([1.0, 2.0], jnp.float64)}
        tx = optax_accum.accumulate(optax.sgd(1.0), 2)
        state = tx.init(params)
        assert state.accumulator["a"].dtype == jnp.float64
        g1, g2 = 1.0 + 1e-12, 1.0 - 3e-12
        _, state = tx.update({"a": jnp.full(2, g1)}, state, params)
        u, _ = tx.update({"a": jnp.full(2, g2)}, state, params)
        np.testing.assert_array_equal(u["a"], -(g1 + g2) / 2)


def test_explicit_complex_accumulator_is_accepted_and_real_one_refused():
    params = {"z": jnp.zeros(2, jnp.complex64)}
    tx = optax_accum.accumulate(optax.sgd(1.0), 2, accumulator_dtype=jnp.complex128)
    with jax.enable_x64(True):
        assert tx.init(params).accumulator["z"].dtype == jnp.complex128
    tx = optax_accum.accumulate(optax.sgd(1.0), 2, accumulator_dtype=jnp.float32)
    with pytest.raises(TypeError, match="would drop the imaginary part"):
        tx.init(params)


# optax's alias tests, wrapped ------------------------------------------------

# A fast subset of optax's `alias_test._OPTIMIZERS_UNDER_TEST` (40 complex and
# 66 float64 cases in all).
_ALIAS_SUBSET = [
    ("adam", {"learning_rate": 1e-1}, True),
    ("adafactor", {"learning_rate": 5e-3}, True),
    ("lamb", {"learning_rate": 1e-3}, True),
    ("lars", {"learning_rate": 1.0}, True),
    ("rmsprop", {"learning_rate": 5e-3, "momentum": 0.9}, True),
    ("noisy_sgd", {"learning_rate": 1e-3, "eta": 1e-4, "key": 0}, False),
    ("polyak_sgd", {"max_learning_rate": 1.0}, False),
]


def _parabola_run(tx, dtype, steps=10):
    params = jnp.array([-1.0, 10.0, 1.0], dtype)
    target = jnp.array([1.0, -1.0, 1.0], dtype)
    if jnp.iscomplexobj(params):
        target = target * (1 + 1j)
    objective = lambda p: jnp.sum(jnp.abs(p - target) ** 2)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        value, grad = jax.value_and_grad(objective)(params)
        updates, state = tx.update(jnp.conj(grad), state, params, value=value)
        return optax.apply_updates(params, updates), state

    for _ in range(steps):
        params, state = step(params, state)
    return params


@pytest.mark.parametrize(
    ("name", "kwargs", "complex_ok", "dtype"),
    sweep(
        [
            (*case, dtype)
            for case in _ALIAS_SUBSET
            for dtype in ("complex64", "float64")
        ],
        fast=[(*_ALIAS_SUBSET[0], "complex64"), (*_ALIAS_SUBSET[0], "float64")],
    ),
)
def test_alias_optimizers_wrapped_with_k_1(name, kwargs, complex_ok, dtype):
    if dtype == "complex64" and not complex_ok:
        pytest.skip(f"optax's {name} does not support complex parameters")
    with jax.enable_x64(dtype == "float64"):
        make = lambda: getattr(optax, name)(**kwargs)
        ours = _parabola_run(optax_accum.accumulate(make(), 1), jnp.dtype(dtype))
        ref = _parabola_run(make(), jnp.dtype(dtype))
        assert ours.dtype == ref.dtype
        # Dropping the imaginary part gives errors of 0.1 to 1, and rounding
        # float64 through float32 errors of 1e-10 to 1e-6: both fail here.
        np.testing.assert_allclose(
            ours, ref, rtol=1e-6 if dtype == "complex64" else 1e-10
        )
