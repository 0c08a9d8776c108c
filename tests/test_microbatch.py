# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Tests for `microbatch`: exactness, errors, dtypes, memory and sharding."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from optax import microbatching

import optax_accum
from tests.helpers import hlo as _hlo
from tests.helpers.lanes import sweep
from tests.helpers.models import mlp_loss, mlp_params

# ----------------------------------------------------------------- models


def _mlp_params(key, sizes=(4, 16, 3)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.full((b,), 0.1)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def _mlp(params, x):
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jnp.tanh(x)
    return x


def _mlp_loss(params, batch):
    logits = _mlp(params, batch["x"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def _mlp_batch(key, n=32, d=4, classes=3):
    kx, ky = jax.random.split(key)
    return {
        "x": jax.random.normal(kx, (n, d)),
        "y": jax.random.randint(ky, (n,), 0, classes),
    }


def _transformer_params(key, vocab=11, d=16, t=8):
    ks = jax.random.split(key, 6)
    init = lambda k, s: jax.random.normal(k, s) / np.sqrt(s[0])
    return {
        "emb": init(ks[0], (vocab, d)),
        "pos": init(ks[1], (t, d)) * 0.1,
        "qkv": init(ks[2], (d, 3 * d)),
        "out": init(ks[3], (d, d)),
        "mlp": init(ks[4], (d, d)),
        "head": init(ks[5], (d, vocab)),
        "ln": jnp.ones(d),
    }


def _transformer_logits(p, tokens):
    x = p["emb"][tokens] + p["pos"][: tokens.shape[1]]
    h = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["ln"]
    q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
    att = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))
    att = jax.nn.softmax(jnp.where(causal, att, -1e9), -1)
    x = x + jnp.einsum("bts,bsd->btd", att, v) @ p["out"]
    x = x + jax.nn.gelu(x @ p["mlp"])
    return x @ p["head"]


def _token_loss(p, batch):
    """Token mean over the valid (mask == 1) next-token targets."""
    logits = _transformer_logits(p, batch["tokens"])[:, :-1]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
    mask = batch["mask"][:, 1:]
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _token_batch(key, n=16, t=8, vocab=11):
    kt, kl = jax.random.split(key)
    tokens = jax.random.randint(kt, (n, t), 0, vocab)
    lengths = jax.random.randint(kl, (n,), 2, t + 1)
    mask = (jnp.arange(t)[None] < lengths[:, None]).astype(jnp.float32)
    return {"tokens": tokens, "mask": mask}


def _num_tokens(batch):
    return jnp.sum(batch["mask"][:, 1:])


def _close(a, b, rtol=1e-5, atol=1e-6):
    chex.assert_trees_all_close(a, b, rtol=rtol, atol=atol)


def _micro(tree, i, k):
    """Micro-batch ``i`` as `microbatch` defines it: rows i, i+k, i+2k, ..."""
    return jax.tree.map(lambda x: x[i::k], tree)


# ------------------------------------------------------------ exactness


@pytest.mark.parametrize("k", sweep([2, 4, 8], fast=[4]))
def test_mlp_equals_full_batch(k):
    params = _mlp_params(jax.random.key(0))
    batch = _mlp_batch(jax.random.key(1))
    vg = jax.value_and_grad(_mlp_loss)
    out = jax.jit(optax_accum.microbatch(vg, k))(params, batch)
    _close(out, vg(params, batch))


@pytest.mark.slow
def test_transformer_equals_full_batch():
    params = _transformer_params(jax.random.key(0))
    batch = _token_batch(jax.random.key(1))
    batch["mask"] = jnp.ones_like(batch["mask"])  # equal token counts
    vg = jax.value_and_grad(_token_loss)
    out = jax.jit(optax_accum.microbatch(vg, 4))(params, batch)
    _close(out, jax.jit(vg)(params, batch))


def test_token_weights_with_padding_give_the_full_batch_token_mean():
    params = _transformer_params(jax.random.key(2))
    batch = _token_batch(jax.random.key(3))
    vg = jax.value_and_grad(_token_loss)
    ref = jax.jit(vg)(params, batch)
    fun = optax_accum.microbatch(vg, 4, weight_fn=_num_tokens)
    _close(jax.jit(fun)(params, batch), ref)
    # Without weights, the mean of per-micro-batch token means is not exact.
    plain = jax.jit(optax_accum.microbatch(vg, 4))(params, batch)
    assert abs(float(plain[0]) - float(ref[0])) > 1e-4


@pytest.mark.slow
def test_sum_reduction_and_weighted_sum():
    params = _mlp_params(jax.random.key(0))
    batch = _mlp_batch(jax.random.key(1))
    vg = jax.value_and_grad(_mlp_loss)
    k = 4
    parts = [vg(params, _micro(batch, i, k)) for i in range(k)]
    total = jax.tree.map(lambda *xs: sum(xs), *parts)
    _close(optax_accum.microbatch(vg, k, reduction="sum")(params, batch), total)
    weights = [2.0, 0.0, 1.0, 3.0]
    batch["w"] = jnp.repeat(jnp.array(weights)[None], 8, 0).reshape(-1)
    wsum = jax.tree.map(
        lambda *xs: sum(w * x for w, x in zip(weights, xs, strict=True)), *parts
    )
    fun = optax_accum.microbatch(vg, k, reduction="sum", weight_fn=lambda b: b["w"][0])
    _close(fun(params, batch), wsum)
    wmean = jax.tree.map(lambda x: x / sum(weights), wsum)
    fun = optax_accum.microbatch(vg, k, weight_fn=lambda b: b["w"][0])
    _close(fun(params, batch), wmean)


def test_has_aux_is_stacked_in_micro_batch_order():
    def loss(p, x):
        pred = x @ p
        return jnp.mean(pred**2), {"pred": pred, "first": x[0, 0]}

    x = jnp.arange(24.0).reshape(12, 2)
    p = jnp.array([1.0, -2.0])
    vg = jax.value_and_grad(loss, has_aux=True)
    (value, aux), grads = optax_accum.microbatch(vg, 3, has_aux=True)(p, x)
    (ref_value, _), ref_grads = vg(p, x)
    _close((value, grads), (ref_value, ref_grads))
    assert aux["pred"].shape == (3, 4)
    for i in range(3):
        np.testing.assert_allclose(aux["pred"][i], x[i::3] @ p)
        assert float(aux["first"][i]) == float(x[i, 0])


def test_multiple_batch_argnums_and_kwargs():
    def loss(p, x, y, *, scale):
        return scale * jnp.mean((x @ p - y) ** 2)

    x = jax.random.normal(jax.random.key(0), (16, 3))
    y = jax.random.normal(jax.random.key(1), (16,))
    p = jnp.ones(3)
    vg = jax.value_and_grad(loss)
    fun = optax_accum.microbatch(vg, 4, batch_argnums=(1, 2))
    _close(fun(p, x, y, scale=2.0), vg(p, x, y, scale=2.0))


def test_k1_is_the_loop_of_one_trip_and_compiles_without_it():
    # k = 1 has no path of its own (issue 20, defect 1): the same loop, whose
    # single trip XLA removes, so it costs nothing.
    def vg(p, x):
        return jax.value_and_grad(lambda p: jnp.mean(x * p))(p)

    x = jnp.arange(6.0)
    out = optax_accum.microbatch(vg, 1)(2.0, x)
    _close(out, vg(2.0, x))
    hlo = (
        jax.jit(optax_accum.microbatch(vg, 1))
        .lower(jnp.float32(2.0), x)
        .compile()
        .as_text()
    )
    assert not any(" while(" in line for line in hlo.splitlines())
    fun = optax_accum.microbatch(
        jax.value_and_grad(lambda p, x: (jnp.mean(x * p), x), has_aux=True),
        1,
        has_aux=True,
    )
    (_, aux), _ = fun(2.0, x)
    assert aux.shape == (1, 6)


def test_per_micro_batch_prng_keys():
    def vg(p, x, key):
        noise = jax.random.normal(key, x.shape)
        return (jnp.mean(x * p), noise), jnp.mean(x)

    key = jax.random.key(7)
    x = jnp.zeros((8, 2))
    fun = optax_accum.microbatch(vg, 4, has_aux=True, rng_argnums=2)
    (_, noise), _ = jax.jit(fun)(1.0, x, key)
    for i in range(4):
        expected = jax.random.normal(jax.random.fold_in(key, i), (2, 2))
        np.testing.assert_array_equal(noise[i], expected)
    assert not np.allclose(noise[0], noise[1])
    # A dict of keys (Flax linen style) is folded leaf by leaf.
    fun = optax_accum.microbatch(
        lambda p, x, r: vg(p, x, r["dropout"]), 4, has_aux=True, rng_argnums=2
    )
    (_, noise2), _ = fun(1.0, x, {"dropout": key})
    np.testing.assert_array_equal(noise2, noise)


# ----------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_output_dtypes_follow_fun(dtype):
    def vg(p, x):
        return jnp.mean(x).astype(dtype), {"w": (p * jnp.mean(x)).astype(dtype)}

    x = jnp.arange(8.0)
    p = jnp.ones(3, dtype)
    for acc in (None, jnp.float32):
        value, grads = optax_accum.microbatch(vg, 4, accumulator_dtype=acc)(p, x)
        assert value.dtype == dtype and grads["w"].dtype == dtype
        _close(grads["w"].astype(jnp.float32), jnp.full(3, 3.5), rtol=1e-2)


def test_bf16_grads_accumulate_in_fp32_when_asked():
    # Micro-batch gradients 256, 1, 1, 1: a bf16 sum drops every 1 (ulp at
    # 256 is 2); a float32 sum keeps them.
    def vg(p, x):
        return jnp.mean(x), {"w": jnp.mean(x).astype(jnp.bfloat16) * p}

    x = jnp.array([256.0, 1.0, 1.0, 1.0])
    p = jnp.ones(2, jnp.bfloat16)
    _, low = optax_accum.microbatch(vg, 4, reduction="sum", accumulator_dtype=None)(
        p, x
    )
    _, high = optax_accum.microbatch(
        vg, 4, reduction="sum", accumulator_dtype=jnp.float32
    )(p, x)
    assert float(low["w"][0]) == 256.0
    assert float(high["w"][0]) == float(jnp.bfloat16(259.0))
    assert high["w"].dtype == jnp.bfloat16


def test_fp16_weighted_mean_does_not_overflow():
    # sum_i w_i g_i = 4096 * 40 * 4 overflows float16; the running mean does not.
    def vg(p, x):
        return jnp.mean(x), {"w": (p * jnp.mean(x)).astype(jnp.float16)}

    x = jnp.full((4,), 40.0)
    p = jnp.ones(2, jnp.float16)
    fun = optax_accum.microbatch(vg, 4, weight_fn=lambda x: 4096.0)
    _, grads = fun(p, x)
    np.testing.assert_array_equal(grads["w"], jnp.full(2, 40.0, jnp.float16))


# ----------------------------------------------------------------- errors


def test_errors_at_construction():
    vg = jax.value_and_grad(_mlp_loss)
    with pytest.raises(ValueError, match=r"num_microbatches.*>= 1, got 0"):
        optax_accum.microbatch(vg, 0)
    with pytest.raises(ValueError, match=r"num_microbatches.*got -2"):
        optax_accum.microbatch(vg, -2)
    with pytest.raises(TypeError, match=r"num_microbatches.*integer, got 2.5"):
        optax_accum.microbatch(vg, 2.5)
    with pytest.raises(ValueError, match=r"reduction.*'max'"):
        optax_accum.microbatch(vg, 2, reduction="max")
    with pytest.raises(TypeError, match=r"accumulator_dtype.*int32"):
        optax_accum.microbatch(vg, 2, accumulator_dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"must not overlap"):
        optax_accum.microbatch(vg, 2, batch_argnums=1, rng_argnums=1)
    with pytest.raises(TypeError, match=r"weight_fn.*3"):
        optax_accum.microbatch(vg, 2, weight_fn=3)
    with pytest.raises(ValueError, match=r"batch_argnums.*non-negative, got -1"):
        optax_accum.microbatch(vg, 2, batch_argnums=-1)
    with pytest.raises(TypeError, match=r"fun.*must be callable"):
        optax_accum.microbatch(None, 2)


def test_errors_at_trace_time():
    vg = jax.value_and_grad(_mlp_loss)
    params = _mlp_params(jax.random.key(0))
    batch = _mlp_batch(jax.random.key(1), n=30)
    with pytest.raises(ValueError, match=r"batch size 30 is not divisible by.*=4"):
        jax.jit(optax_accum.microbatch(vg, 4))(params, batch)
    batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros((6,), jnp.int32)}
    with pytest.raises(ValueError, match=r"leading size.*\['x'\].*8.*\['y'\].*6"):
        optax_accum.microbatch(vg, 2)(params, batch)
    with pytest.raises(ValueError, match=r"scalar leaf"):
        optax_accum.microbatch(vg, 2)(params, {"x": jnp.ones((8, 4)), "y": 1})
    batch = _mlp_batch(jax.random.key(1), n=8)
    fun = optax_accum.microbatch(vg, 2, weight_fn=lambda b: b["y"])
    with pytest.raises(ValueError, match=r"weight_fn.*scalar"):
        fun(params, batch)
    with pytest.raises(ValueError, match=r"argument index 3"):
        optax_accum.microbatch(vg, 2, batch_argnums=3)(params, batch)


