# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`accumulate` and `MultiSteps` with sharded parameters.

Layouts: replicated data parallel, FSDP, tensor parallel, HSDP and a 3-D mesh,
under Explicit and Auto axis types, against the single-device full batch.
"""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import optax_accum
from tests.helpers import hlo as _hlo
from tests.helpers import layouts as L
from tests.helpers.lanes import sweep

K, WINDOWS, ROWS = 3, 2, 16


def _reference(inner, loss, params, xs, ys):
    state = inner.init(params)
    for w in range(WINDOWS):
        g = jax.grad(loss)(
            params, xs[w].reshape(-1, L.D_IN), ys[w].reshape(-1, L.D_OUT)
        )
        u, state = inner.update(g, state, params)
        params = optax.apply_updates(params, u)
    return params


def _windows():
    x, y = L.data(WINDOWS * K * ROWS)
    return x.reshape(WINDOWS, K, ROWS, -1), y.reshape(WINDOWS, K, ROWS, -1)


def _run(layout, explicit, make_tx, defer=False):
    """Trains WINDOWS windows of K micro-batches; returns params, state, step."""
    mesh = L.mesh(layout, explicit)
    tx = make_tx()
    loss = L.loss_fn(layout, explicit, deferred=defer)
    xs, ys = _windows()
    with jax.set_mesh(mesh):
        params = L.place(layout, mesh, L.params())
        if explicit:
            state = jax.jit(tx.init)(params)
        else:
            shardings = optax_accum.state_shardings(tx, params)
            state = jax.jit(tx.init, out_shardings=shardings)(params)

        @jax.jit
        def step(p, s, x, y):
            q = optax_accum.defer_reduction(p, layout.batch) if defer else p
            g = jax.grad(loss)(q, x, y)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        for w in range(WINDOWS):
            for i in range(K):
                x, y = L.place_batch(layout, mesh, xs[w, i], ys[w, i])
                params, state = step(params, state, x, y)
        hlo = step.lower(params, state, x, y).compile().as_text()
    return params, state, hlo, mesh


def _accumulator(state):
    return state.accumulator if hasattr(state, "accumulator") else state.acc_grads


FACES = {
    "accumulate": lambda **kw: optax_accum.accumulate(optax.adam(1e-2), K, **kw),
    "MultiSteps": lambda **kw: optax_accum.MultiSteps(optax.adam(1e-2), K, **kw),
}


@pytest.mark.parametrize(
    ("face", "layout", "explicit"),
    sweep(
        itertools.product(FACES, L.LAYOUTS, [True, False]),
        fast=[("accumulate", "fsdp", True), ("MultiSteps", "tp", False)],
    ),
)
def test_matches_full_batch_with_accumulator_sharded_like_params(
    face, layout, explicit
):
    layout = L.LAYOUTS[layout]
    params, state, _, _ = _run(layout, explicit, FACES[face])
    ref = _reference(optax.adam(1e-2), L.loss_fn(None), L.params(), *_windows())
    chex.assert_trees_all_close(jax.device_get(params), ref, rtol=1e-5, atol=1e-6)
    acc = _accumulator(state)
    for name, a in acc.items():
        p = params[name]
        assert a.sharding.spec == p.sharding.spec, (name, a.sharding, p.sharding)
        # Per-device bytes: the parameter's (both float32), never replicated.
        assert (
            a.addressable_shards[0].data.nbytes == p.addressable_shards[0].data.nbytes
        )


@pytest.mark.parametrize("layout", sweep(["dp", "tp", "hsdp", "3d"], fast=["hsdp"]))
def test_defer_reduction_all_reduces_over_data_once_in_the_boundary_branch(layout):
    layout = L.LAYOUTS[layout]
    make = lambda: optax_accum.accumulate(optax.adam(1e-2), K, data_axes=layout.batch)
    params, state, hlo, mesh = _run(layout, True, make, defer=True)
    ref = _reference(optax.adam(1e-2), L.loss_fn(None), L.params(), *_windows())
    chex.assert_trees_all_close(jax.device_get(params), ref, rtol=1e-5, atol=1e-6)
    for name, a in state.accumulator.items():
        assert "data" in a.sharding.spec.unreduced
        assert a.addressable_shards[0].data.nbytes == (
            params[name].addressable_shards[0].data.nbytes
        )
    comps, _ = _hlo.computations(hlo)
    branches = _hlo.reachable(comps, _hlo.branch_roots(comps))
    outside = _hlo.collectives(comps, set(comps) - branches, 8)
    inside = _hlo.collectives(comps, branches, 8)
    # Per micro-step, nothing crosses the pure data axis.
    assert not [c for c in outside if _hlo.crosses(c[1], mesh, "data")], outside
    assert [c for c in inside if _hlo.crosses(c[1], mesh, "data")], inside


def test_without_defer_each_micro_step_reduces_over_data():
    # The global-view default: jax.grad all-reduces every call (what
    # `defer_reduction` removes).
    layout = L.LAYOUTS["dp"]
    make = lambda: optax_accum.accumulate(optax.adam(1e-2), K)
    _, _, hlo, mesh = _run(layout, True, make)
    comps, _ = _hlo.computations(hlo)
    branches = _hlo.reachable(comps, _hlo.branch_roots(comps))
    outside = _hlo.collectives(comps, set(comps) - branches, 8)
    assert [c for c in outside if _hlo.crosses(c[1], mesh, "data")]


def test_hold_step_zeros_and_updates_keep_the_parameter_sharding():
    layout = L.LAYOUTS["3d"]
    mesh = L.mesh(layout)
    tx = optax_accum.accumulate(optax.adam(1e-2), 2)
    with jax.set_mesh(mesh):
        params = L.place(layout, mesh, L.params())
        state = jax.jit(tx.init)(params)
        grads = jax.tree.map(jnp.ones_like, params)
        u, state = jax.jit(tx.update)(grads, state, params)
        for name, x in u.items():
            assert x.sharding.spec == params[name].sharding.spec
            np.testing.assert_array_equal(np.asarray(x), 0.0)
        assert jax.typeof(state.inner_state[0].mu["w1"]).sharding.spec == P(
            "fsdp", "model"
        )


def test_gradient_sharding_mismatch_names_the_leaf_and_both_specs():
    layout = L.LAYOUTS["fsdp"]
    mesh = L.mesh(layout)
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    with jax.set_mesh(mesh):
        params = L.place(layout, mesh, L.params())
        state = jax.jit(tx.init)(params)
        grads = {n: jax.device_put(v, P()) for n, v in L.params().items()}
        msg = r"\['b1'\] has sharding P\(None,\).*P\('data',\)"
        with pytest.raises(ValueError, match=msg):
            jax.jit(tx.update)(grads, state, params)


def test_data_axes_need_unreduced_grads_and_vice_versa():
    layout = L.LAYOUTS["dp"]
    mesh = L.mesh(layout)
    loss = L.loss_fn(layout)
    with jax.set_mesh(mesh):
        params = L.place(layout, mesh, L.params())
        x, y = L.place_batch(layout, mesh, *L.data(16))
        deferred = optax_accum.accumulate(optax.sgd(1.0), 2, data_axes="data")
        state = jax.jit(deferred.init)(params)
        g = jax.jit(jax.grad(loss))(params, x, y)
        with pytest.raises(ValueError, match="defer_reduction"):
            jax.jit(deferred.update)(g, state, params)
        plain = optax_accum.accumulate(optax.sgd(1.0), 2)
        g = jax.jit(
            lambda p: jax.grad(loss)(optax_accum.defer_reduction(p, "data"), x, y)
        )(params)
        with pytest.raises(ValueError, match="data_axes"):
            jax.jit(plain.update)(g, jax.jit(plain.init)(params), params)


def test_defer_reduction_errors():
    with pytest.raises(ValueError, match="`data_axes`"):
        optax_accum.defer_reduction({"w": jnp.ones(2)}, "data")
    with pytest.raises(ValueError, match="not both"):
        optax_accum.accumulate(optax.sgd(1.0), 2, axis_name="d", data_axes="d")


def test_state_shardings_for_auto_mesh_init_and_restore_targets():
    layout = L.LAYOUTS["hsdp"]
    mesh = L.mesh(layout, explicit=False)
    tx = optax_accum.accumulate(optax.chain(optax.clip(1.0), optax.adamw(1e-3)), 4)
    with jax.set_mesh(mesh):
        params = L.place(layout, mesh, L.params())
        shardings = optax_accum.state_shardings(tx, params)
        state = jax.jit(tx.init, out_shardings=shardings)(params)
        # Without them the compiler replicates the zeros: 4x the bytes here.
        plain = jax.jit(tx.init)(params)
    w1 = params["w1"].addressable_shards[0].data.nbytes
    assert state.accumulator["w1"].addressable_shards[0].data.nbytes == w1
    assert state.inner_state[1][0].mu["w1"].sharding.spec == P("fsdp", None)
    assert state.micro_step.sharding.spec == P()
    assert plain.accumulator["w1"].addressable_shards[0].data.nbytes == 4 * w1
    # The same tree serves as restore targets (ShapeDtypeStructs with shardings).
    targets = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        jax.eval_shape(tx.init, params),
        shardings,
    )
    assert jax.tree.structure(targets) == jax.tree.structure(state)


def test_state_shardings_needs_placed_params():
    with pytest.raises(ValueError, match="`params`"):
        optax_accum.state_shardings(optax.sgd(1.0), {"w": np.ones(2)})


@pytest.mark.parametrize("explicit", sweep([True, False], fast=[True]))
def test_orbax_resume_mid_window_with_fsdp_params_is_bit_exact(tmp_path, explicit):
    ocp = pytest.importorskip("orbax.checkpoint")
    layout = L.LAYOUTS["hsdp"]
    mesh = L.mesh(layout, explicit)
    loss = L.loss_fn(layout, explicit)
    tx = optax_accum.accumulate(
        optax.adam(1e-2), K, skip_fn=optax_accum.skip_not_finite
    )
    xs, ys = _windows()
    batches = [(xs[w, i], ys[w, i]) for w in range(WINDOWS) for i in range(K)]
    stop = K + 1  # one micro-batch into the second window

    with jax.set_mesh(mesh):
        shardings = optax_accum.state_shardings(tx, L.place(layout, mesh, L.params()))

        @jax.jit
        def step(p, s, x, y):
            u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
            return optax.apply_updates(p, u), s

        def train(p, s, todo):
            for x, y in todo:
                p, s = step(p, s, *L.place_batch(layout, mesh, x, y))
            return p, s

        p0 = L.place(layout, mesh, L.params())
        s0 = jax.jit(tx.init, out_shardings=shardings)(p0)
        p_full, s_full = train(p0, s0, batches)

        p_half, s_half = train(p0, s0, batches[:stop])
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            (p_half, s_half),
        )
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp_path / "ckpt", (p_half, s_half))
        with ocp.StandardCheckpointer() as ckptr:
            p_r, s_r = ckptr.restore(tmp_path / "ckpt", abstract)
        assert s_r.accumulator["w1"].sharding.is_equivalent_to(p_r["w1"].sharding, 2)
        p_end, s_end = train(p_r, s_r, batches[stop:])
    for a, b in zip(
        jax.tree.leaves((p_full, s_full)), jax.tree.leaves((p_end, s_end)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
