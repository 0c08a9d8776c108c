# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`privacy.clipped_value_and_grad` against a float64 per-example reference
and against ``jax_privacy.clipping.clipped_grad``; its sensitivity, masks,
splits, dtypes and errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_accum import privacy
from tests.helpers.lanes import sweep

from .reference import clipped_sum, data, loss

C = 1.0


def _close(tree, ref, rtol=1e-5, atol=1e-6):
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("k", sweep([1, 2, 4, 16], fast=[4]))
@pytest.mark.parametrize("masked", [False, True])
def test_matches_float64_reference(k, masked):
    params, x, y = data(rows=16)
    mask = np.arange(16) % 3 != 1 if masked else None
    mask_fn = None
    if masked:
        x[~mask] = np.nan  # padding rows contribute exactly zero, NaN or not
        mask_fn = lambda x, y: jnp.all(jnp.isfinite(x), axis=1)
    vg = privacy.clipped_value_and_grad(
        loss, C, k, batch_argnums=(1, 2), example_mask_fn=mask_fn
    )
    value, grads = jax.jit(vg)(params, x, y)
    ref_value, ref_grads = clipped_sum(params, np.nan_to_num(x), y, C, mask)
    _close(grads, ref_grads)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    assert grads["w"].dtype == jnp.float32


def test_equals_jax_privacy_clipped_grad():
    from jax_privacy.clipping import clipped_grad

    params, x, y = data(rows=16, scale=3.0)
    theirs = clipped_grad(loss, l2_clip_norm=C, batch_argnums=(1, 2))(params, x, y)
    for k in (1, 4):
        ours = privacy.clipped_value_and_grad(loss, C, k, batch_argnums=(1, 2))
        _close(ours(params, x, y)[1], jax.tree.map(np.asarray, theirs))
    # padded: ours on the padded batch, theirs on the real rows only
    mask = np.arange(16) < 11
    ours = privacy.clipped_value_and_grad(
        loss, C, 4, batch_argnums=(1, 2),
        example_mask_fn=lambda x, y: y < 100,
    )  # fmt: skip
    y_pad = np.where(mask, y, 1e3).astype(np.float32)
    theirs = clipped_grad(loss, l2_clip_norm=C, batch_argnums=(1, 2))(
        params, x[mask], y[mask]
    )
    _close(ours(params, x, y_pad)[1], jax.tree.map(np.asarray, theirs))


def _sum(params, x, y, k=1):
    vg = privacy.clipped_value_and_grad(loss, C, k, batch_argnums=(1, 2))
    return np.concatenate([np.ravel(g) for g in jax.tree.leaves(vg(params, x, y)[1])])


@pytest.mark.parametrize("scale", [1.0, 1e6])
def test_one_example_changes_the_sum_by_at_most_c(scale):
    params, x, y = data(rows=8)
    big_x = np.full((1, 3), scale, np.float32)
    big_y = np.array([-scale], np.float32)
    with_it = _sum(params, np.concatenate([x, big_x]), np.concatenate([y, big_y]), 1)
    without = _sum(params, x, y)
    assert np.linalg.norm(with_it - without) <= C * (1 + 1e-5)
    assert np.linalg.norm(with_it - without) >= 0.99 * C  # it was clipped, not lost
    # removing a real example
    fewer = _sum(params, x[1:], y[1:])
    assert np.linalg.norm(without - fewer) <= C * (1 + 1e-5)


def test_split_does_not_change_the_sum():
    params, x, y = data(rows=32, scale=2.0)
    sums = [_sum(params, x, y, k) for k in (1, 2, 4, 8, 32)]
    for s in sums[1:]:
        np.testing.assert_allclose(s, sums[0], rtol=1e-5, atol=1e-6)


def test_padded_batch_equals_unpadded():
    params, x, y = data(rows=12)
    xp = np.concatenate([x, np.full((4, 3), np.inf, np.float32)])
    yp = np.concatenate([y, np.zeros(4, np.float32)])
    vg = privacy.clipped_value_and_grad(
        loss, C, 4, batch_argnums=(1, 2),
        example_mask_fn=lambda x, y: jnp.all(jnp.isfinite(x), axis=1),
    )  # fmt: skip
    value, grads = vg(params, xp, yp)  # the last micro-batch is all padding...
    ref_value, ref = privacy.clipped_value_and_grad(loss, C, 3, batch_argnums=(1, 2))(
        params, x, y
    )
    _close(grads, jax.tree.map(np.asarray, ref))
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    # ... rows 3, 7, 11, 15 are micro-batch 3: rows 12-15 spread over all four
    mask_all = lambda x, y: jnp.zeros(x.shape[0], bool)
    vg = privacy.clipped_value_and_grad(
        loss, C, 4, batch_argnums=(1, 2), example_mask_fn=mask_all
    )
    value, grads = vg(params, xp, yp)
    assert float(value) == 0.0
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads))