@pytest.mark.parametrize(
    ("make_fun", "has_aux", "match"),
    [
        # has_aux=True on a plain value_and_grad: "iteration over a 0-d array".
        (lambda f: jax.value_and_grad(f), True, "pass has_aux=False"),
        # has_aux=False on ((value, aux), grads): "Too many indices".
        (
            lambda f: jax.value_and_grad(lambda w, x: (f(w, x), x), has_aux=True),
            False,
            "pass has_aux=True",
        ),
        # a plain loss: "IndexError".
        (lambda f: f, False, "not the loss"),
        # jax.grad with dict params: "KeyError: 0".
        (lambda f: jax.grad(f), False, r"not jax.grad\(loss\)"),
    ],
)
def test_fun_output_structure_is_checked(make_fun, has_aux, match):
    loss = lambda w, x: jnp.mean((x * w["a"]) ** 2)
    fun = optax_accum.microbatch(make_fun(loss), 2, has_aux=has_aux)
    with pytest.raises(TypeError, match=match):
        fun({"a": jnp.float32(1.0)}, jnp.ones(4))


def test_microbatch_with_an_nnx_module_points_to_nnx_train_step():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    loss = lambda m, x: jnp.mean(m(x) ** 2)
    fun = optax_accum.microbatch(nnx.value_and_grad(loss), 2)
    with pytest.raises(TypeError, match="nnx_train_step"):
        nnx.jit(fun)(model, jnp.ones((4, 2)))


