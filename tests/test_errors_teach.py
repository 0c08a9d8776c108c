# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Errors a newcomer hit, and what they now say (issue 33, §3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_accum


def _loss(p, x, y):
    return jnp.mean((x @ p - y) ** 2)


@pytest.mark.parametrize("face", ["microbatch", "microbatch_value_and_grad"])
def test_a_batch_in_two_arguments_gets_a_note_naming_batch_argnums(face):
    # `loss(params, x, y)` with the default batch_argnums=1 split only x:
    # "sub got incompatible shapes for broadcasting: (8, 2), (32, 2)".
    f = (
        optax_accum.microbatch(jax.value_and_grad(_loss), 4)
        if face == "microbatch"
        else optax_accum.microbatch_value_and_grad(_loss, 4)
    )
    x, y = jnp.ones((32, 2)), jnp.ones((32, 2))
    with pytest.raises(TypeError, match="incompatible shapes") as info:
        f(jnp.zeros((2, 2)), x, y)
    (note,) = [n for n in info.value.__notes__ if "optax_accum" in n]
    assert "`batch_argnums`=(1,)" in note
    assert "argument 2, of shape (32, 2)," in note
    assert "pass `batch_argnums=(1, 2)`" in note
    # With both split, it runs and is the full batch's.
    g = optax_accum.microbatch(jax.value_and_grad(_loss), 4, batch_argnums=(1, 2))
    p = jnp.full((2, 2), 0.5)
    ref = jax.value_and_grad(_loss)(p, x, y)
    got = g(p, x, y)
    assert jnp.allclose(got[0], ref[0]) and jnp.allclose(got[1], ref[1])


def test_no_note_where_no_other_argument_has_the_batch_size():
    def bad(p, x):
        raise RuntimeError("boom")

    f = optax_accum.microbatch(bad, 4)
    with pytest.raises(RuntimeError, match="boom") as info:
        f(jnp.zeros((2, 2)), jnp.ones((32, 2)))
    assert not any("optax_accum" in n for n in getattr(info.value, "__notes__", []))


@pytest.mark.parametrize("face", ["MultiSteps", "accumulate"])
def test_swapped_state_and_params_name_state(face):
    # Issue 33, §3: `update(grads, params, state)` raised AttributeError:
    # 'dict' object has no attribute 'micro_step'.
    tx = (
        optax_accum.MultiSteps(optax.sgd(1.0), 2)
        if face == "MultiSteps"
        else optax_accum.accumulate(optax.sgd(1.0), 2)
    )
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    with pytest.raises(TypeError, match=r"`state`.*swapped"):
        tx.update(params, params, state)


def test_a_wrong_grads_shape_names_the_leaf():
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    params = {"a": jnp.zeros(3), "w": jnp.zeros((4, 2))}
    state = tx.init(params)
    grads = {"a": jnp.zeros(3), "w": jnp.zeros((2, 4))}
    with pytest.raises(
        ValueError,
        match=r"got \(2, 4\), expected \(4, 2\) at `grads\['w'\]`",
    ):
        tx.update(grads, state, params)


@pytest.mark.parametrize(
    "schedule",
    [optax.cosine_decay_schedule(1e-3, 100), lambda count: 0.1],
    ids=["optax_schedule", "lambda"],
)
def test_a_schedule_as_inner_says_it_belongs_in_the_optimizer(schedule):
    """Issue 41: a learning-rate schedule passed as ``inner`` was told to be
    called like an optimizer's factory."""
    for make in (optax_accum.accumulate, optax_accum.MultiSteps):
        with pytest.raises(TypeError, match=r"is a schedule") as info:
            make(schedule, 4)
        assert "optax.adamw(learning_rate=" in str(info.value)
        assert "call it" not in str(info.value)
    with pytest.raises(TypeError, match=r"is the function `adamw`.*call it"):
        optax_accum.accumulate(optax.adamw, 4)


def test_batch_argnums_naming_the_parameters_says_so():
    """Issue 41: ``batch_argnums`` including the parameters' position got only
    "batch argument 0 has a scalar leaf at ['b']"."""
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    x, y = jnp.ones((8, 3)), jnp.ones(8)

    def loss(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    grad_fn = jax.value_and_grad(loss)
    run = optax_accum.microbatch(grad_fn, 2, batch_argnums=(0, 1, 2))
    with pytest.raises(ValueError, match=r"scalar leaf at \['b'\]") as info:
        run(params, x, y)
    assert "`batch_argnums` probably includes it by mistake" in str(info.value)
    # A real batch argument with a scalar leaf gets no such hint.
    run = optax_accum.microbatch(grad_fn, 2, batch_argnums=(1, 2))
    with pytest.raises(ValueError, match="scalar leaf") as info:
        run(params, x, jnp.float32(1.0))
    assert "by mistake" not in str(info.value)
