# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`microbatch`'s ``param_gather`` on XLA:GPU (8 H100s): FSDP gathers per
micro-batch by default, once with ``param_gather="once"``.

XLA:CPU hoists a loop-invariant all-gather out of the micro-batch loop by
itself (`tests/sharding/test_microbatch_param_layouts.py`); XLA:GPU keeps it
in the loop, so ``"once"`` gathers before the loop itself
(`_compiler.gather_once`). Before that, both choices compiled to one program
on the H100s, with the gather in the loop (temp 18.0 MiB for a 4 x 1024^2
MLP; 34.0 MiB with the gather hoisted).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, reshard
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _targets
from tests.helpers import hlo as _hlo

from .conftest import require

WIDTH, LAYERS, K = 256, 4, 4


def _loss(params, x):
    h = x
    for i, layer in enumerate(params):  # the user's FSDP gather: reshard to P()
        h = h @ reshard(layer["w"], P()) + reshard(layer["b"], P())
        h = jnp.tanh(h) if i < len(params) - 1 else h
    return jnp.mean(h**2)


@functools.cache
def _compiled(param_gather: str | None) -> tuple[str, int]:
    devices = _targets.target_mesh("h100x8").devices
    mesh = Mesh(devices, ("data",), axis_types=(AxisType.Explicit,))

    def struct(shape, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)

    params = [
        {"w": struct((WIDTH, WIDTH), P("data", None)), "b": struct((WIDTH,), P("data"))}
        for _ in range(LAYERS)
    ]
    x = struct((8 * 2 * K, WIDTH), P("data", None))
    kw = {} if param_gather is None else {"param_gather": param_gather}
    fun = optax_accum.microbatch(jax.value_and_grad(_loss), K, batch_argnums=1, **kw)
    with jax.set_mesh(mesh), warnings.catch_warnings():
        # The persistent cache cannot load a program compiled without devices.
        warnings.filterwarnings("ignore", "Error reading persistent", UserWarning)
        program = jax.jit(fun).trace(params, x).lower().compile()
    return program.as_text(), program.memory_analysis().temp_size_in_bytes


def _gathers(text: str, in_loop: bool) -> list:
    comps, _ = _hlo.computations(text)
    body = _hlo.reachable(comps, _hlo.while_bodies(comps))
    where = body if in_loop else set(comps) - body
    return [c for c in _hlo.collectives(comps, where, 8) if c[0] == "all-gather"]


@pytest.mark.parametrize("param_gather", [None, "per_microbatch"])
def test_fsdp_gathers_per_micro_batch_by_default_on_gpu(param_gather):
    require("h100x8")
    text, _ = _compiled(param_gather)
    assert _gathers(text, in_loop=True)


def test_param_gather_once_hoists_the_gather_out_of_the_loop_on_gpu():
    require("h100x8")
    text, temp = _compiled("once")
    assert _gathers(text, in_loop=False)
    assert not _gathers(text, in_loop=True)
    # The whole gathered model is resident for the loop: that is the cost.
    model = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    assert temp >= _compiled(None)[1] + model * 7 // 8, temp
