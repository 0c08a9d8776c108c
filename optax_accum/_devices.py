# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Where a window's sums live: on the device, or one per device of a mapped axis.

With ``axis_name`` (inside ``pmap`` or ``shard_map``) each device accumulates
its own micro-batches, and its buffers carry a leading axis of length 1 (a
"slot"), so that under ``shard_map`` they stack into a global
``(num_devices, ...)`` array. `psum_window` is the one reduction over devices,
used by both faces: `accumulate` at the window's boundary, `microbatch` once
after its loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import _dtypes, _weights


@dataclasses.dataclass(frozen=True)
class Devices:
    """Local (``axis_name=None``) or per device of ``axis_name``."""

    axis_name: Any = None

    @property
    def mapped(self) -> bool:
        return self.axis_name is not None

    @property
    def slot(self) -> tuple[int, ...]:
        return (1,) if self.mapped else ()

    def local(self, tree: Any) -> Any:
        """Leaves with the device slot in front."""
        if not self.mapped:
            return tree
        return jax.tree.map(lambda a: jnp.reshape(a, self.slot + jnp.shape(a)), tree)

    def unslot(self, tree: Any) -> Any:
        if not self.mapped:
            return tree
        return jax.tree.map(lambda a: a.reshape(a.shape[1:]), tree)

    def count(self) -> int:
        return lax.axis_size(self.axis_name) if self.mapped else 1

    def agree(self, flag: jax.Array) -> jax.Array:
        """True on every device if it is true on one: a scalar all-reduce."""
        if not self.mapped:
            return flag
        return lax.psum(flag.astype(jnp.int32), self.axis_name) > 0

    def reduce(self, tree: Any, weight: jax.Array, *, mean: bool, extras=()):
        """The window's reduction; see `psum_window`. Local: as is."""
        if not self.mapped:
            return tree, weight, extras
        return psum_window(tree, weight, self.axis_name, mean=mean, extras=extras)


def psum_window(
    tree: Any, weight: jax.Array | None, axes: Any, *, mean: bool, extras: Any = ()
) -> tuple[Any, jax.Array | None, Any]:
    """Each device's window combined over ``axes``, in one all-reduce.

    ``tree`` is the device's weighted mean (``mean``) or weighted sum, and
    ``weight`` its share of the total weight (any common scale); ``extras``
    (scalars) are summed along. With ``weight=None`` the trees are already
    scaled to their global shares and are summed. Returns the combined tree,
    the total weight and the summed extras.
    """
    if weight is None or not mean:
        return lax.psum((tree, weight, extras), axes)

    def weighted(a):
        wide = _dtypes.compute(a.dtype)
        return (weight.astype(wide) * a.astype(wide)).astype(a.dtype)

    total_sum, total, extras = lax.psum(
        (jax.tree.map(weighted, tree), weight, extras), axes
    )
    return (
        jax.tree.map(lambda a: _weights.ratio(a, total.astype(a.dtype)), total_sum),
        total,
        extras,
    )
