# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`microbatch` with sharded parameters.

The global view (the default) on every layout and axis type; the device-local
loop (``data_axes="data"``) where the data axis shards no parameter; FSDP
gathers per micro-batch; and the meaning of ``fun`` kept (row sums, small
micro-batches).
"""

from __future__ import annotations

import itertools

import chex
import jax
import pytest

import optax_accum
from tests.helpers import hlo as _hlo
from tests.helpers import layouts as L
from tests.helpers.lanes import sweep

K, ROWS = 4, 64


def _reference(row_sum=False):
    x, y = L.data(ROWS)
    return jax.value_and_grad(L.loss_fn(None, row_sum=row_sum))(L.params(), x, y)


def _in_loop_collectives(hlo, mesh, axis="data"):
    comps, _ = _hlo.computations(hlo)
    body = _hlo.reachable(comps, _hlo.while_bodies(comps))
    found = _hlo.collectives(comps, body, 8)
    return [c for c in found if _hlo.crosses(c[1], mesh, axis)]


def _run(layout, explicit, **kw):
    mesh = L.mesh(layout, explicit)
    named = kw.get("data_axes")
    manual = (named,) if isinstance(named, str) else ()
    loss = L.loss_fn(layout, explicit, manual=manual)
    fun = jax.jit(
        optax_accum.microbatch(jax.value_and_grad(loss), K, batch_argnums=(1, 2), **kw)
    )
    with jax.set_mesh(mesh):
        params = L.place(layout, mesh, L.params())
        x, y = L.place_batch(layout, mesh, *L.data(ROWS))
        out = fun(params, x, y)
        compiled = fun.lower(params, x, y).compile()
    return params, out, compiled, mesh


@pytest.mark.parametrize(
    ("layout", "explicit"),
    sweep(
        itertools.product(L.LAYOUTS, [True, False]),
        fast=[("fsdp", True), ("3d", False)],
    ),
)
def test_global_view_matches_full_batch_grads_sharded_like_params(layout, explicit):
    params, (value, grads), _, _ = _run(L.LAYOUTS[layout], explicit)
    chex.assert_trees_all_close(
        (value, jax.device_get(grads)), _reference(), rtol=1e-5, atol=1e-6
    )
    if explicit:
        for name, g in grads.items():
            assert g.sharding.is_equivalent_to(params[name].sharding, g.ndim)


@pytest.mark.parametrize(
    ("layout", "explicit"),
    sweep(
        itertools.product(["dp", "tp", "hsdp", "3d"], [True, False]),
        fast=[("hsdp", True)],
    ),
)
def test_device_local_over_the_data_axis_reduces_over_it_once(layout, explicit):
    layout = L.LAYOUTS[layout]
    _, (value, grads), compiled, mesh = _run(layout, explicit, data_axes="data")
    chex.assert_trees_all_close(
        (value, jax.device_get(grads)), _reference(), rtol=1e-5, atol=1e-6
    )
    # Collectives of the parameters' own sharding stay (FSDP gathers and
    # reduce-scatters over "fsdp", tensor-parallel ones over "model"); none
    # inside the loop crosses the data axis.
    assert _in_loop_collectives(compiled.as_text(), mesh) == []


def test_default_global_view_reduces_over_data_per_micro_batch():
    # What `data_axes="data"` saves: the compiler's per-micro-batch reduction.
    _, _, compiled, mesh = _run(L.LAYOUTS["dp"], True)
    assert _in_loop_collectives(compiled.as_text(), mesh)


def test_mesh_axes_naming_an_fsdp_axis_is_refused():
    with pytest.raises(ValueError, match=r"shard the batch but no parameter.*'w1'"):
        _run(L.LAYOUTS["fsdp"], True, data_axes="data")


def test_fsdp_gathers_per_micro_batch_by_default_or_once_on_request():
    layout = L.LAYOUTS["fsdp"]
    _, out, per_micro, _ = _run(layout, True)
    _, out_once, once, _ = _run(layout, True, param_gather="once")
    chex.assert_trees_all_close(
        jax.device_get(out), jax.device_get(out_once), rtol=1e-6
    )
    chex.assert_trees_all_close(jax.device_get(out), _reference(), rtol=1e-5, atol=1e-6)

    def gathers_in_loop(compiled):
        comps, _ = _hlo.computations(compiled.as_text())
        body = _hlo.reachable(comps, _hlo.while_bodies(comps))
        return [c for c in _hlo.collectives(comps, body, 8) if c[0] == "all-gather"]

    assert gathers_in_loop(per_micro)
    assert not gathers_in_loop(once)
    assert (
        per_micro.memory_analysis().temp_size_in_bytes
        < once.memory_analysis().temp_size_in_bytes
    )


def test_row_sum_fun_gets_the_global_answer():
    # optax's sharded microbatching test, ported: a sum over rows must not
    # become a sum over one device's rows.
    mesh = L.mesh(L.LAYOUTS["dp"])
    loss = L.loss_fn(L.LAYOUTS["dp"], row_sum=True)
    fun = jax.jit(
        optax_accum.microbatch(
            jax.value_and_grad(loss), K, batch_argnums=(1, 2), reduction="sum"
        )
    )
    with jax.set_mesh(mesh):
        p = L.place(L.LAYOUTS["dp"], mesh, L.params())
        x, y = L.place_batch(L.LAYOUTS["dp"], mesh, *L.data(ROWS))
        value, grads = fun(p, x, y)
    chex.assert_trees_all_close(
        (value, jax.device_get(grads)), _reference(row_sum=True), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("rows", sweep([2, 4], fast=[2]))
def test_micro_batches_smaller_than_the_device_count(rows):
    # Levanter's case: micro-batches of 2 or 4 rows on 8 devices.
    # The loss names no row sharding: 2 rows cannot be spread over 8 devices.
    layout = L.LAYOUTS["dp"]
    mesh = L.mesh(layout)
    loss = L.loss_fn(None)
    fun = jax.jit(
        optax_accum.microbatch(jax.value_and_grad(loss), K, batch_argnums=(1, 2))
    )
    x, y = L.data(rows * K)
    with jax.set_mesh(mesh):
        p = L.place(layout, mesh, L.params())
        xs, ys = L.place_batch(layout, mesh, x, y)
        value, grads = fun(p, xs, ys)
    ref = jax.value_and_grad(L.loss_fn(None))(L.params(), x, y)
    chex.assert_trees_all_close(
        (value, jax.device_get(grads)), ref, rtol=1e-5, atol=1e-6
    )


def test_param_gather_is_checked():
    with pytest.raises(ValueError, match="`param_gather`"):
        optax_accum.microbatch(lambda p, b: (0.0, p), 2, param_gather="always")


def test_carry_is_sharded_like_the_parameters():
    # 3-D mesh: the carry of a (fsdp, model)-sharded weight is 1/4 of it per
    # device; temp memory stays below a replicated carry's.
    layout = L.LAYOUTS["3d"]
    _, _, compiled, _ = _run(layout, True)
    text = compiled.as_text()
    comps, _ = _hlo.computations(text)
    # The while loop's carry tuple holds the w1 accumulator as f32[4,8]
    # (8x16 split over fsdp=2 and model=2), never f32[8,16].
    loops = [line for lines in comps.values() for line in lines if " while(" in line]
    assert loops and all("f32[8,16]" not in line for line in loops), loops


def test_global_view_with_unplaced_params_next_to_a_sharded_batch():
    # Parameters left on one device, batch sharded on an Explicit mesh, no
    # jax.set_mesh: the loop places them replicated on the batch's mesh.
    mesh = L.mesh(L.LAYOUTS["dp"])
    fun = jax.jit(
        optax_accum.microbatch(
            jax.value_and_grad(L.loss_fn(None)), K, batch_argnums=(1, 2)
        )
    )
    x, y = L.place_batch(L.LAYOUTS["dp"], mesh, *L.data(ROWS))
    value, grads = fun(L.params(), x, y)
    chex.assert_trees_all_close(
        (value, jax.device_get(grads)), _reference(), rtol=1e-5, atol=1e-6
    )
