# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The two places where the library steers XLA, each guarded by an HLO test.

Both are about what the optimized program must not contain. If XLA changes
and one of them stops working, its test names the symptom.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ._sharding import broadcast


def distinct_zeros(shapes: Any, counter: jax.Array) -> Any:
    """Exact zeros for each leaf of ``shapes``, each written by its own broadcast.

    The hold step emits zero updates. XLA merges identical broadcasts and then
    copies the one buffer into each output, a full pass per leaf and micro-step.
    ``counter`` is a traced int32 that is never negative, so
    ``counter == -(i + 1)`` is always false, but XLA cannot prove it: each leaf
    gets a distinct scalar source and its own write-only broadcast, with no
    copy. Guarded by ``test_hold_path_has_no_large_copies``.
    """
    leaves, treedef = jax.tree.flatten(shapes)
    zeros = [
        broadcast(jnp.where(counter == -(i + 1), 1, 0).astype(s.dtype), s)
        for i, s in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, zeros)


def pin_to_iteration(args: Sequence[Any], i: jax.Array) -> list[Any]:
    """``args`` tied to the loop index ``i`` by an optimization barrier.

    Work on the tied values (an FSDP parameter's all-gather inside ``fun``)
    then depends on the iteration, so XLA cannot hoist it out of the
    micro-batch loop and keep every gathered weight resident at once, which
    is what FSDP exists to avoid. Guarded by
    ``test_fsdp_gathers_per_micro_batch_by_default_or_once_on_request``.
    """
    held, _ = lax.optimization_barrier((list(args), i))
    return held
