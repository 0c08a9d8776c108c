# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""A per-leaf ``accumulator_dtype`` (issue 29): a pytree prefix of the gradients.

Both faces (`accumulate` / `MultiSteps`, and `microbatch` /
`microbatch_value_and_grad`) against the large batch (full-batch
``jax.value_and_grad`` and the plain optimizer), on one device and on an FSDP
mesh, at each buffer dtype's precision; the state's buffers in the per-leaf
dtypes; the narrow buffers' running mean; and a prefix that does not match,
refused with its path.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _dtypes
from tests.helpers import layouts as L

K, ROWS = 4, 16
# w1 in bfloat16, b1 in float16, w2 as the default ("promote": float32).
POLICY = {"w1": jnp.bfloat16, "b1": jnp.float16, "w2": "promote"}
BUFFERS = {"w1": jnp.bfloat16, "b1": jnp.float16, "w2": jnp.float32}
# Relative to the leaf's largest entry: float32 to 1e-5; a narrow buffer to
# its machine epsilon (bf16 2**-7, fp16 2**-10), whatever the number of
# micro-batches (reached here: bf16 3.8e-3, fp16 2.4e-4, float32 2.1e-7).
TOL = {"w1": 2**-7, "b1": 2**-10, "w2": 1e-5}
BAD = {"w1": jnp.bfloat16, "b1": None}  # no "w2"


def _close(got, ref):
    for name, tol in TOL.items():
        g, r = np.asarray(got[name], np.float64), np.asarray(ref[name], np.float64)
        err = np.max(np.abs(g - r)) / np.max(np.abs(r))
        assert err <= tol, (name, err, tol)


def _large_batch():
    x, y = L.data(K * ROWS)
    return jax.value_and_grad(L.loss_fn(None))(L.params(), x, y)


def _plain_updates(inner):
    _, g = _large_batch()
    return inner.update(g, inner.init(L.params()), L.params())[0]


# ---- the policy ----------------------------------------------------------


def test_resolve_gives_each_leaf_its_dtype_and_the_prefix_is_hashable():
    grads = {"a": jnp.zeros(2, jnp.bfloat16), "b": [jnp.zeros(2), jnp.zeros(2)]}
    policy = _dtypes.canonical({"a": None, "b": [jnp.bfloat16, "promote"]})
    hash(policy)  # it sits in frozen, hashable options
    assert _dtypes.resolve(policy, grads) == {
        "a": jnp.bfloat16,
        "b": [jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)],
    }
    # One policy for a whole subtree, and scalars as before.
    assert _dtypes.resolve(_dtypes.canonical({"a": "promote", "b": None}), grads)[
        "a"
    ] == jnp.dtype(jnp.float32)
    assert _dtypes.resolve(_dtypes.canonical(None), grads)["a"] == jnp.bfloat16


@pytest.mark.parametrize(
    ("prefix", "path"),
    [
        ({"a": None}, "the root"),
        ({"a": None, "b": [None]}, "['b']"),
        ({"a": {"x": None}, "b": None}, "['a']"),
    ],
)
def test_a_prefix_that_does_not_match_is_refused_naming_the_path(prefix, path):
    grads = {"a": jnp.zeros(2), "b": [jnp.zeros(2), jnp.zeros(2)]}
    with pytest.raises(ValueError, match="`accumulator_dtype`") as e:
        _dtypes.resolve(_dtypes.canonical(prefix), grads)
    assert f"at {path}" in str(e.value)


def test_an_invalid_dtype_in_a_prefix_is_named_with_its_path():
    with pytest.raises(TypeError, match=r"`accumulator_dtype` at \['b'\]\[1\]"):
        optax_accum.accumulate(optax.sgd(1.0), 2, accumulator_dtype={"b": [None, 3]})
    with pytest.raises(TypeError, match=r"`accumulator_dtype` at \['a'\]"):
        optax_accum.microbatch_value_and_grad(
            lambda p, x: x, 2, accumulator_dtype={"a": jnp.int32}
        )