def test_non_finite_gradient_entries_are_zeroed_as_jax_privacy():
    params, x, y = data(rows=4)
    x[1, 0] = np.inf
    vg = privacy.clipped_value_and_grad(loss, C, 2, batch_argnums=(1, 2))
    _, grads = vg(params, x, y)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_has_aux_is_per_example_in_row_order():
    params, x, y = data(rows=8)

    def loss_aux(p, x, y):
        return loss(p, x, y), {"y": y[0] * 2}

    mask = np.arange(8) != 5
    vg = privacy.clipped_value_and_grad(
        loss_aux, C, 4, batch_argnums=(1, 2), has_aux=True,
        example_mask_fn=lambda x, y: jnp.isin(y, y_real),
    )  # fmt: skip
    y_real = jnp.asarray(y[mask])
    (value, aux), grads = vg(params, x, y)
    np.testing.assert_array_equal(aux["y"], np.where(mask, 2 * y, 0))  # padding: 0
    ref_value, ref = clipped_sum(params, x, y, C, mask)
    _close(grads, ref)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)


def test_non_batch_arguments_reach_every_example():
    params, x, y = data(rows=8)
    vg = privacy.clipped_value_and_grad(
        lambda p, scale, x, y: scale * loss(p, x, y), C, 2, batch_argnums=(2, 3)
    )
    _, grads = vg(params, jnp.float32(1.0), x, y)
    _close(grads, clipped_sum(params, x, y, C)[1])


@pytest.mark.parametrize(
    "dtype, rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2), (jnp.float16, 2e-3)]
)
def test_dtypes_sum_in_float32(dtype, rtol):
    params, x, y = data(rows=16)
    p = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
    vg = privacy.clipped_value_and_grad(loss, C, 4, batch_argnums=(1, 2))
    value, grads = jax.jit(vg)(p, jnp.asarray(x, dtype), jnp.asarray(y, dtype))
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    assert value.dtype == jnp.float32
    ref_params = jax.tree.map(lambda a: np.asarray(jnp.asarray(a, dtype)), params)
    xr, yr = (np.asarray(jnp.asarray(a, dtype)) for a in (x, y))
    _close(grads, clipped_sum(ref_params, xr, yr, C)[1], rtol=rtol, atol=rtol)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_clip_norm(bad):
    with pytest.raises(ValueError, match=r"`l2_clip_norm`.*" + str(bad)[:3]):
        privacy.clipped_value_and_grad(loss, bad)


def test_bad_arguments():
    with pytest.raises(TypeError, match="`l2_clip_norm`"):
        privacy.clipped_value_and_grad(loss, "1.0")
    with pytest.raises(TypeError, match="`loss`"):
        privacy.clipped_value_and_grad(None, 1.0)
    with pytest.raises(ValueError, match="`num_microbatches` must be >= 1, got 0"):
        privacy.clipped_value_and_grad(loss, 1.0, 0)
    with pytest.raises(ValueError, match="`batch_argnums` must not include 0"):
        privacy.clipped_value_and_grad(loss, 1.0, batch_argnums=(0, 1))
    with pytest.raises(TypeError, match="`example_mask_fn`"):
        privacy.clipped_value_and_grad(loss, 1.0, example_mask_fn=3)
    params, x, y = data(rows=6)
    with pytest.raises(ValueError, match=r"`num_microbatches`=4 must divide .* 6"):
        privacy.clipped_value_and_grad(loss, 1.0, 4, batch_argnums=(1, 2))(params, x, y)
    with pytest.raises(ValueError, match="leading sizes"):
        privacy.clipped_value_and_grad(loss, 1.0, batch_argnums=(1, 2))(
            params, x, y[:5]
        )
    with pytest.raises(ValueError, match="`batch_argnums` index 3"):
        privacy.clipped_value_and_grad(loss, 1.0, batch_argnums=(1, 3))(params, x, y)
    bad_mask = privacy.clipped_value_and_grad(
        loss, 1.0, batch_argnums=(1, 2), example_mask_fn=lambda x, y: y
    )
    with pytest.raises(ValueError, match="`example_mask_fn` must return one boolean"):
        bad_mask(params, x, y)
    with pytest.raises(TypeError, match=r"`params`\['n'\] has dtype int32"):
        privacy.clipped_value_and_grad(
            lambda p, x, y: loss(p, x, y), 1.0, batch_argnums=(1, 2)
        )({**params, "n": jnp.int32(1)}, x, y)
    with pytest.raises(TypeError, match="`num_microbatches` must be an integer"):
        privacy.clipped_value_and_grad(loss, 1.0, 2.5)
    with pytest.raises(TypeError, match=r"\(value, aux\), got an array of shape \(\)"):
        privacy.clipped_value_and_grad(
            loss, 1.0, batch_argnums=(1, 2), has_aux=True
        )(params, x, y)  # fmt: skip
    with pytest.raises(TypeError, match="real floating scalar"):
        privacy.clipped_value_and_grad(
            lambda p, x: x @ p["w"], 1.0
        )(params, x)  # fmt: skip


