# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Ready-made ``skip_fn`` callables for `accumulate` and `MultiSteps`.

They follow optax's ``ShouldSkipUpdateFunction`` convention: called as
``fn(grads, step, params)``, they return ``(should_skip, skip_state)``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def skip_not_finite(
    grads: optax.Updates, step: jax.typing.ArrayLike, params: optax.Params | None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Rejects a micro-batch whose gradients contain a NaN or an infinity.

    Args:
      grads: the micro-batch's gradients.
      step: the update step (unused).
      params: the parameters (unused).

    Returns:
      ``(should_skip, {"should_skip": ..., "num_not_finite": ...})``.

    Examples:
      >>> import jax.numpy as jnp, optax_accum
      >>> grads = {"w": jnp.array([1.0, jnp.nan])}
      >>> skip, info = optax_accum.skip_not_finite(grads, 0, None)
      >>> bool(skip), int(info["num_not_finite"])
      (True, 1)
    """
    del step, params
    counts = [
        jnp.sum(~jnp.isfinite(g)).astype(jnp.int32) for g in jax.tree.leaves(grads)
    ]
    num = sum(counts, jnp.zeros([], jnp.int32))
    should_skip = num > 0
    return should_skip, {"should_skip": should_skip, "num_not_finite": num}


def skip_large_updates(max_norm: jax.typing.ArrayLike) -> Any:
    """Returns a ``skip_fn`` rejecting gradients whose global norm exceeds ``max_norm``.

    A NaN or infinite norm is rejected too.

    Args:
      max_norm: the largest accepted global L2 norm, > 0.

    Returns:
      A callable ``(grads, step, params) -> (should_skip, skip_state)`` with
      ``skip_state = {"should_skip": ..., "norm": ...}``.

    Raises:
      ValueError: if ``max_norm`` is not a positive scalar.

    Examples:
      >>> import jax.numpy as jnp, optax_accum
      >>> fn = optax_accum.skip_large_updates(1.0)
      >>> bool(fn({"w": jnp.array([3.0, 4.0])}, 0, None)[0])
      True
    """
    if np.ndim(max_norm) != 0 or not float(max_norm) > 0:
        raise ValueError(f"`max_norm` must be a positive scalar, got {max_norm!r}.")

    def skip_fn(grads, step, params):
        del step, params
        norm = optax.tree.norm(grads).astype(jnp.float32)
        should_skip = jnp.logical_not(norm <= max_norm)
        return should_skip, {"should_skip": should_skip, "norm": norm}

    return skip_fn
