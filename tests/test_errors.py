# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Bad input raises a clear error naming the argument and the value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_accum

PARAMS = {"a": jnp.zeros(3), "b": jnp.zeros([])}
GRADS = {"a": jnp.ones(3), "b": jnp.ones([])}


@pytest.mark.parametrize(
    ("every_k", "error", "match"),
    [
        (0, ValueError, "`every_k` must be >= 1, got 0"),
        (-2, ValueError, "`every_k` must be >= 1, got -2"),
        (2.5, TypeError, "`every_k` must be an integer, got 2.5"),
        ("3", TypeError, "`every_k` must be an integer, got '3'"),
        (True, TypeError, "`every_k` must be an integer, got True"),
        (None, TypeError, "`every_k` must be an integer, got None"),
    ],
)
def test_every_k(every_k, error, match):
    with pytest.raises(error, match=match):
        optax_accum.accumulate(optax.sgd(1.0), every_k)
    with pytest.raises(error, match=match.replace("every_k", "every_k_schedule")):
        optax_accum.MultiSteps(optax.sgd(1.0), every_k)


@pytest.mark.parametrize(
    ("schedule", "error", "match"),
    [
        (lambda step: 0, ValueError, r"`every_k\(step\)` must be >= 1, got 0"),
        (
            lambda step: 2.0,
            TypeError,
            r"`every_k\(step\)` must return an integer",
        ),
        (
            lambda step: jnp.float32(2),
            TypeError,
            "must return an integer, got dtype float32",
        ),
        (
            lambda step: jnp.ones(2, jnp.int32),
            ValueError,
            r"must return a scalar, got shape \(2,\)",
        ),
    ],
)
def test_every_k_schedule_values(schedule, error, match):
    tx = optax_accum.accumulate(optax.sgd(1.0), schedule)
    with pytest.raises(error, match=match):
        tx.update(GRADS, tx.init(PARAMS), PARAMS)


def test_reduction():
    with pytest.raises(
        ValueError, match=r"`reduction` must be one of \('mean', 'sum'\), got 'avg'"
    ):
        optax_accum.accumulate(optax.sgd(1.0), 2, reduction="avg")


@pytest.mark.parametrize("dtype", [jnp.int32, "bool", "not-a-dtype", object])
def test_accumulator_dtype(dtype):
    with pytest.raises(TypeError, match="`accumulator_dtype` must be a floating dtype"):
        optax_accum.accumulate(optax.sgd(1.0), 2, accumulator_dtype=dtype)
    with pytest.raises(TypeError, match="`accumulator_dtype` must be a floating dtype"):
        optax_accum.MultiSteps(optax.sgd(1.0), 2, accumulator_dtype=dtype)


def test_gradient_tree_mismatch():
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match="`grads` must have the tree structure"):
        tx.update({"a": jnp.ones(3)}, state, PARAMS)
    with pytest.raises(
        ValueError, match=r"`grads` leaf shapes must match.*got \(4,\), expected \(3,\)"
    ):
        tx.update({"a": jnp.ones(4), "b": jnp.ones([])}, state, PARAMS)
    with pytest.raises(ValueError, match="`grads` must have the tree structure"):
        jax.jit(tx.update)([jnp.ones(3), jnp.ones([])], state, PARAMS)


@pytest.mark.parametrize("weight", [jnp.ones(2), [1.0, 2.0], jnp.ones((1, 1))])
def test_non_scalar_weight(weight):
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    with pytest.raises(ValueError, match="`weight` must be a scalar, got shape"):
        tx.update(GRADS, tx.init(PARAMS), PARAMS, weight=weight)


def test_non_numeric_weight():
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    with pytest.raises(
        TypeError, match="`weight` must be a real number, got dtype bool"
    ):
        tx.update(GRADS, tx.init(PARAMS), PARAMS, weight=jnp.bool_(True))


@pytest.mark.parametrize(
    "skip_fn",
    [
        lambda g, s, p: jnp.float32(0.0),
        lambda g, s, p: jnp.zeros(2, jnp.bool_),
        lambda g, s, p: (jnp.int32(0), {}),
        lambda g, s, p: False,
    ],
)
def test_skip_fn_must_return_a_boolean_scalar(skip_fn):
    with pytest.raises(TypeError, match="`skip_fn` must return a boolean scalar"):
        optax_accum.accumulate(optax.sgd(1.0), 2, skip_fn=skip_fn).init(PARAMS)
    ms = optax_accum.MultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=skip_fn)
    with pytest.raises(
        TypeError, match="`should_skip_update_fn` must return a boolean scalar"
    ):
        ms.init(PARAMS)


@pytest.mark.parametrize("max_norm", [0.0, -1.0, [1.0, 2.0]])
def test_skip_large_updates_max_norm(max_norm):
    with pytest.raises(ValueError, match="`max_norm` must be a positive scalar"):
        optax_accum.skip_large_updates(max_norm)