def test_all_padding_microbatches_are_not_computed():
    seen = []

    def counting_loss(p, x, y):
        jax.debug.callback(lambda x: seen.append(np.shape(x)[0]), x)
        return loss(p, x, y)

    params, x, y = data(rows=16)
    real = np.arange(16) % 4 < 2  # micro-batches 0 and 1 real, 2 and 3 padding
    vg = jax.jit(
        privacy.clipped_value_and_grad(
            lambda p, x, y, m: counting_loss(p, x, y), C, 4, batch_argnums=(1, 2, 3),
            example_mask_fn=lambda x, y, m: m,
        )
    )  # fmt: skip
    _, grads = vg(params, x, y, real)
    jax.effects_barrier()
    assert sum(seen) == 8  # the 8 rows of the two real micro-batches only
    _close(grads, clipped_sum(params, x, y, C, real)[1])


def test_a_key_per_row_as_a_batch_argument():
    params, x, y = data(rows=8)

    def dropout_loss(p, x, y, keys):
        keep = jax.random.bernoulli(keys[0], 0.5, x.shape)
        return loss(p, jnp.where(keep, x, 0), y)

    keys = jax.random.split(jax.random.key(0), 8)
    vg = privacy.clipped_value_and_grad(dropout_loss, C, 2, batch_argnums=(1, 2, 3))
    _, grads = jax.jit(vg)(params, x, y, keys)
    kept = np.stack(
        [np.asarray(jax.random.bernoulli(keys[i], 0.5, (1, 3)))[0] for i in range(8)]
    )
    _close(grads, clipped_sum(params, np.where(kept, x, 0), y, C)[1])


def test_a_batch_sized_argument_outside_batch_argnums_is_refused():
    # Issue 39, finding 6: loss(params, x, y) with the default batch_argnums=1
    # left y whole, so every example saw every label: one changed label moved
    # the clipped sum by 12.45.
    params, x, y = data(rows=8)
    with pytest.raises(
        ValueError, match=r"argument 2 of `loss` .* `batch_argnums=\(1, 2\)`"
    ):
        privacy.clipped_value_and_grad(loss, C)(params, x, y)
    with pytest.raises(ValueError, match=r"argument 1\['y'\] of `loss`"):
        privacy.clipped_value_and_grad(
            lambda p, d, x: loss(p, x, d["y"]), C, batch_argnums=2
        )(params, {"y": y}, x)  # fmt: skip
    # the fix the message gives
    _close(
        privacy.clipped_value_and_grad(loss, C, batch_argnums=(1, 2))(params, x, y)[1],
        clipped_sum(params, x, y, C)[1],
    )
    # a table that every example should see whole, declared so
    table = jnp.full(8, 1 / 8, jnp.float32)  # sums to 1
    vg = privacy.clipped_value_and_grad(
        lambda p, x, t: jnp.sum(t) * loss(p, x, jnp.zeros(1)), C, shared_argnums=2
    )
    _close(vg(params, x, table)[1], clipped_sum(params, x, np.zeros(8), C)[1])
    with pytest.raises(ValueError, match="`shared_argnums` must not include"):
        privacy.clipped_value_and_grad(loss, C, batch_argnums=(1, 2), shared_argnums=2)


def test_batch_arguments_sharded_differently_over_the_rows():
    """Rows sharded over ``data`` beside a mask built in the step (replicated):
    the per-example ``vmap`` needs one spec for the rows, so the wing lays
    them alike (the audit's sharded case failed with "Mapped away dimension
    ... should be sharded the same")."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    w = jnp.linspace(-1.0, 1.0, 4)
    x = jax.random.normal(jax.random.key(0), (16, 4))

    def masked_loss(w, x, m):
        del m
        return jnp.sum(jnp.tanh(x @ w))

    vg = privacy.clipped_value_and_grad(
        masked_loss, 0.5, 2, batch_argnums=(1, 2), example_mask_fn=lambda x, m: m
    )
    mask = jnp.arange(16) < 13
    want = vg(w, x, mask)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        got = jax.jit(lambda w, x: vg(w, x, jnp.arange(16) < 13))(w, xs)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
