# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""A weight-0 (all-padding) micro-batch costs no compute in the fused loop.

It is skipped under `lax.cond` (issue 32, item 4), as
``optax.microbatching`` skips past ``num_real_microbatches``; the results are
unchanged: exactly the full batch's on the real rows, and its aux and state
as before (the loss face computes its forward pass alone for them).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_accum
from optax_accum._microbatch._grad import value_and_grad_with_state
from tests.helpers import hlo

K, MICRO, D = 4, 3, 5


def _loss(p, x, y, mask):
    """Token-mean squared error: 0/0 = NaN on an all-padding micro-batch."""
    err = jnp.sum((x @ p["w"] + p["b"] - y) ** 2, axis=-1)
    return jnp.sum(err * mask) / jnp.sum(mask)


def _loss_aux(p, x, y, mask):
    return _loss(p, x, y, mask), jnp.tanh(x @ p["w"])


def _count(x, y, mask):
    return jnp.sum(mask)


def _data(padded):
    """Micro-batch i holds rows i::K; the micro-batches in ``padded`` are
    all padding."""
    rng = np.random.default_rng(0)
    p = {
        "w": jnp.asarray(rng.normal(size=(D, 2)), jnp.float32),
        "b": jnp.zeros(2, jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(MICRO * K, D)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(MICRO * K, 2)), jnp.float32)
    mask = np.ones((MICRO, K), np.float32)
    mask[:, list(padded)] = 0
    mask[0, 1] = 0  # a real micro-batch with a padding row
    return p, x, y, jnp.asarray(mask.reshape(-1))


def _faces(has_aux=False):
    loss = _loss_aux if has_aux else _loss
    kw = dict(batch_argnums=(1, 2, 3), weight_fn=_count, has_aux=has_aux)
    return {
        "microbatch": optax_accum.microbatch(
            jax.value_and_grad(loss, has_aux=has_aux), K, **kw
        ),
        "loss": optax_accum.microbatch_value_and_grad(loss, K, **kw),
    }


@pytest.mark.parametrize("face", ["microbatch", "loss"])
@pytest.mark.parametrize("padded", [(), (3,), (0, 2), (1, 2, 3)])
def test_padding_micro_batches_leave_the_full_batch_result(face, padded):
    p, x, y, mask = _data(padded)
    value, grads = jax.jit(_faces()[face])(p, x, y, mask)
    real = np.asarray(mask) > 0
    ref_value, ref_grads = jax.value_and_grad(_loss)(p, x[real], y[real], mask[real])
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def _program(fun, *args) -> tuple[dict, str]:
    text = jax.jit(fun).lower(*args).compile().as_text()
    return hlo.computations(text)[0], text


_DOT = re.compile(r"\bdot\(")


@pytest.mark.parametrize("face", ["microbatch", "loss"])
def test_the_work_sits_in_a_branch_that_a_padding_micro_batch_skips(face):
    # Fails before the skip: the loop computed every micro-batch in full.
    p, x, y, mask = _data((3,))
    comps, _ = _program(_faces()[face], p, x, y, mask)
    branches = hlo.branch_roots(comps)
    assert len(branches) == 2, "one conditional: compute or skip"
    per_branch = {
        b: hlo.count(comps, hlo.reachable(comps, [b]), _DOT) for b in branches
    }
    assert sorted(per_branch.values())[0] == 0, per_branch  # skip: no dot
    assert sorted(per_branch.values())[1] >= 2, per_branch  # forward, weight grad
    outside = set(comps) - hlo.reachable(comps, branches)
    assert hlo.count(comps, outside, _DOT) == 0


def test_unweighted_loop_has_no_conditional():
    p, x, y, mask = _data(())
    fun = optax_accum.microbatch(jax.value_and_grad(_loss), K, batch_argnums=(1, 2, 3))
    comps, _ = _program(fun, p, x, y, mask)
    assert not hlo.branch_roots(comps)


def _big_copies(text: str, shape: str) -> int:
    return sum(1 for line in text.splitlines() if " copy(" in line and shape in line)


