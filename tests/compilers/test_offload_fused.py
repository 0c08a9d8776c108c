# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The fused step's `offload` on XLA:GPU: the state comes to the device after
the micro-batch loop, so offload saves device memory.

The fused step is `microbatch_value_and_grad` then ``tx.update`` with
``tx = offload(adamw(...))``. XLA:GPU's scheduler started the state's
host-to-device copies at the top of the program, before the loop, so the
state sat in device memory through it: for GPT ``cpu_small`` the device peak
was 213.8 MiB with offload against 203.9 without. `offload` now ties the move
to the gradients (`_compiler.after`): 157.9 MiB.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

import optax_accum
from optax_accum import _targets
from tests.helpers import hlo as _hlo
from tests.helpers.models import mlp_loss, mlp_params

from .conftest import require

SIZES, K, ROWS = (256, 512, 512, 512, 256), 4, 256


@functools.cache
def _compiled(offloaded: bool) -> _targets.Compiled:
    adamw = optax.adamw(1e-3, weight_decay=0.1)
    tx = optax_accum.offload(adamw) if offloaded else adamw
    grad_fn = optax_accum.microbatch_value_and_grad(mlp_loss, K, batch_argnums=(1, 2))

    def step(params, state, x, y):
        updates, state = tx.update(grad_fn(params, x, y)[1], state, params)
        return optax.apply_updates(params, updates), state

    params = jax.eval_shape(lambda: mlp_params(0, SIZES))
    state = jax.eval_shape(adamw.init, params)
    x = jax.ShapeDtypeStruct((K * ROWS, SIZES[0]), jnp.float32)
    y = jax.ShapeDtypeStruct((K * ROWS, SIZES[-1]), jnp.float32)
    kinds = (None, "pinned_host" if offloaded else None, None, None)
    return _targets.compile_for(
        step, params, state, x, y, target="h100", memory_kinds=kinds,
        donate_argnums=(0,) if offloaded else (0, 1),
    )  # fmt: skip


def _to_device(line: str) -> bool:
    """A copy from host memory (``S(5)``) into device memory."""
    if " copy-start(" not in line:
        return False
    shapes = line.split("=", 1)[1].split("copy-start(")[0]
    into, source = shapes.split(", ")[:2]
    return "S(5)" in source and "S(5)" not in into


def test_fused_step_brings_the_state_in_after_the_micro_batch_loop_on_gpu():
    require("h100")
    comps, entry = _hlo.computations(_compiled(True).as_text())
    lines = comps[entry]  # in schedule order
    loops = [i for i, line in enumerate(lines) if " while(" in line]
    moves = [i for i, line in enumerate(lines) if _to_device(line)]
    assert len(loops) == 1 and moves, (loops, moves)
    assert min(moves) > loops[0], (loops, moves)


def test_fused_step_offload_saves_device_memory_on_gpu():
    require("h100")
    offloaded, plain = _compiled(True).memory(), _compiled(False).memory()
    leaves = jax.tree.leaves(jax.eval_shape(lambda: mlp_params(0, SIZES)))
    moments = 2 * sum(p.size * 4 for p in leaves)
    # Adam's moments leave the device between steps; at the peak (the loop)
    # they are not on it either.
    assert offloaded.peak <= plain.peak - moments // 2, (offloaded, plain, moments)