@pytest.mark.parametrize("face", ["accumulate", "MultiSteps", "fused", "loss"])
def test_faces_refuse_a_mismatching_prefix_naming_the_path(face):
    x, y = L.data(K * ROWS)
    loss = L.loss_fn(None)
    match = r"`accumulator_dtype` is not a prefix of the gradients at the root"
    with pytest.raises(ValueError, match=match):
        if face == "accumulate":
            optax_accum.accumulate(optax.sgd(1.0), K, accumulator_dtype=BAD).init(
                L.params()
            )
        elif face == "MultiSteps":
            optax_accum.MultiSteps(optax.sgd(1.0), K, accumulator_dtype=BAD).init(
                L.params()
            )
        elif face == "fused":
            optax_accum.microbatch(
                jax.value_and_grad(loss), K, batch_argnums=(1, 2), accumulator_dtype=BAD
            )(L.params(), x, y)
        else:
            optax_accum.microbatch_value_and_grad(
                loss, K, batch_argnums=(1, 2), accumulator_dtype=BAD
            )(L.params(), x, y)


# ---- the state -----------------------------------------------------------


def test_state_buffers_have_the_per_leaf_dtypes_and_specs():
    params = L.params()
    tx = optax_accum.accumulate(optax.adam(1e-3), K, accumulator_dtype=POLICY)
    state = tx.init(params)
    assert jax.tree.map(lambda a: a.dtype, state.accumulator) == BUFFERS
    ms = optax_accum.MultiSteps(optax.adam(1e-3), K, accumulator_dtype=POLICY)
    assert jax.tree.map(lambda a: a.dtype, ms.init(params).acc_grads) == BUFFERS
    tx = optax_accum.accumulate(
        optax.sgd(1.0), K, accumulator_dtype=POLICY, axis_name="data"
    )
    specs = optax_accum.state_specs(jax.eval_shape(tx.init, params), "data")
    assert specs.accumulator == {n: P("data") for n in BUFFERS}


def test_state_shardings_place_per_leaf_buffers_like_their_parameters():
    layout = L.LAYOUTS["fsdp"]
    mesh = L.mesh(layout, explicit=False)
    tx = optax_accum.accumulate(optax.adam(1e-3), K, accumulator_dtype=POLICY)
    with jax.set_mesh(mesh):
        params = L.place(layout, mesh, L.params())
        shardings = optax_accum.state_shardings(tx, params)
        state = jax.jit(tx.init, out_shardings=shardings)(params)
    for name, dtype in BUFFERS.items():
        a = state.accumulator[name]
        assert a.dtype == dtype
        assert a.sharding.spec == params[name].sharding.spec
        # Per device, the parameter's shard at the buffer's width.
        p = params[name].addressable_shards[0].data
        assert a.addressable_shards[0].data.nbytes == p.size * jnp.dtype(dtype).itemsize


# ---- the large batch, one device -----------------------------------------


def _window(make_tx, params, xs, ys, step_params=None):
    """One window of K micro-batches; the boundary's updates."""
    tx = make_tx()
    state = tx.init(params)
    loss = L.loss_fn(None)

    @jax.jit
    def step(s, x, y):
        g = jax.grad(loss)(params if step_params is None else step_params, x, y)
        return tx.update(g, s, params)

    for i in range(K):
        updates, state = step(state, xs[i], ys[i])
    return updates, state


INNER = {"sgd": lambda: optax.sgd(1.0), "adamw": lambda: optax.adamw(1e-2)}


