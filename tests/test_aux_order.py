# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""``aux_order="batch"``: row-wise ``aux`` in the batch's own row order (issue 33, §7).

By default ``aux`` comes back stacked ``(k, B/k, ...)`` with micro-batch ``i``
holding rows ``i::k``, so a plain reshape pairs per-example outputs with the
wrong labels. With ``aux_order="batch"`` the row-wise leaves equal ``fun`` on
the whole batch, row for row; statistics stay stacked per micro-batch. The
Flax steps' version, with the NNX tutorial's metrics line, is in
``tests/flax/test_steps.py``.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from tests.helpers.lanes import sweep

B = 24


def _loss(w, x):
    out = x @ w  # per-row outputs
    return jnp.mean(out**2), {"rows": out, "mean": jnp.mean(out)}


def _data():
    return jax.random.normal(jax.random.key(0), (B, 3)), jnp.ones((3, 2))


def _faces(k, **kw):
    vg = jax.value_and_grad(_loss, has_aux=True)
    return {
        "microbatch": optax_accum.microbatch(vg, k, has_aux=True, **kw),
        "value_and_grad": optax_accum.microbatch_value_and_grad(
            _loss, k, has_aux=True, **kw
        ),
    }


@pytest.mark.parametrize("k", sweep([1, 2, 3, 4, 6], fast=[4]))
def test_row_leaves_equal_the_whole_batch_rows(k):
    x, w = _data()
    _, want = _loss(w, x)
    for name, fun in _faces(k, aux_order="batch").items():
        (_, aux), _ = jax.jit(fun)(w, x)
        assert aux["rows"].shape == (B, 2), name
        np.testing.assert_allclose(aux["rows"], want["rows"], rtol=1e-6, err_msg=name)
        # A statistic stays one entry per micro-batch.
        means = [float(_loss(w, x[i::k])[1]["mean"]) for i in range(k)]
        np.testing.assert_allclose(aux["mean"], means, rtol=1e-5, err_msg=name)


def test_default_order_is_unchanged_and_a_plain_reshape_mispairs():
    x, w = _data()
    k = 4
    (_, aux), _ = _faces(k)["value_and_grad"](w, x)
    assert aux["rows"].shape == (k, B // k, 2)
    want = x @ w
    np.testing.assert_allclose(aux["rows"][1], want[1::k], rtol=1e-6)
    assert not np.allclose(aux["rows"].reshape(B, 2), want)


def test_aux_rows_says_which_leaves_are_rows():
    # `feature` is a per-feature mean exactly as long as a micro-batch (B/k = 3).
    def loss(w, x):
        return jnp.mean((x @ w) ** 2), {"rows": x @ w, "feature": jnp.mean(x, 0)}

    x, w = _data()
    k = B // 3
    fun = optax_accum.microbatch_value_and_grad(
        loss,
        k,
        has_aux=True,
        aux_order="batch",
        aux_rows={"rows": True, "feature": False},
    )
    (_, aux), _ = fun(w, x)
    np.testing.assert_allclose(aux["rows"], x @ w, rtol=1e-6)
    np.testing.assert_allclose(aux["feature"][2], jnp.mean(x[2::k], 0), rtol=1e-6)
    # Left undeclared, a leaf as long as a micro-batch is taken as rows.
    undeclared = optax_accum.microbatch_value_and_grad(
        loss, k, has_aux=True, aux_order="batch"
    )
    chex.assert_shape(jax.eval_shape(undeclared, w, x)[0][1]["feature"], (B,))
    # Declared rows must be as long as a micro-batch.
    five = optax_accum.microbatch_value_and_grad(
        lambda w, x: (jnp.mean(x @ w), {"feature": jnp.zeros(5)}),
        k,
        has_aux=True,
        aux_order="batch",
        aux_rows=True,
    )
    with pytest.raises(ValueError, match=r"aux_rows.*\['feature'\]"):
        jax.eval_shape(five, w, x)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("local", [False, True])
def test_rows_on_a_mesh_come_back_in_batch_order(local, axis_type):
    x, w = _data()
    mesh = jax.make_mesh((2,), ("data",), axis_types=(axis_type,))
    local_kw = {"data_axes": "data", "aux_rows": {"rows": True, "mean": False}}
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        fun = optax_accum.microbatch_value_and_grad(
            _loss, 3, has_aux=True, aux_order="batch", **(local_kw if local else {})
        )
        (_, aux), _ = jax.jit(fun)(w, xs)
    np.testing.assert_allclose(aux["rows"], x @ w, rtol=1e-6)
    assert aux["mean"].shape == (3,)


def test_bad_aux_order_is_refused_by_name():
    with pytest.raises(ValueError, match=r"`aux_order`.*'rows'"):
        _faces(2, aux_order="rows")
    with pytest.raises(ValueError, match="`aux_rows`"):
        optax_accum.microbatch_value_and_grad(
            _loss, 2, aux_order="batch", aux_rows=True
        )
