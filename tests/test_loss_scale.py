# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""fp16 with dynamic loss scaling (jmp) under accumulation.

The loss of each micro-batch is computed in fp16 and scaled; its gradients are
unscaled before they enter the accumulator. A micro-batch whose scaled
backward pass overflows is dropped by ``skip_not_finite`` and halves the
scale; ``period`` finite micro-batches in a row double it. The scale is part of
the training state, so it must survive a checkpoint in the middle of a window.
"""

from __future__ import annotations

import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

jmp = pytest.importorskip("jmp")
ocp = pytest.importorskip("orbax.checkpoint")

K = 4
POLICY = jmp.get_policy("params=float32,compute=float16,output=float32")
# A target this far off makes the scaled backward pass overflow at 2**15
# (cotangents ~2 * 30 / 24 * 2**15 > 65504) while the loss itself, and the
# same backward pass at 2**14, stay finite in fp16: a loss-scale overflow.
OVERFLOW_TARGET = 30.0


def _loss(params, x, y):
    params, x, y = POLICY.cast_to_compute((params, x, y))
    pred = jnp.tanh(x @ params["w"] + params["b"])
    return POLICY.cast_to_output(jnp.mean((pred - y) ** 2))


def _params():
    return {
        "w": jnp.asarray(np.random.default_rng(1).normal(size=(5, 3)), jnp.float32),
        "b": jnp.zeros(3, jnp.float32),
    }


def _batch(seed, overflow=False):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(8, 5)).astype(np.float32) * 0.5
    y = rng.normal(size=(8, 3)).astype(np.float32) * 0.5
    if overflow:
        y[0, 0] = OVERFLOW_TARGET
    return jnp.asarray(x), jnp.asarray(y)


GRAD_FN = optax_accum.scaled_value_and_grad(_loss)

FACES = {
    "accumulate": lambda inner: optax_accum.accumulate(
        inner, K, skip_fn=optax_accum.skip_not_finite
    ),
    "MultiSteps": lambda inner: optax_accum.MultiSteps(
        inner, every_k_schedule=K, should_skip_update_fn=optax_accum.skip_not_finite
    ).gradient_transformation(),
}


def _make_step(tx, period=2000):
    # The checkpointed state holds the scale's two arrays, not the jmp object:
    # Orbax rebuilds a pytree with placeholder leaves, which jmp's constructor
    # rejects, and jmp's unflatten drops `min_loss_scale` anyway.
    @jax.jit
    def step(state, batch):
        scale = state["loss_scale"]
        loss_scale = jmp.DynamicLossScale(
            scale["scale"], scale["counter"], period=period
        )
        out = GRAD_FN(loss_scale, state["params"], *batch)
        updates, opt_state = tx.update(out.grads, state["opt_state"], state["params"])
        new_state = {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "loss_scale": {
                "scale": out.loss_scale.loss_scale,
                "counter": out.loss_scale.counter,
            },
        }
        return new_state, updates, out

    return step


def _init(tx, scale=2.0**15):
    params = _params()
    return {
        "params": params,
        "opt_state": tx.init(params),
        "loss_scale": {"scale": jnp.float32(scale), "counter": jnp.int32(0)},
    }


@pytest.mark.parametrize("face", list(FACES))
def test_overflow_skips_exactly_that_micro_batch_and_halves_the_scale(face):
    tx = FACES[face](optax.sgd(1.0))
    step = _make_step(tx)
    good = [_batch(seed) for seed in range(K)]
    bad = _batch(0, overflow=True)

    # The same window without the bad micro-batch: the reference update.
    state = _init(tx)
    for batch in good:
        state, ref_updates, _ = step(state, batch)
    assert float(state["loss_scale"]["scale"]) == 2.0**15

    state = _init(tx)
    stream = [*good[:2], bad, *good[2:]]
    for i, batch in enumerate(stream):
        state, updates, out = step(state, batch)
        if i == 2:  # the bad micro-batch
            assert np.isfinite(float(out.value)), "the unscaled loss is finite"
            assert not bool(out.finite)
            assert bool(optax_accum.skip_not_finite(out.grads, 0, None)[0])
            assert float(state["loss_scale"]["scale"]) == 2.0**14
        elif i < len(stream) - 1:
            assert bool(out.finite)
            assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
    assert float(state["loss_scale"]["scale"]) == 2.0**14
    # fp16 rounding of the gradients is the only allowed difference; the scale
    # is a power of two, so it is usually exact.
    chex.assert_trees_all_close(updates, ref_updates, rtol=1e-3, atol=1e-6)
    assert any(np.any(np.asarray(u)) for u in jax.tree.leaves(updates))

    # And it is the skip that saves the window: unskipped, the update is NaN.
    plain = optax_accum.accumulate(optax.sgd(1.0), K)
    plain_step = _make_step(plain)
    state = _init(plain)
    for batch in stream[:K]:
        state, updates, _ = plain_step(state, batch)
    assert not all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))


def test_scale_grows_after_period_finite_micro_batches():
    period = 3
    tx = FACES["accumulate"](optax.sgd(0.1))
    step = _make_step(tx, period)
    state = _init(tx, scale=2.0**10)
    scales = []
    # 3 finite (grow), 1 overflow (shrink, counter reset), 3 finite (grow).
    batches = [_batch(s) for s in range(3)] + [_batch(3, overflow=True)]
    batches += [_batch(s) for s in range(4, 7)]
    big = jnp.float32(1e4)  # overflows at 2**10 too: cotangent ~ 1e4 * 2**10 / 12
    batches[3] = (batches[3][0], batches[3][1].at[0, 0].set(big))
    for batch in batches:
        state, _, out = step(state, batch)
        scales.append(float(out.loss_scale.loss_scale))
    assert scales == [2.0**10, 2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**10, 2.0**11]
    assert int(state["opt_state"].num_skipped) == 1
    assert int(state["loss_scale"]["counter"]) == 0


@pytest.mark.slow
def test_loss_scale_survives_orbax_restart_mid_window_bit_for_bit(tmp_path):
    tx = FACES["accumulate"](optax.adam(1e-2))
    step = _make_step(tx, period=2)
    num_steps, stop_at = 13, 7
    batches = [_batch(s, overflow=s in (3, 9)) for s in range(num_steps)]

    def init():
        return _init(tx, scale=2.0**15)

    def run(state, batches):
        for batch in batches:
            state, _, _ = step(state, batch)
        return state

    reference = run(init(), batches)
    state = run(init(), batches[:stop_at])
    # Mid-window, after skips, with the scale grown, shrunk and grown again:
    # at 2**16 even the ordinary micro-batches overflow.
    assert int(state["opt_state"].micro_step) == 1
    assert int(state["opt_state"].num_skipped) == 2
    assert int(state["loss_scale"]["counter"]) == 1
    assert float(state["loss_scale"]["scale"]) == 2.0**15

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", state)
    del state
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(tmp_path / "ckpt", jax.eval_shape(init))
    restored = run(restored, batches[stop_at:])

    assert jax.tree.structure(restored) == jax.tree.structure(reference)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(reference), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(reference["opt_state"].num_skipped) == 4


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="`fun` must be callable, got 3"):
        optax_accum.scaled_value_and_grad(3)
    for argnums in ("0", 1.0, (), (0, "1"), True):
        with pytest.raises(TypeError, match="`argnums` must be an int"):
            optax_accum.scaled_value_and_grad(_loss, argnums=argnums)
    with pytest.raises(TypeError, match="`has_aux` must be a bool, got 1"):
        optax_accum.scaled_value_and_grad(_loss, has_aux=1)
    with pytest.raises(TypeError, match=r"`loss_scale` must have .*lacks \['adjust'\]"):
        no_adjust = types.SimpleNamespace(scale=lambda t: t, unscale=lambda t: t)
        GRAD_FN(no_adjust, _params(), *_batch(0))
    with pytest.raises(TypeError, match="`loss_scale` must have"):
        GRAD_FN(2.0**15, _params(), *_batch(0))


def test_has_aux_and_argnums():
    def loss(x, params, y):
        value = _loss(params, x, y)
        return value, {"twice": 2 * value}

    fn = optax_accum.scaled_value_and_grad(loss, argnums=(1,), has_aux=True)
    x, y = _batch(0)
    out = fn(jmp.DynamicLossScale(jnp.float32(2.0**8)), x, _params(), y)
    (value, aux), (grads,) = out.value, out.grads
    ref_value, ref_grads = jax.value_and_grad(_loss)(_params(), x, y)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-6)
    np.testing.assert_allclose(float(aux["twice"]), 2 * float(ref_value), rtol=1e-6)
    # The same fp16 computation, scaled by a power of two and unscaled.
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-2, atol=1e-4)
    assert bool(out.finite)


def test_devices_agree_on_the_scale_under_shard_map():
    # One device's rows overflow: with `axis_name`, every device skips the
    # micro-batch and halves its scale, and the scale stays replicated (an
    # out_spec of P() would reject a scale that differs between devices).
    from jax.sharding import PartitionSpec as P

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("batch",))
    tx = optax_accum.accumulate(
        optax.sgd(1.0), K, skip_fn=optax_accum.skip_not_finite, axis_name="batch"
    )
    grad_fn = optax_accum.scaled_value_and_grad(_loss, axis_name="batch")
    specs = optax_accum.state_specs(jax.eval_shape(tx.init, _params()), "batch")
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def body(params, opt_state, scale, x, y):
        loss_scale = jmp.DynamicLossScale(scale["scale"], scale["counter"])
        varying = jax.lax.pcast(params, "batch", to="varying")
        out = grad_fn(loss_scale, varying, x, y)
        updates, opt_state = tx.update(out.grads, opt_state, params)
        new_scale = {
            "scale": out.loss_scale.loss_scale,
            "counter": out.loss_scale.counter,
        }
        return optax.apply_updates(params, updates), opt_state, new_scale, out.finite

    step = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), specs, P(), P("batch"), P("batch")),
            out_specs=(P(), specs, P(), P()),
        )
    )

    def full_batch(seed, overflow_rows=None):
        parts = [_batch(seed * n + d) for d in range(n)]
        xs = jnp.concatenate([x for x, _ in parts])
        ys = jnp.concatenate([y for _, y in parts])
        if overflow_rows is not None:
            ys = ys.at[overflow_rows, 0].set(OVERFLOW_TARGET)
        return jax.device_put((xs, ys), jax.NamedSharding(mesh, P("batch")))

    good = [full_batch(s) for s in range(K)]
    bad = full_batch(K, overflow_rows=3 * 8)  # a row of device 3
    replicated = jax.NamedSharding(mesh, P())
    params = jax.device_put(_params(), replicated)
    opt_state = init(params)
    scale = {"scale": jnp.float32(2.0**15), "counter": jnp.int32(0)}
    scale = jax.device_put(scale, replicated)
    for i, batch in enumerate([*good[:2], bad, *good[2:]]):
        params, opt_state, scale, finite = step(params, opt_state, scale, *batch)
        assert bool(finite) == (i != 2)
    assert float(scale["scale"]) == 2.0**14
    assert int(opt_state.num_skipped) == 1
    assert int(opt_state.update_step) == 1

    # The same window on one device, without the bad micro-batch.
    ref_tx = FACES["accumulate"](optax.sgd(1.0))
    ref_step = _make_step(ref_tx)
    ref = _init(ref_tx)
    for batch in good:
        ref, _, _ = ref_step(ref, jax.device_get(batch))
    # fp16 sums each device's 8 rows, then the accumulator averages the devices
    # in float32; on one device fp16 sums all 64 rows: rounding of about 1e-3.
    ref_params = jax.device_get(ref["params"])
    chex.assert_trees_all_close(
        jax.device_get(params), ref_params, rtol=5e-3, atol=1e-6
    )


def _window(seeds, overflow_at=None, target=None):
    """K micro-batches of 8 rows stacked into one batch of 8 K rows, with the
    rows interleaved as microbatch splits them (micro-batch i: rows i, i+K, ...).
    Micro-batch ``overflow_at`` gets an overflowing target (``target``)."""
    parts = [_batch(s, overflow=(i == overflow_at)) for i, s in enumerate(seeds)]
    x = jnp.stack([p[0] for p in parts], axis=1).reshape(-1, 5)
    y = jnp.stack([p[1] for p in parts], axis=1).reshape(-1, 3)
    if overflow_at is not None and target is not None:
        y = y.at[overflow_at, 0].set(target)  # row overflow_at: its first row
    return x, y


def test_microbatch_of_scaled_value_and_grad_is_the_large_batch_step():
    loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**10), period=2000)
    params = _params()
    x, y = _window(range(K))
    fused = optax_accum.microbatch(
        lambda p, x, y: GRAD_FN(loss_scale, p, x, y), K, batch_argnums=(1, 2)
    )
    out = jax.jit(fused)(params, x, y)
    assert isinstance(out, optax_accum.ScaledGrads) and bool(out.finite)
    # The mean of the k micro-batches' scaled gradients, in float32 ...
    # (each compiled as the loop compiles it: fp16 rounding depends on fusion)
    grad_fn = jax.jit(GRAD_FN)
    parts = [grad_fn(loss_scale, params, *_batch(s)) for s in range(K)]
    mean = jax.tree.map(lambda *g: sum(g) / K, *[p.grads for p in parts])
    chex.assert_trees_all_close(out.grads, mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out.value, np.mean([p.value for p in parts]), rtol=1e-5)
    # ... and the loss scale adjusted once, as one large step adjusts it.
    assert int(out.loss_scale.counter) == 1
    assert float(out.loss_scale.loss_scale) == 2.0**10


def test_microbatch_of_scaled_value_and_grad_with_one_overflow():
    loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**15), jnp.int32(5))
    fused = optax_accum.microbatch(
        lambda p, x, y: GRAD_FN(loss_scale, p, x, y), K, batch_argnums=(1, 2)
    )
    out = jax.jit(fused)(_params(), *_window(range(K), overflow_at=2))
    assert not bool(out.finite)
    assert float(out.loss_scale.loss_scale) == 2.0**14
    assert int(out.loss_scale.counter) == 0


def _nnx_model():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            params = _params()
            self.w = nnx.Param(params["w"])
            self.b = nnx.Param(params["b"])

        def __call__(self, x):
            p = POLICY.cast_to_compute({"w": self.w[...], "b": self.b[...]})
            return jnp.tanh(POLICY.cast_to_compute(x) @ p["w"] + p["b"])

    return Model()


def test_nnx_train_step_with_loss_scaling_skips_an_overflowing_step():
    pytest.importorskip("flax")
    from flax import nnx

    from optax_accum.flax import nnx_train_step

    def loss_fn(model, x, y):
        return POLICY.cast_to_output(
            jnp.mean((model(x) - POLICY.cast_to_compute(y)) ** 2)
        )

    model = _nnx_model()
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    step = nnx_train_step(loss_fn, K, loss_scaling=True)

    # nnx.jit rebuilds its arguments' pytrees with placeholder leaves, which
    # jmp's constructor rejects: pass the scale's arrays, build it inside.
    @nnx.jit
    def train(model, optimizer, x, y, scale, counter):
        loss_scale = jmp.DynamicLossScale(scale, counter)
        loss, loss_scale = step(model, optimizer, x, y, loss_scale=loss_scale)
        return loss, loss_scale.loss_scale, loss_scale.counter

    # A good step updates the parameters as the mean gradient does.
    w0 = np.asarray(model.w[...])
    scale, counter = jnp.float32(2.0**15), jnp.int32(0)
    _, scale, counter = train(model, optimizer, *_window(range(K)), scale, counter)
    ref_scale = jmp.DynamicLossScale(jnp.float32(2.0**15))
    parts = [GRAD_FN(ref_scale, _params(), *_batch(s)) for s in range(K)]
    mean_w = sum(p.grads["w"] for p in parts) / K
    # fp16 compute: the model and the reference round differently.
    np.testing.assert_allclose(model.w[...], w0 - 0.5 * mean_w, rtol=2e-3, atol=1e-5)
    assert int(optimizer.step[...]) == 1 and float(scale) == 2.0**15
    # An overflowing micro-batch: nothing changes but the halved scale.
    before = jax.tree.map(np.asarray, nnx.state((model, optimizer)))
    bad = _window(range(K), overflow_at=1, target=1e4)
    _, scale, counter = train(model, optimizer, *bad, scale, counter)
    after = jax.tree.map(np.asarray, nnx.state((model, optimizer)))
    chex.assert_trees_all_equal(before, after)
    assert float(scale) == 2.0**14 and int(counter) == 0
    with pytest.raises(TypeError, match="loss_scale"):
        step(model, optimizer, *_window(range(K)))


def test_linen_train_step_with_loss_scaling_skips_an_overflowing_step():
    pytest.importorskip("flax")
    from flax.training import train_state

    from optax_accum.flax import linen_train_step

    def loss_fn(params, rng, x, y):
        del rng
        return _loss(params, x, y)

    state = train_state.TrainState.create(
        apply_fn=None, params=_params(), tx=optax.sgd(0.5)
    )
    step = linen_train_step(loss_fn, K, loss_scaling=True)

    @jax.jit
    def train(state, x, y, scale, counter):
        loss_scale = jmp.DynamicLossScale(scale, counter)
        state, _, loss_scale = step(state, x, y, loss_scale=loss_scale)
        return state, loss_scale.loss_scale, loss_scale.counter

    scale, counter = jnp.float32(2.0**15), jnp.int32(0)
    new, scale, counter = train(state, *_window(range(K)), scale, counter)
    assert int(new.step) == 1 and float(scale) == 2.0**15
    bad = _window(range(K), overflow_at=0, target=1e4)
    bad, scale, counter = train(new, *bad, scale, counter)
    chex.assert_trees_all_equal(bad.params, new.params)
    assert int(bad.step) == 1 and float(scale) == 2.0**14