@pytest.mark.parametrize("inner", ["sgd", "adamw"])
@pytest.mark.parametrize("face", ["accumulate", "MultiSteps"])
def test_accumulate_per_leaf_matches_the_large_batch(face, inner):
    make = optax_accum.accumulate if face == "accumulate" else optax_accum.MultiSteps
    x, y = L.data(K * ROWS)
    xs, ys = x.reshape(K, ROWS, -1), y.reshape(K, ROWS, -1)
    updates, _ = _window(
        lambda: make(INNER[inner](), K, accumulator_dtype=POLICY), L.params(), xs, ys
    )
    ref = _plain_updates(INNER[inner]())
    if inner == "sgd":
        _close(updates, ref)
    else:  # Adam's first step is about lr * sign(g): close wherever g is not ~0
        chex.assert_trees_all_close(updates, ref, atol=2e-3)


@pytest.mark.parametrize("face", ["fused", "loss"])
def test_microbatch_per_leaf_matches_the_large_batch(face):
    x, y = L.data(K * ROWS)
    loss = L.loss_fn(None)
    if face == "fused":
        fun = optax_accum.microbatch(
            jax.value_and_grad(loss), K, batch_argnums=(1, 2), accumulator_dtype=POLICY
        )
    else:
        fun = optax_accum.microbatch_value_and_grad(
            loss, K, batch_argnums=(1, 2), accumulator_dtype=POLICY
        )
    value, grads = jax.jit(fun)(L.params(), x, y)
    ref_value, ref = _large_batch()
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    assert jax.tree.map(lambda g: g.dtype, grads) == {n: jnp.float32 for n in TOL}
    _close(grads, ref)


def _masked_loss(p, x, y, m):
    """The mean over the valid rows (``m``) of the MLP's per-row loss."""
    per_row = jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2, -1)
    return jnp.sum(per_row * m) / jnp.sum(m)


@pytest.mark.parametrize("face", ["fused", "loss"])
def test_token_weighted_per_leaf_matches_the_large_batch(face):
    """Micro-batches weighted by their valid rows: the running mean's weighted
    coefficients, per leaf."""
    x, y = L.data(K * ROWS)
    m = jnp.asarray(np.random.default_rng(2).random(K * ROWS) < 0.6, jnp.float32)
    m = m.at[:ROWS].set(1.0)  # micro-batches of unequal weight, none empty
    kw = dict(
        batch_argnums=(1, 2, 3),
        weight_fn=lambda x, y, m: m.sum(),
        accumulator_dtype=POLICY,
    )
    if face == "fused":
        fun = optax_accum.microbatch(jax.value_and_grad(_masked_loss), K, **kw)
    else:
        fun = optax_accum.microbatch_value_and_grad(_masked_loss, K, **kw)
    value, grads = jax.jit(fun)(L.params(), x, y, m)
    ref_value, ref = jax.value_and_grad(_masked_loss)(L.params(), x, y, m)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    _close(grads, ref)


# ---- the running mean of a narrow leaf ------------------------------------

LONG = 300  # a bf16 sum of ones stalls at 256: 256 + 1 rounds back to 256


def _ones_and_twos(_p, x):
    """Gradients 1 for "narrow", x for "wide": a sum in bf16 would stall."""
    del _p
    return jnp.float32(0), {"narrow": jnp.ones(()), "wide": x.sum()}


@pytest.mark.parametrize("face", ["accumulate", "fused"])
def test_a_narrow_leaf_keeps_a_running_mean_beside_a_wide_one(face):
    policy = {"narrow": jnp.bfloat16, "wide": None}
    p = {"narrow": jnp.zeros(()), "wide": jnp.zeros(())}
    xs = jnp.arange(LONG, dtype=jnp.float32)
    if face == "fused":
        fun = optax_accum.microbatch(_ones_and_twos, LONG, accumulator_dtype=policy)
        _, mean = fun(p, xs)
    else:
        tx = optax_accum.accumulate(optax.sgd(-1.0), LONG, accumulator_dtype=policy)

        def body(carry, x):
            state, _ = carry
            updates, state = tx.update(_ones_and_twos(p, x[None])[1], state, p)
            return (state, updates), None

        init = (tx.init(p), jax.tree.map(jnp.zeros_like, p))
        (_, mean), _ = jax.lax.scan(body, init, xs)
    assert float(mean["narrow"]) == 1.0
    np.testing.assert_allclose(float(mean["wide"]), (LONG - 1) / 2, rtol=1e-6)