# ----------------------------------------------------------------- memory

_D = 1024


def _big_loss(params, x, y):
    logits = _mlp(params, x)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _temp_mib(fun, num_micro_batches, micro=256):
    params = jax.eval_shape(lambda: _mlp_params(jax.random.key(0), (_D,) * 5))
    x = jax.ShapeDtypeStruct((micro * num_micro_batches, _D), jnp.float32)
    y = jax.ShapeDtypeStruct((micro * num_micro_batches,), jnp.int32)
    compiled = jax.jit(fun).lower(params, x, y).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def test_temp_memory_is_flat_in_k():
    fun = optax_accum.microbatch(jax.value_and_grad(_big_loss), 4, batch_argnums=(1, 2))
    fun16 = optax_accum.microbatch(
        jax.value_and_grad(_big_loss), 16, batch_argnums=(1, 2)
    )
    assert _temp_mib(fun16, 16) <= 1.15 * _temp_mib(fun, 4)


def test_temp_memory_vs_optax_microbatching():
    vg = jax.value_and_grad(_big_loss)
    ours = _temp_mib(optax_accum.microbatch(vg, 16, batch_argnums=(1, 2)), 16)
    theirs = _temp_mib(
        microbatching.microbatch(
            vg,
            argnums=(1, 2),
            microbatch_size=256,
            accumulator=microbatching.AccumulationType.MEAN,
        ),
        16,
    )
    assert ours <= 0.6 * theirs, (ours, theirs)


