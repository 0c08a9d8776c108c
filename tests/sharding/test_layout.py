# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The layout module (`_sharding`) as the faces ask it: the data axes a batch
implies, specs compared, trees placed and resharded, varying casts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from optax_accum import _sharding


def _mesh():
    return jax.make_mesh((2, 2), ("data", "stage"), devices=jax.devices()[:4])


def test_batch_axes_follow_the_mesh_order_less_the_excluded():
    with jax.set_mesh(_mesh()):
        batch = {"x": jax.device_put(jnp.ones((8, 3)), P(("stage", "data")))}
        assert _sharding.batch_axes(batch) == ("data", "stage")
        assert _sharding.batch_axes(batch, exclude=("stage",)) == ("data",)
        assert _sharding.batch_axes({"x": jnp.ones(3)}) == ()


def test_same_spec_treats_every_spelling_of_replicated_alike():
    assert _sharding.same_spec(P(), P(None, None), 2)
    assert _sharding.same_spec(None, P(), 2)
    assert _sharding.same_spec(P("data"), P(("data",), None), 2)
    assert not _sharding.same_spec(P("data"), P(None, "data"), 2)


def test_reshard_to_and_like_place_leaves_as_asked():
    with jax.set_mesh(_mesh()):
        x = jax.device_put(jnp.ones((4, 2)), P("data"))
        same = _sharding.reshard_to(x, P(("data",), None))
        assert same is x  # already placed so: no reshard
        moved = _sharding.reshard_to({"x": x}, P("stage"))["x"]
        assert _sharding.same_spec(_sharding.explicit_spec(moved), P("stage"), 2)
        param = jax.device_put(jnp.ones((4, 2)), P(None, "stage"))
        grad = _sharding.reshard_like({"p": x}, {"p": param})["p"]
        assert _sharding.same_spec(_sharding.explicit_spec(grad), P(None, "stage"), 2)


def test_data_mesh_refuses_axes_that_shard_a_parameter():
    with jax.set_mesh(_mesh()):
        batch = jax.device_put(jnp.ones((4, 2)), P("data"))
        params = jax.device_put(jnp.ones((4, 2)), P("data"))
        assert _sharding.data_mesh(batch, jnp.ones(2), ("data",)).axis_names
        with pytest.raises(ValueError, match="no parameter"):
            _sharding.data_mesh(batch, params, ("data",))
        with pytest.raises(ValueError, match="not axes of the mesh"):
            _sharding.data_mesh(batch, (), ("model",))


def test_to_varying_and_is_manual_inside_shard_map():
    def body(x, w):
        assert _sharding.is_manual(("data",)) and not _sharding.is_manual(None)
        w = _sharding.to_varying({"w": w, "n": 3}, ("data",))
        assert "data" in jax.typeof(w["w"]).mat.varying and w["n"] == 3
        return x * w["w"]

    assert not _sharding.is_manual(("data",))
    with jax.set_mesh(_mesh()):
        x = jax.device_put(jnp.ones((4,)), P("data"))
        f = jax.shard_map(body, in_specs=(P("data"), P()), out_specs=P("data"))
        assert f(x, jnp.float32(2.0)).shape == (4,)
