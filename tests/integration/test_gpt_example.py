# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The reference transformer of ``examples/gpt.py``, and accumulation on it.

All on the ``tiny`` preset (about 0.1M parameters), so each test takes a few
seconds on the CPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

pytest.importorskip("flax")

_PATH = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"


def _load_gpt():
    if "gpt" in sys.modules and getattr(sys.modules["gpt"], "__file__", None) == str(
        _PATH
    ):
        return sys.modules["gpt"]
    spec = importlib.util.spec_from_file_location("gpt", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpt"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gpt = _load_gpt()
CFG = gpt.preset("tiny")
RTOL, ATOL = 1e-5, 1e-6
_apply = gpt.nnx.jit(lambda model, tokens: model(tokens))


def _close(a, b, rtol=RTOL, atol=ATOL):
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b
    )


def test_preset_sizes():
    def count(name):
        shapes = jax.eval_shape(lambda: gpt.functional(gpt.preset(name))[0])
        return gpt.num_params(shapes)

    assert 9e6 < count("cpu_small") < 12e6
    assert count("gpt2_small") == 124_439_808  # GPT-2 small, tied output


def test_forward_shapes_and_param_dtypes():
    for dtype in ("float32", "bfloat16"):
        model = gpt.GPT(CFG.replace(dtype=dtype), rngs=gpt.nnx.Rngs(0))
        tokens = jnp.zeros((3, CFG.seq_len), jnp.int32)
        logits = _apply(model, tokens)
        assert logits.shape == (3, CFG.seq_len, CFG.vocab_size)
        assert logits.dtype == jnp.float32
        params = gpt.nnx.state(model, gpt.nnx.Param)
        assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
        assert _apply(model, tokens[:, :5]).shape == (3, 5, CFG.vocab_size)


def test_causal():
    model = gpt.GPT(CFG, rngs=gpt.nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, CFG.seq_len), 0, 256)
    j = 17
    changed = tokens.at[:, j:].set((tokens[:, j:] + 1) % CFG.vocab_size)
    a, b = _apply(model, tokens), _apply(model, changed)
    np.testing.assert_array_equal(a[:, :j], b[:, :j])
    assert np.abs(a[:, j:] - b[:, j:]).min(axis=-1).max() > 0


@pytest.mark.parametrize("remat", ["dots", "full"])
def test_remat_same_loss_and_grads(remat):
    batch = gpt.random_batch(jax.random.key(2), CFG, 4, pad_fraction=0.5)
    params, loss = gpt.functional(CFG)
    _, loss_r = gpt.functional(CFG.replace(remat=remat))
    want = jax.jit(jax.value_and_grad(loss))(params, batch)
    got = jax.jit(jax.value_and_grad(loss_r))(params, batch)
    _close(got, want)


def test_remat_is_in_the_jaxpr():
    batch = gpt.random_batch(jax.random.key(2), CFG, 2)
    for remat, count in (("none", 0), ("dots", CFG.n_layers), ("full", CFG.n_layers)):
        params, loss = gpt.functional(CFG.replace(remat=remat))
        jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params, batch))
        assert jaxpr.count("checkpoint[") + jaxpr.count("remat") >= count, remat
        if count == 0:
            assert "checkpoint[" not in jaxpr and "remat2" not in jaxpr


def test_bfloat16_runs_close_to_float32():
    batch = gpt.random_batch(jax.random.key(3), CFG, 4)
    params, loss32 = gpt.functional(CFG)
    _, loss16 = gpt.functional(CFG.replace(dtype="bfloat16", remat="dots"))
    v32, g32 = jax.jit(jax.value_and_grad(loss32))(params, batch)
    v16, g16 = jax.jit(jax.value_and_grad(loss16))(params, batch)
    assert v16.dtype == jnp.float32 and np.isfinite(v16)
    assert abs(float(v16) - float(v32)) < 0.05 * float(v32)
    assert {x.dtype for x in jax.tree.leaves(g16)} == {jnp.dtype("float32")}
    # bf16 has 8 bits of mantissa: the gradient points the same way.
    flat32 = jnp.concatenate([x.ravel() for x in jax.tree.leaves(g32)])
    flat16 = jnp.concatenate([x.ravel() for x in jax.tree.leaves(g16)])
    cosine = flat32 @ flat16 / jnp.linalg.norm(flat32) / jnp.linalg.norm(flat16)
    assert cosine > 0.99


def test_loss_is_the_token_mean():
    batch = gpt.random_batch(jax.random.key(4), CFG, 3, pad_fraction=0.7)
    model = gpt.GPT(CFG, rngs=gpt.nnx.Rngs(0))
    logits = np.asarray(_apply(model, batch["inputs"]), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    targets, mask = np.asarray(batch["targets"]), np.asarray(batch["mask"])
    ce = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    want = (ce * mask).sum() / mask.sum()
    np.testing.assert_allclose(gpt.loss_fn(model, batch), want, rtol=1e-5)
    empty = dict(batch, mask=jnp.zeros_like(batch["mask"]))
    assert float(gpt.loss_fn(model, empty)) == 0.0


@pytest.mark.parametrize("remat", ["none", "full"])
def test_microbatch_equals_full_batch(remat):
    k = 4
    batch = gpt.random_batch(jax.random.key(5), CFG, 8, pad_fraction=0.6)
    params, loss = gpt.functional(CFG.replace(remat=remat))
    want = jax.jit(jax.value_and_grad(loss))(params, batch)
    fused = optax_accum.microbatch(
        jax.value_and_grad(loss), k, weight_fn=gpt.token_count
    )
    _close(jax.jit(fused)(params, batch), want)


def test_accumulate_equals_full_batch():
    k, windows = 4, 2
    params, loss = gpt.functional(CFG)
    # Adam would amplify float32 rounding where a gradient is near zero.
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
    acc = optax_accum.accumulate(tx, k)

    @jax.jit
    def full_step(p, s, batch):
        g = jax.grad(loss)(p, batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    @jax.jit
    def micro_step(p, s, batch):
        g = jax.grad(loss)(p, batch)
        u, s = acc.update(g, s, p, weight=gpt.token_count(batch))
        return optax.apply_updates(p, u), s

    p_full, s_full = params, tx.init(params)
    p_acc, s_acc = params, acc.init(params)
    for w in range(windows):
        batch = gpt.random_batch(jax.random.key(10 + w), CFG, 8, pad_fraction=0.6)
        p_full, s_full = full_step(p_full, s_full, batch)
        for i in range(k):
            p_acc, s_acc = micro_step(
                p_acc, s_acc, jax.tree.map(lambda x, i=i: x[i::k], batch)
            )
        assert optax_accum.has_updated(s_acc)
    _close(p_acc, p_full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"d_model": 0}, "`d_model`"),
        ({"vocab_size": 2.5}, "`vocab_size`"),
        ({"n_heads": 3}, "`n_heads`=3"),
        ({"dtype": "float16"}, "`dtype`"),
        ({"remat": "some"}, "`remat`"),
        ({"n_layers": True}, "`n_layers`"),
    ],
)
def test_bad_config(change, match):
    with pytest.raises(ValueError, match=match):
        CFG.replace(**change)


def test_bad_preset_and_too_long_input():
    with pytest.raises(ValueError, match="`name`"):
        gpt.preset("gpt5")
    model = gpt.GPT(CFG, rngs=gpt.nnx.Rngs(0))
    with pytest.raises(ValueError, match="`seq_len`=32"):
        model(jnp.zeros((1, CFG.seq_len + 1), jnp.int32))