# --------------------------------------------------------------- sharding


def _all_reduces(hlo: str) -> tuple[int, int]:
    """(all-reduces reachable from a while body, all-reduces in total)."""
    comps, _ = _hlo.computations(hlo)
    bodies = _hlo.while_bodies(comps)
    assert bodies, "no while loop in the compiled HLO"
    return _hlo.count(comps, _hlo.reachable(comps, bodies)), _hlo.count(comps, comps)


def _sharded_inputs(mesh):
    params = _mlp_params(jax.random.key(0))
    batch = _mlp_batch(jax.random.key(1), n=64)
    batch["m"] = (jnp.arange(64) % 3 != 0).astype(jnp.float32)
    return (
        params,
        batch,
        jax.device_put(params, NamedSharding(mesh, P())),
        jax.device_put(batch, NamedSharding(mesh, P("data"))),
    )


def _masked_loss(params, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(
        _mlp(params, batch["x"]), batch["y"]
    )
    m = batch["m"]
    return jnp.sum(ce * m) / jnp.maximum(jnp.sum(m), 1.0), {"ce": ce}


def test_explicit_sharding_with_mesh_axes_all_reduces_once_after_the_loop():
    # Naming the data axis declares `fun` row-local: the device-local loop.
    # The default is the global view (one all-reduce per micro-batch).
    mesh = jax.make_mesh((8,), ("data",))
    assert mesh.axis_types == (AxisType.Explicit,)
    params, batch, sparams, sbatch = _sharded_inputs(mesh)
    vg = jax.value_and_grad(_mlp_loss)
    seen = []

    def spy(p, b):
        seen.append(jax.typeof(b["x"]))
        return vg(p, b)

    with jax.set_mesh(mesh):
        ours = jax.jit(optax_accum.microbatch(spy, 4, data_axes="data"))
        naive = jax.jit(optax_accum.microbatch(spy, 4))
        _close(ours(sparams, sbatch), vg(params, batch))
        _close(naive(sparams, sbatch), vg(params, batch))
        in_loop, total = _all_reduces(ours.lower(sparams, sbatch).compile().as_text())
        naive_in_loop, _ = _all_reduces(
            naive.lower(sparams, sbatch).compile().as_text()
        )
    assert in_loop == 0 and total >= 1
    assert naive_in_loop >= 1  # what a plain scan does: one per micro-batch
    # The local micro-batch is the device's 2 rows of a 16-row micro-batch; the
    # global one (naive path) keeps the batch sharding over all 8 devices.
    assert seen[0].shape == (2, 4)
    assert seen[-1].shape == (16, 4)
    assert seen[-1].sharding.spec == P("data", None)


@pytest.mark.slow
def test_explicit_sharding_with_token_weights_and_aux():
    mesh = jax.make_mesh((8,), ("data",))
    params, batch, sparams, sbatch = _sharded_inputs(mesh)
    vg = jax.value_and_grad(_masked_loss, has_aux=True)
    fun = optax_accum.microbatch(
        vg,
        4,
        has_aux=True,
        weight_fn=lambda b: b["m"].sum(),
        data_axes="data",
        aux_rows=True,  # per-row cross-entropies: gathered over devices
    )
    (ref_value, _), ref_grads = vg(params, batch)
    global_view = optax_accum.microbatch(
        vg, 4, has_aux=True, weight_fn=lambda b: b["m"].sum()
    )
    (_, ref_aux), _ = global_view(params, batch)
    with jax.set_mesh(mesh):
        (value, aux), grads = jax.jit(fun)(sparams, sbatch)
        in_loop, _ = _all_reduces(
            jax.jit(fun).lower(sparams, sbatch).compile().as_text()
        )
    _close((value, grads), (ref_value, ref_grads))
    _close(aux, ref_aux)
    assert in_loop == 0


@pytest.mark.slow
def test_auto_mesh_with_mesh_axes_all_reduces_once():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    params, batch, sparams, sbatch = _sharded_inputs(mesh)
    vg = jax.value_and_grad(_mlp_loss)
    with jax.set_mesh(mesh):
        fun = jax.jit(optax_accum.microbatch(vg, 4, data_axes="data"))
        _close(fun(sparams, sbatch), vg(params, batch))
        in_loop, total = _all_reduces(fun.lower(sparams, sbatch).compile().as_text())
    assert in_loop == 0 and total >= 1


def test_shard_map_with_axis_name():
    mesh = jax.make_mesh((8,), ("data",))
    params, batch, sparams, sbatch = _sharded_inputs(mesh)
    vg = jax.value_and_grad(_masked_loss, has_aux=True)
    (ref_value, _), ref_grads = vg(params, batch)
    weight = lambda b: b["m"].sum()

    for k in (1, 2):
        local = optax_accum.microbatch(
            vg, k, has_aux=True, weight_fn=weight, axis_name="data"
        )

        def step(p, b, local=local):
            (value, _), grads = local(p, b)
            return value, grads

        with jax.set_mesh(mesh):
            fun = jax.jit(jax.shard_map(step, in_specs=(P(), P("data")), out_specs=P()))
            _close(fun(sparams, sbatch), (ref_value, ref_grads))
            if k > 1:
                hlo = fun.lower(sparams, sbatch).compile().as_text()
                assert _all_reduces(hlo)[0] == 0


def test_pmap_with_axis_name():
    params = _mlp_params(jax.random.key(0))
    batch = _mlp_batch(jax.random.key(1), n=64)
    vg = jax.value_and_grad(_mlp_loss)
    shards = jax.tree.map(lambda x: x.reshape(8, 8, *x.shape[1:]), batch)
    copies = jax.tree.map(lambda x: jnp.broadcast_to(x, (8, *x.shape)), params)
    fun = jax.pmap(optax_accum.microbatch(vg, 2, axis_name="i"), axis_name="i")
    value, grads = fun(copies, shards)
    _close((value[3], jax.tree.map(lambda g: g[3], grads)), vg(params, batch))


# -------------------------------------------------------- fused optimizer


def test_fused_step_equals_k_calls_of_accumulate():
    params = _mlp_params(jax.random.key(0))
    batch = _mlp_batch(jax.random.key(1))
    k = 4
    vg = jax.value_and_grad(_mlp_loss)
    tx = optax.adam(1e-2)

    @jax.jit
    def fused(params, opt_state, batch):
        _, grads = optax_accum.microbatch(vg, k)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    acc = optax_accum.accumulate(tx, k)

    @jax.jit
    def micro_step(params, acc_state, micro):
        _, grads = vg(params, micro)
        updates, acc_state = acc.update(grads, acc_state, params)
        return optax.apply_updates(params, updates), acc_state

    p1, s1 = params, tx.init(params)
    p2, s2 = params, acc.init(params)
    for _ in range(2):
        p1, s1 = fused(p1, s1, batch)
        for i in range(k):
            p2, s2 = micro_step(p2, s2, _micro(batch, i, k))
    _close(p1, p2)
    assert not np.allclose(p1[0]["w"], params[0]["w"])


def test_result_does_not_expose_fun_as_wrapped():
    def vg(p, x):
        return jnp.sum(p * x), p

    fn = optax_accum.microbatch(vg, 2)
    assert not hasattr(fn, "__wrapped__")
    assert inspect.unwrap(fn) is fn and fn.__name__ == "vg"
    eqx = pytest.importorskip("equinox")
    # Equinox follows __wrapped__ and warned that parameters would not update.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = jnp.ones(2)
        fn = optax_accum.microbatch(
            eqx.filter_value_and_grad(lambda m, x: jnp.sum(m * x)), 2
        )
        eqx.filter_jit(fn)(model, jnp.ones((4, 2)))


@pytest.mark.slow
def test_weighted_loop_costs_what_the_unweighted_one_does():
    # The weights enter the backward pass (microbatch differentiates the
    # weighted value itself): fun's own gradients are dead code, so the
    # weighted loop runs no second backward pass.
    params = mlp_params(0, (16, 64, 64, 8))
    x, y = jnp.ones((32, 16)), jnp.ones((32, 8))

    def flops(**kw):
        fun = optax_accum.microbatch(
            jax.value_and_grad(mlp_loss), 4, batch_argnums=(1, 2), **kw
        )
        cost = jax.jit(fun).lower(params, x, y).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    weighted = flops(weight_fn=lambda x, y: jnp.float32(x.shape[0]))
    assert weighted < 1.1 * flops()


@pytest.mark.parametrize(
    "face, first",
    [
        (optax_accum.microbatch, ["fun", "num_microbatches"]),
        (
            optax_accum.microbatch_value_and_grad,
            ["loss", "num_microbatches", "argnums"],
        ),
    ],
)
def test_both_faces_take_the_keywords_declared_once(face, first):
    # Issue 27: one declaration (`_microbatch._keywords.Keywords`) feeds both
    # faces' signatures and the keywords' Args entries of their docstrings.
    from optax_accum._microbatch import Keywords

    declared = [f.name for f in dataclasses.fields(Keywords)]
    params = inspect.signature(face).parameters
    assert list(params) == first + declared
    for f in dataclasses.fields(Keywords):
        assert params[f.name].default == f.default
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert f"\n      {f.name}: " in face.__doc__
    assert "{keywords}" not in face.__doc__
    for wrong in ("num_microbatch", "stateful", "face"):
        with pytest.raises(TypeError, match=f"{face.__name__}.. got an unexpected"):
            face(lambda w, x: x, 2, **{wrong: 2})
    if face is optax_accum.microbatch:  # the loss face's own keyword
        with pytest.raises(TypeError, match="unexpected keyword argument 'argnums'"):
            face(lambda w, x: x, 2, argnums=0)
