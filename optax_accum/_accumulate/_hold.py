# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""What a hold step emits: exact zeros typed as the boundary's outputs.

The boundary's ``lax.cond`` (or its loop on GPU) demands that both branches
agree on shapes, dtypes and, inside ``shard_map``, the manual axes each leaf
varies over; the zeros are written so that XLA neither merges nor copies them
(`_compiler.distinct_zeros`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compiler, _dtypes, _sharding


def zeros_like(a: jax.Array) -> jax.Array:
    """Zeros typed as ``a``: its sharding and the manual axes it varies over
    (a per-device accumulator inside ``shard_map``), as a cond output must."""
    return _sharding.match_varying(jnp.zeros_like(a), a)


def updates(shapes: Any, counter: jax.Array, emitted: Any) -> Any:
    """Zero updates with the boundary's shapes and dtypes (``shapes``), varying
    over the manual axes its updates vary over (``emitted``, from
    ``eval_shape`` of the boundary): inside ``shard_map`` a tensor-parallel
    leaf's update varies over the model axis once the data axes are reduced,
    and the branches must agree on it."""
    return jax.tree.map(_varying_like, _zeros(shapes, counter), emitted)


def _zeros(shapes: Any, counter: jax.Array) -> Any:
    float0 = [s.dtype == jax.dtypes.float0 for s in jax.tree.leaves(shapes)]
    if not any(float0):
        return _compiler.distinct_zeros(shapes, counter)
    leaves, treedef = jax.tree.flatten(shapes)
    zeros = _compiler.distinct_zeros(
        [s for s, f in zip(leaves, float0, strict=True) if not f], counter
    )
    it = iter(zeros)
    return jax.tree.unflatten(
        treedef,
        [
            np.zeros(s.shape, jax.dtypes.float0) if f else next(it)
            for s, f in zip(leaves, float0, strict=True)
        ],
    )


def _varying_like(z: Any, like: Any) -> Any:
    if _dtypes.is_float0(z):
        return z
    return _sharding.match_varying(z, like)
