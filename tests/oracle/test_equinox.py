# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Equinox models on the `microbatch` faces and on `accumulate`/`MultiSteps`.

Equinox's gradients hold ``None`` where a model holds no array (activation
functions, a dropout rate), and its ``filter_*`` transforms partition a model
with `eqx.is_array`. Each test compares against the full batch's
`eqx.filter_value_and_grad` and the plain optimizer (or `optax.MultiSteps`)
at float32 tolerance, so it checks the values, not only that nothing raises
(issue 27: the ``None`` leaves once crashed `microbatch`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

eqx = pytest.importorskip("equinox")

K = 4
ROWS = 16


class Net(eqx.Module):
    """An MLP (its activations are non-array leaves) with dropout."""

    mlp: eqx.nn.MLP
    drop: eqx.nn.Dropout

    def __init__(self, key, p=0.0):
        self.mlp = eqx.nn.MLP(3, 2, 8, 2, key=key)
        self.drop = eqx.nn.Dropout(p)

    def __call__(self, x, key=None):
        return self.drop(self.mlp(x), key=key, inference=key is None)


def _data():
    x = jax.random.normal(jax.random.key(1), (ROWS, 3))
    y = jax.random.normal(jax.random.key(2), (ROWS, 2))
    mask = (jnp.arange(ROWS) % 3 != 0).astype(jnp.float32).at[:K].set(1.0)
    return x, y, mask


def loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def loss_aux(model, x, y):
    value = loss(model, x, y)
    return value, {"loss": value}


def masked_loss(model, x, y, mask):
    err = jnp.sum((jax.vmap(model)(x) - y) ** 2, axis=-1)
    return jnp.sum(mask * err) / jnp.sum(mask)


def dropout_loss(model, x, y, key):
    keys = jax.random.split(key, x.shape[0])
    return jnp.mean((jax.vmap(model)(x, keys) - y) ** 2)


def _close(actual, expected):
    actual, expected = (
        eqx.filter(actual, eqx.is_array),
        eqx.filter(expected, eqx.is_array),
    )
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    jax.tree.map(
        lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7),
        actual,
        expected,
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "filter_jit"])
def test_microbatch_of_filter_value_and_grad(jit):
    model, (x, y, _) = Net(jax.random.key(0)), _data()
    fn = optax_accum.microbatch(
        eqx.filter_value_and_grad(loss), K, batch_argnums=(1, 2)
    )
    fn = eqx.filter_jit(fn) if jit else fn
    value, grads = fn(model, x, y)
    want_value, want_grads = eqx.filter_value_and_grad(loss)(model, x, y)
    _close(value, want_value)
    _close(grads, want_grads)
    assert grads.mlp.activation is None  # Equinox's None leaves come back


def test_microbatch_has_aux():
    model, (x, y, _) = Net(jax.random.key(0)), _data()
    fn = optax_accum.microbatch(
        eqx.filter_value_and_grad(loss_aux, has_aux=True),
        K,
        batch_argnums=(1, 2),
        has_aux=True,
    )
    (value, aux), grads = eqx.filter_jit(fn)(model, x, y)
    (want_value, _), want_grads = eqx.filter_value_and_grad(loss_aux, has_aux=True)(
        model, x, y
    )
    _close(value, want_value)
    _close(grads, want_grads)
    assert aux["loss"].shape == (K,)
    _close(jnp.mean(aux["loss"]), want_value)


def test_microbatch_token_weights():
    model, (x, y, mask) = Net(jax.random.key(0)), _data()
    fn = optax_accum.microbatch(
        eqx.filter_value_and_grad(masked_loss),
        K,
        batch_argnums=(1, 2, 3),
        weight_fn=lambda x, y, mask: jnp.sum(mask),
    )
    value, grads = eqx.filter_jit(fn)(model, x, y, mask)
    want_value, want_grads = eqx.filter_value_and_grad(masked_loss)(model, x, y, mask)
    _close(value, want_value)
    _close(grads, want_grads)