def test_has_updated_needs_exactly_one_accumulate_state():
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    with pytest.raises(ValueError, match="found 0"):
        optax_accum.has_updated(optax.sgd(1.0).init(PARAMS))
    with pytest.raises(ValueError, match="found 2"):
        optax_accum.has_updated((tx.init(PARAMS), tx.init(PARAMS)))


def test_weight_string_and_close_window_shape_name_the_argument():
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    params = {"a": jnp.zeros([])}
    state = tx.init(params)
    with pytest.raises(TypeError, match="`weight` must be a real number, got '3'"):
        tx.update(params, state, params, weight="3")
    with pytest.raises(ValueError, match=r"`close_window` must be a boolean scalar"):
        tx.update(params, state, params, close_window=jnp.array([True]))
    with pytest.raises(TypeError, match=r"`close_window` must be a boolean scalar"):
        tx.update(params, state, params, close_window=1.0)


def test_uncalled_skip_large_updates_says_call_it():
    for make in (
        lambda f: optax_accum.accumulate(optax.sgd(1.0), 2, skip_fn=f),
        lambda f: optax_accum.MultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=f),
    ):
        with pytest.raises(TypeError, match=r"call it: skip_large_updates\(max_norm\)"):
            make(optax_accum.skip_large_updates)
    with pytest.raises(TypeError, match=r"`skip_fn` must take \(grads, step, params\)"):
        optax_accum.accumulate(optax.sgd(1.0), 2, skip_fn=lambda g: g)


@pytest.mark.parametrize(
    "skip_fn", [optax_accum.skip_not_finite, optax_accum.skip_large_updates(1.0)]
)
def test_skip_fn_with_data_axes_is_refused_naming_both(skip_fn):
    # The skip function would read unreduced partial sums (JAX has no rule
    # for is_finite or square on them): refused where it is given.
    with pytest.raises(ValueError, match=r"`skip_fn`.*`data_axes`.*one or the other"):
        optax_accum.accumulate(optax.sgd(1.0), 2, data_axes="data", skip_fn=skip_fn)


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax_accum.accumulate(optax.adam, 4),
        lambda: optax_accum.MultiSteps(optax.adam, 4),
    ],
)
def test_an_uncalled_optimizer_factory_is_refused_by_name(make):
    with pytest.raises(TypeError, match=r"is the function `adam`.*call it"):
        make()


# Issue 27: the edges a newcomer hit, each named in the error.


def _faces(weight_fn):
    """Each face that takes a ``weight_fn``, run once on a tiny problem."""
    from flax import nnx

    from optax_accum.flax import nnx_train_step

    def loss(p, x):
        return jnp.mean((x @ p) ** 2)

    p, x = jnp.ones(3), jnp.ones((4, 3))
    vg = jax.value_and_grad(loss)
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = nnx_train_step(lambda m, x: jnp.mean(m(x) ** 2), 2, weight_fn=weight_fn)
    return {
        "microbatch": lambda: optax_accum.microbatch(vg, 2, weight_fn=weight_fn)(p, x),
        "jit(microbatch)": lambda: jax.jit(
            optax_accum.microbatch(vg, 2, weight_fn=weight_fn)
        )(p, x),
        "microbatch_value_and_grad": lambda: optax_accum.microbatch_value_and_grad(
            loss, 2, weight_fn=weight_fn
        )(p, x),
        "nnx_train_step": lambda: step(model, optimizer, x),
    }


@pytest.mark.parametrize(
    ("weight", "shown"),
    [
        ("many", "'many' of type str"),
        (1 + 2j, r"\(1\+2j\) of type complex"),  # a cast would drop 2j
        (jnp.complex64(3 + 1j), "a complex64 array"),
        (None, "None of type NoneType"),
    ],
    ids=["str", "complex", "complex64", "None"],
)
def test_weight_fn_returning_a_non_real_names_weight_fn(weight, shown):
    match = rf"`weight_fn` must return a real scalar .*got {shown}"
    for run in _faces(lambda *batch: weight).values():
        with pytest.raises(TypeError, match=match):
            run()


def test_accumulate_refuses_a_complex_weight_by_name():
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    state = tx.init(PARAMS)
    for weight in (1 + 1j, jnp.complex64(2 + 0j)):
        with pytest.raises(TypeError, match="`weight` must be a real number"):
            tx.update(GRADS, state, PARAMS, weight=weight)


def test_nnx_train_step_with_swapped_arguments_says_so():
    from flax import nnx

    from optax_accum.flax import nnx_train_step

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = nnx_train_step(lambda m, x: jnp.mean(m(x) ** 2), 2)
    x = jnp.ones((4, 3))
    with pytest.raises(
        TypeError,
        match=r"`model` = an nnx\.Optimizer and `optimizer` = Linear: the two "
        "are swapped",
    ):
        step(optimizer, model, x)
    with pytest.raises(TypeError, match=r"`optimizer` = Linear, not an nnx\.Optimizer"):
        step(model, model, x)
    assert jnp.isfinite(step(model, optimizer, x))
