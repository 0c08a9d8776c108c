# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""An Orbax save in the middle of a DP window, and a restore into a state
built from abstract shapes, continue bit for bit, noise included."""

from __future__ import annotations

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp

from optax_accum import privacy

from .reference import data, loss

K, CALLS, STOP_AT = 3, 8, 4  # call 4 is the second of window 2


def _train(tx, params, state, batches, start, stop):
    vg = privacy.clipped_value_and_grad(loss, 1.0, 2, batch_argnums=(1, 2))

    @jax.jit
    def step(p, s, x, y):
        u, s = tx.update(vg(p, x, y)[1], s, p)
        return optax.apply_updates(p, u), s

    for x, y in batches[start:stop]:
        params, state = step(params, state, x, y)
    return params, state


def _equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_orbax_resume_mid_window_is_bit_for_bit(tmp_path):
    params, x, y = data(rows=CALLS * 4, scale=2.0)
    batches = list(zip(np.split(x, CALLS), np.split(y, CALLS), strict=True))
    tx = privacy.dp_accumulate(
        optax.adam(0.05), K, l2_clip_norm=1.0, noise_multiplier=1.0,
        expected_batch_size=12, key=jax.random.key(42),
    )  # fmt: skip
    straight = _train(tx, params, tx.init(params), batches, 0, CALLS)

    p, s = _train(tx, params, tx.init(params), batches, 0, STOP_AT)
    assert int(s.micro_step) == STOP_AT % K and int(s.inner_state[0].windows) == 1
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", {"params": p, "opt": s})
    abstract = jax.eval_shape(lambda: {"params": params, "opt": tx.init(params)})
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(tmp_path / "ckpt", abstract)
    _equal(restored["opt"], s)
    resumed = _train(tx, restored["params"], restored["opt"], batches, STOP_AT, CALLS)
    _equal(resumed, straight)
