# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The Gaussian mechanism on a window's sum: noise once, then normalise.

`add_noise` is the transformation `dp_accumulate` chains before ``inner``:
the accumulation engine calls it only on a boundary, on the window's sum
(already reduced over devices), so each logical batch gets exactly one draw.
The key is in the state; window ``t`` draws from ``fold_in(key, t)``, and leaf
``i`` of the gradient tree from ``fold_in(that, i)``, so a window's noise
depends on the key and the window's index only: not on how the window was
split into calls, not on the device count, not on the sharding. With JAX's
partitionable threefry (``jax_threefry_partitionable``, the default since JAX
0.5) each device draws its own shard of a sharded parameter's noise, with no
gather; the values do not depend on the sharding either way.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from .. import _dtypes, _sharding


class DPNoiseState(NamedTuple):
    """State of the noise step of `dp_accumulate`.

    Attributes:
      key: uint32, the raw data of the noise key (any checkpointer stores it;
        the key's implementation is part of the transformation).
      windows: int32, the windows noised so far: the next window draws from
        ``fold_in(key, windows)``.
    """

    key: jax.Array
    windows: jax.Array


def add_noise(
    stddev: float, expected_batch_size: float, key_data: jax.Array, impl: Any
) -> optax.GradientTransformation:
    """``(g + N(0, stddev^2)) / expected_batch_size``, a fresh draw per call."""

    def init_fn(params: optax.Params) -> DPNoiseState:
        del params
        # A copy: a step that donates the state must not delete the buffer of
        # the key the caller passed (or this closure's, which a later init
        # reads).
        key = jnp.array(key_data, copy=True)
        return DPNoiseState(key, jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        key = jax.random.fold_in(
            jax.random.wrap_key_data(state.key, impl=impl), state.windows
        )
        leaves, treedef = jax.tree.flatten(updates)
        noised = [
            _noised(g, _shard_key(jax.random.fold_in(key, i), g), stddev,
                    expected_batch_size)
            for i, g in enumerate(leaves)
        ]  # fmt: skip
        new_state = DPNoiseState(state.key, state.windows + 1)
        return jax.tree.unflatten(treedef, noised), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _batched(x: Any) -> bool:
    # jax.vmap's tracer; JAX exposes no public test for it.
    return type(x).__name__ == "BatchTracer"


def refuse_shared_key_under_vmap(updates: Any, key: Any) -> None:
    """``jax.vmap`` over ensemble members whose states share one key would
    give every member the same noise, and the difference of two members'
    updates would carry none (issue 39, finding 8)."""
    if _batched(key) or not any(_batched(g) for g in jax.tree.leaves(updates)):
        return
    raise ValueError(
        "`dp_accumulate` under `jax.vmap` with one noise key for every member: "
        "each would draw the same noise, and the difference of two members' "
        "updates would carry none. Map over states with a key each: e.g. "
        "`keys = jax.random.split(key, n)`, and each member's state with "
        "`state.inner_state[0].key` replaced by `jax.random.key_data(keys[i])` "
        "(or one `dp_accumulate` per member)."
    )


def _shard_key(key: jax.Array, g: Any) -> jax.Array:
    """The key of this device's part of leaf ``g``.

    Inside ``shard_map`` a leaf that varies over a manual axis (a tensor-
    parallel weight split over ``"model"``) holds other coordinates on each
    device of it: each folds in its index there and draws its own noise (one
    key for all would repeat the noise across the shards, and the difference
    of two shards' updates would carry no noise). Over the data axes the
    window's sum is reduced, so it varies over none of them: those devices
    draw the same noise, as they must to stay in step.
    """
    if not isinstance(g, jax.Array) and not hasattr(g, "aval"):
        return key
    for axis in sorted(jax.typeof(g).mat.varying):
        key = jax.random.fold_in(key, lax.axis_index(axis))
    return key


def _noised(g: Any, key: jax.Array, stddev: float, b: float) -> Any:
    if _dtypes.is_float0(g):
        return g
    dtype = _dtypes.compute(g.dtype)
    if stddev == 0:  # no noise: nothing to draw
        return (g.astype(dtype) / jnp.asarray(b, dtype)).astype(g.dtype)
    # On an Explicit mesh, the noise is typed with the gradient's sharding and
    # each device draws its own shard (threefry is partitionable); elsewhere
    # (an Auto mesh) XLA propagates the sharding from the add.
    sharding = None
    if _sharding.used_axes(_sharding.explicit_spec(g)):
        sharding = jax.typeof(g).sharding
    noise = _standard_normal(key, g.shape, dtype, sharding)
    out = (g.astype(dtype) + jnp.asarray(stddev, dtype) * noise) / jnp.asarray(b, dtype)
    return out.astype(g.dtype)


def _standard_normal(key: jax.Array, shape: tuple, dtype: Any, sharding: Any) -> Any:
    """Variance 1 on every real coordinate, complex entries included.

    The sensitivity is measured with a complex entry as two real coordinates
    (`_clip`), so each needs noise of the full variance. ``jax.random.normal``
    in a complex dtype puts variance 1/2 on each part (an entry of variance
    1): too little noise by sqrt(2) (issue 39, finding 1).
    """
    noise = jax.random.normal(key, shape, dtype, out_sharding=sharding)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        noise = noise * jnp.asarray(jnp.sqrt(2.0), _dtypes.real(dtype))
    return noise
