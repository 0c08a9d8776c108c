# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Flax integration: fused micro-batch train steps for `flax.nnx` and `flax.linen`.

Both helpers run k micro-batches and one optimizer update in a single compiled
call through `optax_accum.microbatch`. Mutable state (BatchNorm running
statistics, nnx Rngs counters) is threaded through the micro-batches in order,
exactly as k small steps would update it; each micro-batch normalizes with its
own batch statistics. Flax is an optional dependency: ``import optax_accum``
never imports this module.
"""

try:
    import flax  # noqa: F401
except ImportError as e:
    from .._extras import install_command

    raise ImportError(
        f"optax_accum.flax needs Flax, in the `flax` extra: {install_command('flax')}."
    ) from e

from ._steps import linen_train_step as linen_train_step
from ._steps import nnx_train_step as nnx_train_step

__all__ = ["linen_train_step", "nnx_train_step"]
