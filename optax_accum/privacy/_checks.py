# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The privacy wing's argument checks: the clip norm, the noise multiplier,
the expected batch size and the noise key.

Each is a static Python or NumPy value, checked once where it is given, with
an error that names the argument and the value: a wrong one would not fail
later, it would silently spend (or void) the privacy guarantee.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _checks


def _real(value: Any, name: str) -> float:
    """``value`` as a Python float, if it is a static real scalar."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"`{name}` must be a Python or NumPy number known when the "
            f"transformation is built, not a traced value: got {value!r}. "
            "The mechanism's parameters are fixed for a run (the accountant "
            "assumes them), so `optax.inject_hyperparams(privacy.dp_accumulate)` "
            "cannot run under `jit`; inject the inner optimizer's instead, e.g. "
            "`optax.inject_hyperparams(lambda learning_rate: "
            "privacy.dp_accumulate(optax.sgd(learning_rate), ...))`."
        )
    _checks.real_scalar(value, name, bool_ok=False)
    return float(np.asarray(value))


def clip_norm(value: Any, name: str = "l2_clip_norm") -> float:
    """A finite clip norm > 0."""
    c = _real(value, name)
    if not (math.isfinite(c) and c > 0):
        raise ValueError(
            f"`{name}` must be finite and > 0 (the L2 norm each example's "
            f"gradient is clipped to), got {value!r}."
        )
    return c


def noise_multiplier(value: Any, name: str = "noise_multiplier") -> float:
    """A finite noise multiplier >= 0 (0: no noise, no privacy)."""
    s = _real(value, name)
    if not (math.isfinite(s) and s >= 0):
        raise ValueError(
            f"`{name}` must be finite and >= 0 (the noise's standard deviation "
            f"in units of the clip norm), got {value!r}."
        )
    return s


def expected_batch_size(value: Any, name: str = "expected_batch_size") -> float:
    """The expected logical batch size, a finite number >= 1 (q * N may be
    fractional)."""
    b = _real(value, name)
    if not (math.isfinite(b) and b >= 1):
        raise ValueError(
            f"`{name}` must be finite and >= 1 (the expected number of examples "
            f"in a logical batch, sampling_rate * num_examples), got {value!r}."
        )
    return b


def prng_key(value: Any, name: str = "key") -> tuple[jax.Array, Any]:
    """A single PRNG key, as its raw data and its implementation.

    Accepts a typed key (``jax.random.key(0)``) or a raw ``uint32`` key of the
    default implementation (``jax.random.PRNGKey(0)``). The state keeps the
    raw data, which every checkpointer can store.
    """
    dtype = getattr(value, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        if jnp.shape(value) != ():
            raise ValueError(
                f"`{name}` must be a single PRNG key, got a batch of shape "
                f"{jnp.shape(value)}: {value!r}."
            )
        return jax.random.key_data(value), jax.random.key_impl(value)
    default = jax.random.key_impl(jax.random.key(0))
    shape = jax.random.key_data(jax.random.key(0)).shape
    if (
        dtype is not None
        and not isinstance(value, str | bytes)
        and jnp.dtype(dtype) == jnp.uint32
        and jnp.shape(value) == shape
    ):
        return jnp.asarray(value), default
    raise TypeError(
        f"`{name}` must be a PRNG key, `jax.random.key(seed)` (or a raw "
        f"uint32{list(shape)} key from `jax.random.PRNGKey(seed)`), got "
        f"{value!r}."
    )