# ---- the large batch, FSDP ------------------------------------------------


@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize("face", ["accumulate", "MultiSteps"])
def test_accumulate_per_leaf_on_fsdp_matches_the_large_batch(face, explicit):
    layout = L.LAYOUTS["fsdp"]
    mesh = L.mesh(layout, explicit)
    make = optax_accum.accumulate if face == "accumulate" else optax_accum.MultiSteps
    tx = make(optax.sgd(1.0), K, accumulator_dtype=POLICY)
    loss = L.loss_fn(layout, explicit)
    x, y = L.data(K * ROWS)
    xs, ys = x.reshape(K, ROWS, -1), y.reshape(K, ROWS, -1)
    with jax.set_mesh(mesh):
        params = L.place(layout, mesh, L.params())
        shardings = optax_accum.state_shardings(tx, params)
        state = jax.jit(tx.init, out_shardings=shardings)(params)

        @jax.jit
        def step(s, x, y):
            return tx.update(jax.grad(loss)(params, x, y), s, params)

        for i in range(K):
            updates, state = step(state, *L.place_batch(layout, mesh, xs[i], ys[i]))
    _close(jax.device_get(updates), _plain_updates(optax.sgd(1.0)))
    acc = state.accumulator if face == "accumulate" else state.acc_grads
    for name, dtype in BUFFERS.items():
        assert acc[name].dtype == dtype
        a = acc[name]
        assert a.sharding.is_equivalent_to(params[name].sharding, a.ndim), name


@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize("face", ["fused", "loss"])
def test_microbatch_per_leaf_on_fsdp_matches_the_large_batch(face, explicit):
    layout = L.LAYOUTS["fsdp"]
    mesh = L.mesh(layout, explicit)
    loss = L.loss_fn(layout, explicit)
    if face == "fused":
        fun = optax_accum.microbatch(
            jax.value_and_grad(loss), K, batch_argnums=(1, 2), accumulator_dtype=POLICY
        )
    else:
        fun = optax_accum.microbatch_value_and_grad(
            loss, K, batch_argnums=(1, 2), accumulator_dtype=POLICY
        )
    with jax.set_mesh(mesh):
        params = L.place(layout, mesh, L.params())
        x, y = L.place_batch(layout, mesh, *L.data(K * ROWS))
        value, grads = jax.jit(fun)(params, x, y)
    ref_value, ref = _large_batch()
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    _close(jax.device_get(grads), ref)
    if explicit:
        for name, g in grads.items():
            assert g.sharding.is_equivalent_to(params[name].sharding, g.ndim)


# ---- the Flax step forwards it --------------------------------------------


def test_nnx_train_step_takes_a_dict_prefix_of_the_model_state():
    nnx = pytest.importorskip("flax.nnx")
    from optax_accum.flax import nnx_train_step

    def run(**kw):
        model = nnx.Linear(L.D_IN, L.D_OUT, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        x, y = L.data(K * ROWS)
        loss = lambda m, x, y: jnp.mean((m(x) - y) ** 2)
        step = nnx_train_step(loss, num_microbatches=K, **kw)
        nnx.jit(step)(model, optimizer, x, y)
        return model.kernel[...], model.bias[...]

    # A dict prefix of the gradients' nnx.State (matched by keys).
    per_leaf = run(accumulator_dtype={"kernel": jnp.bfloat16, "bias": None})
    chex.assert_trees_all_close(per_leaf, run(), rtol=1e-2, atol=1e-3)
    with pytest.raises(ValueError, match=r"`accumulator_dtype`.* at the root"):
        run(accumulator_dtype={"kernel": jnp.bfloat16})
