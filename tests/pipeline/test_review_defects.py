# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Defects from review (issue 34 goal 6, issue 33 §3): each refused by name
or fixed, each pinned by a test that fails on the code before the fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import pipeline as pl
from tests.pipeline import models as md

FNS = (md.first_fn, md.stage_fn, md.loss_fn)


def _mesh(shape, names, auto=False):
    devices = jax.devices()[: int(jnp.prod(jnp.array(shape)))]
    kw = {"axis_types": (AxisType.Auto,) * len(shape)} if auto else {}
    return jax.make_mesh(shape, names, devices=devices, **kw)


def test_has_aux_with_a_scalar_loss_names_has_aux():
    params, batch = md.make(4, rows=8)
    vg = pl.value_and_grad(*FNS, 4, has_aux=True)
    with (
        jax.set_mesh(_mesh((4,), ("stage",))),
        pytest.raises(TypeError, match=r"`has_aux=True`.*\(loss, aux\)"),
    ):
        jax.eval_shape(vg, params, batch)


def test_complex_weight_is_refused_by_name():
    params, batch = md.make(4, rows=8)
    vg = pl.value_and_grad(*FNS, 4, weight_fn=lambda b: jnp.sum(b["mask"]) * (1 + 1j))
    with (
        jax.set_mesh(_mesh((4,), ("stage",))),
        pytest.raises(TypeError, match=r"`weight_fn` must return a real"),
    ):
        jax.eval_shape(vg, params, batch)


def test_real_weight_still_runs():
    params, batch = md.make(4, rows=16, ragged=True)
    vg = pl.value_and_grad(*FNS, 4, weight_fn=md.weight_fn, schedule="1f1b")
    with jax.set_mesh(_mesh((4,), ("stage",))):
        value, _ = jax.jit(vg)(params, batch)
    want = md.sequential(params, batch)
    assert jnp.allclose(value, want, rtol=1e-5)


def test_interleaved_with_one_repeat_is_refused():
    with pytest.raises(ValueError, match=r"`repeats` >= 2.*`schedule='1f1b'`"):
        pl.value_and_grad(*FNS, 4, schedule="interleaved_1f1b")
    pl.value_and_grad(*FNS, 4, schedule="interleaved_1f1b", repeats=2)


def test_rng_without_key_is_a_type_error_as_documented():
    doc = pl.value_and_grad.__doc__
    raises = doc.split("Raises:", 1)[1]
    type_error = raises.split("TypeError:", 1)[1]
    assert "does not take a key" in type_error
    params, batch = md.make(4, rows=8)
    vg = pl.value_and_grad(*FNS, 4)
    with (
        jax.set_mesh(_mesh((4,), ("stage",))),
        pytest.raises(TypeError, match=r"with `rng`, `stage_fn`"),
    ):
        jax.eval_shape(vg, params, batch, jax.random.key(0))


def test_auto_mesh_gradients_placed_like_parameters():
    """A first-params leaf placed ``P(None, "x")`` on an Auto mesh, ``x``
    the data axis: its gradient used to come back ``P()``."""
    mesh = _mesh((2, 4), ("x", "stage"), auto=True)
    params, batch = md.make(4, rows=16)
    fp, sp, lp = params
    fp = {"w": jax.device_put(fp["w"], NamedSharding(mesh, P(None, "x")))}
    batch = jax.device_put(batch, NamedSharding(mesh, P("x")))
    vg = pl.value_and_grad(*FNS, 4, schedule="1f1b", data_axes="x")
    with jax.set_mesh(mesh):
        value, grads = vg((fp, sp, lp), batch)
    assert grads[0]["w"].sharding.spec == P(None, "x")
    want_value, want = jax.value_and_grad(md.sequential)(params, batch)
    assert jnp.allclose(value, want_value, rtol=1e-5)
    assert md.max_rel_error(grads, want) < 1e-5
