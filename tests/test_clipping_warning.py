# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The one-time warning for clipping placed before the accumulator in a chain.

``optax.chain(clip, accumulate(opt, k))`` clips each micro-batch, where the
large batch clips the window's mean once: it warns, once per process. Clipping
inside the wrapper, or a chain with no clipping before it, does not warn.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import optax
import pytest

import optax_accum
from optax_accum._accumulate import _clip_warning


def test_clipping_before_accumulate_warns_once(monkeypatch):
    params = {"a": jnp.zeros(2)}
    grads = {"a": jnp.full(2, 3.0)}
    for good in (
        optax_accum.accumulate(
            optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)), 2
        ),
        optax.chain(optax.scale(0.5), optax_accum.accumulate(optax.adam(0.1), 2)),
    ):
        monkeypatch.setattr(_clip_warning, "_warned", False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            good.update(grads, good.init(params), params)
    for bad in (
        optax.chain(
            optax.clip_by_global_norm(1.0), optax_accum.accumulate(optax.adam(0.1), 2)
        ),
        optax.chain(
            optax.clip(1.0),
            optax_accum.MultiSteps(optax.adam(0.1), 2).gradient_transformation(),
        ),
    ):
        monkeypatch.setattr(_clip_warning, "_warned", False)
        state = bad.init(params)
        with pytest.warns(UserWarning, match="clips every micro-batch"):
            _, state = bad.update(grads, state, params)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process
            bad.update(grads, state, params)
