# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""How a window's micro-batch gradients combine: the mean and sum strategies.

Each strategy answers, for both faces, the same questions (after
optax.microbatching's ``Accumulator``): how one weighted micro-batch enters a
running window (`accumulate`: `first`, `step`), by what each micro-batch's
gradient is scaled inside a fused loop (`microbatch`: `loop_scales`,
`loop_divisor`, `runs_in_narrow_buffers`), and whether the result is a mean
(``is_mean``: weighted across devices by `_devices`). The strategies hold no
state; `get` returns the one for a ``reduction`` name.
"""

from __future__ import annotations

import dataclasses

import jax

from . import _checks, _partial_sums, _weights

NAMES = ("mean", "sum")


@dataclasses.dataclass(frozen=True)
class Mean:
    """The weighted mean ``sum_i w_i g_i / sum_i w_i``."""

    name: str = "mean"
    is_mean: bool = True

    def step(self, a: jax.Array, g: jax.Array, coef: jax.Array, w: jax.Array):
        """The running mean: ``a + coef (g - a)``, ``coef = w / window sum``."""
        del w
        return _partial_sums.lerp(a, g, coef)

    def first(self, g: jax.Array, w: jax.Array) -> jax.Array:
        """What the window's first contribution writes (the buffer is stale)."""
        del w
        return g

    def loop_scales(self, ws: jax.Array) -> jax.Array:
        """Per-micro-batch multipliers of the gradients in a fused loop: each
        weight's share times the number of weights (``ws`` may hold every
        device's k), so they are about 1, as unweighted; the loop's sum is
        then divided by `loop_divisor`."""
        return _weights.shares(ws) * ws.size

    def loop_divisor(self, count: int, parts: int) -> float:
        """What the loop's sum of ``count`` contributions is divided by; each
        micro-batch is ``parts`` of them (one per device in the device-local
        mode, where every device holds part of each micro-batch)."""
        del parts
        return float(count)

    def runs_in_narrow_buffers(self) -> bool:
        """In a buffer narrower than float32 a sum of k can overflow (float16)
        or lose small terms (bfloat16) though the mean is fine: there the
        loop keeps a running mean (`step`, not sinkable) instead."""
        return True


@dataclasses.dataclass(frozen=True)
class Sum:
    """The weighted sum ``sum_i w_i g_i``."""

    name: str = "sum"
    is_mean: bool = False

    def step(self, a: jax.Array, g: jax.Array, coef: jax.Array, w: jax.Array):
        del coef
        return _partial_sums.add_scaled(a, g, w)

    def first(self, g: jax.Array, w: jax.Array) -> jax.Array:
        return _partial_sums.scale(g, w)

    def loop_scales(self, ws: jax.Array) -> jax.Array:
        return ws

    def loop_divisor(self, count: int, parts: int) -> float:
        del count
        return float(parts)

    def runs_in_narrow_buffers(self) -> bool:
        return False  # a sum that overflows is the sum asked for


def get(reduction: str) -> Mean | Sum:
    """The strategy for ``reduction``, checked: ``"mean"`` or ``"sum"``."""
    _checks.one_of(reduction, "reduction", NAMES)
    return Mean() if reduction == "mean" else Sum()
