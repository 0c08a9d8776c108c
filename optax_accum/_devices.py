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

    def whole(self, grads: Any, weight: jax.Array) -> tuple[Any, jax.Array]:
        """One micro-batch's gradient over every device and its total weight:
        ``sum_d w_d g_d / sum_d w_d``, a device of weight 0 left out (one
        all-reduce of the gradients, `psum_window`). Local: as is."""
        if not self.mapped:
            return grads, weight
        leaves, treedef = jax.tree.flatten(grads)
        floats = [g for g in leaves if not _dtypes.is_float0(g)]
        share = weight / self.count()  # the total cannot overflow
        mean, total, _ = psum_window(floats, share, self.axis_name, mean=True)
        it = iter(mean)
        leaves = [g if _dtypes.is_float0(g) else next(it) for g in leaves]
        return jax.tree.unflatten(treedef, leaves), total * self.count()

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

    A mean is weighted at least in float32 and a device of weight 0
    contributes nothing, even where its buffer is NaN (select, not multiply).
    The weighted terms of a float16 buffer are summed in float32 too: each
    fits, as does their mean, but their sum can overflow (two devices at 300
    with weight 512 sum to 153600, over float16's 65504); the mean is
    float16 again. Other buffers are summed in their own dtype, as the
    bfloat16 range is float32's.
    """
    if weight is None or not mean:
        return lax.psum((tree, weight, extras), axes)

    def weighted(a):
        wide = _dtypes.compute(a.dtype)
        w = weight.astype(wide)
        product = jnp.where(w > 0, w * a.astype(wide), 0)
        return product if _sum_overflows(a.dtype) else product.astype(a.dtype)

    total_sum, total, extras = lax.psum(
        (jax.tree.map(weighted, tree), weight, extras), axes
    )
    mean_tree = jax.tree.map(
        lambda s, a: _weights.ratio(s, total.astype(s.dtype)).astype(a.dtype),
        total_sum,
        tree,
    )
    return mean_tree, total, extras


def _sum_overflows(dtype: Any) -> bool:
    """A buffer dtype of narrower range than float32 (float16): a sum of
    in-range values can overflow it though their mean fits."""
    if not _dtypes.is_differentiable(dtype):
        return False
    return bool(jnp.finfo(dtype).max < jnp.finfo(jnp.float32).max)