@pytest.mark.parametrize("face", ["microbatch", "loss"])
def test_the_conditional_adds_no_copy_of_a_weight_sized_buffer(face):
    # The carry goes through the conditional and is updated in place: no
    # more weight-sized copies than in the unweighted loop, which has none.
    vg = jax.value_and_grad(_loss)
    p = {"w": jnp.ones((64, 48)), "b": jnp.zeros(48)}
    x, y = jnp.ones((8 * K, 64)), jnp.ones((8 * K, 48))
    mask = jnp.ones(8 * K)
    kw = dict(batch_argnums=(1, 2, 3))
    plain = optax_accum.microbatch(vg, K, **kw)
    if face == "microbatch":
        skipping = optax_accum.microbatch(vg, K, weight_fn=_count, **kw)
    else:
        skipping = optax_accum.microbatch_value_and_grad(
            _loss, K, weight_fn=_count, **kw
        )
    base = _big_copies(_program(plain, p, x, y, mask)[1], "f32[64,48]")
    comps, text = _program(skipping, p, x, y, mask)
    assert hlo.branch_roots(comps)
    assert _big_copies(text, "f32[64,48]") <= base


def test_loss_face_gives_a_padding_micro_batch_its_aux():
    # The library's promise: aux[i] is micro-batch i's aux, weight 0 or not.
    p, x, y, mask = _data((1, 3))
    (_, aux), _ = jax.jit(_faces(has_aux=True)["loss"])(p, x, y, mask)
    want = jnp.stack([jnp.tanh(x[i::K] @ p["w"]) for i in range(K)])
    np.testing.assert_allclose(aux, want, rtol=1e-6)
    # and the loss face still skips the backward pass: one branch has fewer dots
    comps, _ = _program(_faces(has_aux=True)["loss"], p, x, y, mask)
    branches = hlo.branch_roots(comps)
    dots = sorted(hlo.count(comps, hlo.reachable(comps, [b]), _DOT) for b in branches)
    assert len(dots) == 2 and dots[0] < dots[1]


def test_microbatch_face_with_aux_computes_a_padding_micro_batch():
    # A value-and-grad `fun` gives its aux only from a whole call: no skip.
    p, x, y, mask = _data((2,))
    (_, aux), _ = jax.jit(_faces(has_aux=True)["microbatch"])(p, x, y, mask)
    want = jnp.stack([jnp.tanh(x[i::K] @ p["w"]) for i in range(K)])
    np.testing.assert_allclose(aux, want, rtol=1e-6)
    comps, _ = _program(_faces(has_aux=True)["microbatch"], p, x, y, mask)
    assert not hlo.branch_roots(comps)


def test_a_skipped_micro_batch_still_advances_the_state():
    # Threaded state (BatchNorm statistics, Rngs counters) sees every
    # micro-batch, as k small steps would.
    def loss(p, x, y, mask, *, state):
        return _loss(p, x, y, mask), state + jnp.sum(x)

    p, x, y, mask = _data((0, 3))
    fun = value_and_grad_with_state(loss, K, batch_argnums=(1, 2, 3), weight_fn=_count)
    (value, grads), state = jax.jit(fun)(p, x, y, mask, state=jnp.float32(0))
    np.testing.assert_allclose(state, jnp.sum(x), rtol=1e-5)
    real = np.asarray(mask) > 0
    ref = jax.value_and_grad(_loss)(p, x[real], y[real], mask[real])
    np.testing.assert_allclose(value, ref[0], rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref[1]), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    comps, _ = _program(lambda *a: fun(*a, state=jnp.float32(0)), p, x, y, mask)
    assert hlo.branch_roots(comps)


def test_a_padding_micro_batch_under_noise_scale_keeps_the_statistics():
    p, x, y, mask = _data((1,))
    kw = dict(batch_argnums=(1, 2, 3), weight_fn=_count, noise_scale_decay=0.9)
    fun = optax_accum.microbatch_value_and_grad(_loss, K, **kw)
    (_, _), tracker = jax.jit(fun)(p, x, y, mask)
    # Three real micro-batches are observed; the padding one is not counted,
    # as a weight of 0 never was.
    total = float(jnp.sum(mask))
    np.testing.assert_allclose(tracker.b_big, total, rtol=1e-6)
    np.testing.assert_allclose(tracker.b_small, total / 3, rtol=1e-6)
    assert np.isfinite(tracker.last_grad_sq) and np.isfinite(tracker.last_trace)


def test_on_a_mesh_the_loop_keeps_the_plain_add():
    # There the compiler reduces each micro-batch's gradients in the loop; a
    # conditional would keep XLA from moving that reduction out of it.
    p, x, y, mask = _data((3,))
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):
        comps, _ = _program(_faces()["loss"], p, x, y, mask)
    assert not hlo.branch_roots(comps)