def test_microbatch_dropout_keys():
    # Micro-batch i holds rows i, i+k, ... and draws with fold_in(key, i).
    model, (x, y, _) = Net(jax.random.key(0), p=0.5), _data()
    key = jax.random.key(5)
    fn = optax_accum.microbatch(
        eqx.filter_value_and_grad(dropout_loss),
        K,
        batch_argnums=(1, 2),
        rng_argnums=3,
    )
    value, grads = eqx.filter_jit(fn)(model, x, y, key)
    parts = [
        eqx.filter_value_and_grad(dropout_loss)(
            model, x[i::K], y[i::K], jax.random.fold_in(key, i)
        )
        for i in range(K)
    ]
    want_value, want_grads = jax.tree.map(lambda *t: sum(t) / K, *parts)
    _close(value, want_value)
    _close(grads, want_grads)
    # Dropout is on: the value is not the deterministic model's.
    assert not np.isclose(value, loss(model, x, y), rtol=1e-3)


@pytest.mark.parametrize("has_aux", [False, True])
def test_loss_face_on_partitioned_model(has_aux):
    model, (x, y, mask) = Net(jax.random.key(0)), _data()
    params, static = eqx.partition(model, eqx.is_array)

    def split_loss(params, x, y, mask):
        value = masked_loss(eqx.combine(params, static), x, y, mask)
        return (value, {"loss": value}) if has_aux else value

    fn = optax_accum.microbatch_value_and_grad(
        split_loss,
        K,
        has_aux=has_aux,
        batch_argnums=(1, 2, 3),
        weight_fn=lambda x, y, mask: jnp.sum(mask),
    )
    out, grads = jax.jit(fn)(params, x, y, mask)
    value = out[0] if has_aux else out
    want_value, want_grads = eqx.filter_value_and_grad(masked_loss)(model, x, y, mask)
    _close(value, want_value)
    _close(grads, want_grads)


def test_loss_face_on_a_whole_model_says_how_to_partition_it():
    # jax.grad cannot differentiate a model holding functions; say what to do.
    model, (x, y, _) = Net(jax.random.key(0)), _data()
    fn = optax_accum.microbatch_value_and_grad(loss, K, batch_argnums=(1, 2))
    with pytest.raises(
        TypeError, match=r"argument 0\.mlp\.activation .*eqx\.partition"
    ):
        fn(model, x, y)


_grad = eqx.filter_jit(eqx.filter_grad(loss))


def _mini_grads(model, x, y):
    return [_grad(model, x[i::K], y[i::K]) for i in range(K)]


def test_accumulate_equals_plain_optimizer():
    model, (x, y, _) = Net(jax.random.key(0)), _data()
    tx = optax.adam(1e-2)
    acc = optax_accum.accumulate(tx, K)
    params = eqx.filter(model, eqx.is_array)
    state = acc.init(params)
    update = eqx.filter_jit(acc.update)
    got = params
    for grads in _mini_grads(model, x, y):
        updates, state = update(grads, state, got)
        got = eqx.apply_updates(got, updates)
    mean = jax.tree.map(lambda *g: sum(g) / K, *_mini_grads(model, x, y))
    updates, _ = tx.update(mean, tx.init(params), params)
    _close(got, eqx.apply_updates(params, updates))
    assert not np.allclose(got.mlp.layers[0].weight, params.mlp.layers[0].weight)


def test_multisteps_equals_optax_multisteps():
    model, (x, y, _) = Net(jax.random.key(0)), _data()
    tx = optax.adam(1e-2)
    ours, theirs = optax_accum.MultiSteps(tx, K), optax.MultiSteps(tx, K)
    params = eqx.filter(model, eqx.is_array)
    state, ref_state, got, want = ours.init(params), theirs.init(params), params, params
    ours_update, theirs_update = jax.jit(ours.update), jax.jit(theirs.update)
    for _ in range(2):
        for grads in _mini_grads(eqx.combine(got, model), x, y):
            updates, state = ours_update(grads, state, got)
            got = eqx.apply_updates(got, updates)
        for grads in _mini_grads(eqx.combine(want, model), x, y):
            updates, ref_state = theirs_update(grads, ref_state, want)
            want = eqx.apply_updates(want, updates)
    _close(got, want)
