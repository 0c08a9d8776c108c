# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The fused step's claims, compiled for an H100 and a TPU v5e (chip or 2x2).

The steps are the benchmark's (`benchmarks/bench_compiled_loops.py`, whose
table the docs show). The CPU tests (`tests/sharding/test_loop_collectives.py`,
the memory guide) read XLA:CPU's program, which does not run the
accelerators' loop passes. Here the same steps are compiled by XLA:GPU and
XLA:TPU without the devices (`optax_accum._targets`):

- the fused step's working memory equals a hand-written ``lax.scan``'s
  (within 5%), and its peak, less the batch it is given, is flat in ``k``;
- ``data_axes`` reduces the gradients once, after the loop, and nothing
  crosses devices inside it;
- in the global view the compiler sinks the gradients' all-reduce out of the
  loop (only the loss's scalar stays), except with ``weight_fn`` on
  `microbatch`, which keeps one per micro-batch, as the microbatch guide says;
- tensor parallelism keeps its own all-reduces in the loop (over ``model``
  only) and the data axis's one reduction after it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import optax_accum
from benchmarks import bench_compiled_loops as loops
from optax_accum import _targets
from tests.helpers import hlo
from tests.helpers.models import mlp_loss, mlp_params

from .conftest import require

NARROW = (256,) * 4  # the collective checks


def _params(sizes):
    return jax.eval_shape(lambda: mlp_params(0, sizes))


def _batch(sizes, rows):
    return (
        jax.ShapeDtypeStruct((rows, sizes[0]), jnp.float32),
        jax.ShapeDtypeStruct((rows, sizes[-1]), jnp.float32),
    )


@functools.cache
def _memory(target: str, form: str, k: int) -> _targets.Memory:
    step = {"fused": loops.fused_step, "scan": loops.scan_step}[form](k)
    return _targets.compile_for(
        step, *loops.fused_args(k), target=target, donate_argnums=(0, 1)
    ).memory()


@pytest.mark.parametrize("target", ["h100", "v5e"])
def test_fused_step_memory_is_a_hand_written_scans_and_flat_in_k(target):
    require(target)
    batch_bytes = lambda k: sum(a.size * 4 for a in loops.fused_args(k)[2:])
    for k in (2, 8):
        ours, floor = _memory(target, "fused", k), _memory(target, "scan", k)
        assert ours.temp <= 1.05 * floor.temp, (k, ours, floor)
    # A larger k is a larger batch; what the step adds to it stays put.
    small = _memory(target, "fused", 2).peak - batch_bytes(2)
    large = _memory(target, "fused", 8).peak - batch_bytes(8)
    assert large <= 1.1 * small, (small, large)


def _collectives(compiled, axes):
    """``(in the loop, after it)``: each collective as (op, bytes, the mesh
    axes its groups cross)."""
    comps, _ = hlo.computations(compiled.as_text())
    mesh = compiled.mesh
    n = mesh.devices.size
    bodies = hlo.reachable(comps, hlo.while_bodies(comps))
    assert hlo.while_bodies(comps), "no loop: nothing was checked"

    def read(names):
        return [
            (op, size, {a for a in axes if hlo.crosses(groups, mesh, a)})
            for op, groups, size in hlo.collectives(comps, names, n)
        ]

    return read(bodies), read(set(comps) - bodies)


def _global_view(target, fun, sizes=NARROW, k=4, specs=None, axes=("data",)):
    n = _targets.target_mesh(target).devices.size
    shape = (n,) if len(axes) == 1 else (n // 2, 2)
    mesh = _targets.target_mesh(target, axes, shape)
    with jax.set_mesh(mesh):
        compiled = _targets.compile_for(
            fun, _params(sizes), *_batch(sizes, 2 * k * n), target=target,
            specs=(specs, P("data"), P("data")), axis_names=axes, mesh_shape=shape,
        )  # fmt: skip
    return _collectives(compiled, axes)


def _grad_bytes(sizes=NARROW) -> int:
    return sum(int(np.prod(p.shape)) * 4 for p in jax.tree.leaves(_params(sizes)))


@pytest.mark.parametrize("target", ["h100x8", "v5e:2x2"])
def test_data_axes_reduce_once_after_the_loop(target):
    require(target)
    vg = optax_accum.microbatch_value_and_grad(
        mlp_loss, 4, batch_argnums=(1, 2), data_axes=("data",)
    )
    inside, after = _global_view(target, vg)
    assert inside == [], inside
    reduces = [size for op, size, _ in after if op == "all-reduce"]
    assert [op for op, _, _ in after] == ["all-reduce"], after  # one, combined
    assert reduces[0] >= _grad_bytes(), (reduces, _grad_bytes())


@pytest.mark.parametrize("target", ["h100x8", "v5e:2x2"])
def test_global_view_gradient_reduction_leaves_the_loop(target):
    """Only the loss's scalar is reduced per micro-batch; the gradients once."""
    require(target)
    vg = optax_accum.microbatch_value_and_grad(mlp_loss, 4, batch_argnums=(1, 2))
    inside, after = _global_view(target, vg)
    assert inside and all(size <= 8 for _, size, _ in inside), inside
    assert sum(s for op, s, _ in after if op == "all-reduce") >= _grad_bytes()


@pytest.mark.parametrize("target", ["h100x8", "v5e:2x2"])
def test_weight_fn_on_microbatch_keeps_a_reduction_per_micro_batch(target):
    """The documented exception (and this file's control): `microbatch` scales
    each micro-batch's reduced gradients by its weight inside the loop."""
    require(target)
    weight = lambda x, y: jnp.sum(x[:, 0] ** 2)
    vg = optax_accum.microbatch(
        jax.value_and_grad(mlp_loss), 4, batch_argnums=(1, 2), weight_fn=weight
    )
    inside, _ = _global_view(target, vg)
    assert sum(s for op, s, _ in inside if op == "all-reduce") >= _grad_bytes()


def _tensor_parallel(params):
    """Megatron's pairs: a column-split layer, then a row-split one."""
    return [
        {"w": P(None, "model"), "b": P("model")}
        if i % 2 == 0
        else {"w": P("model", None), "b": P()}
        for i, _ in enumerate(params)
    ]


@pytest.mark.parametrize("target", ["h100x8", "v5e:2x2"])
def test_tensor_parallel_reduces_over_model_in_the_loop_and_data_after(target):
    require(target)
    vg = optax_accum.microbatch_value_and_grad(
        mlp_loss, 4, batch_argnums=(1, 2), data_axes=("data",)
    )
    specs = _tensor_parallel(_params(NARROW))
    inside, after = _global_view(target, vg, specs=specs, axes=("data", "model"))
    assert inside and all(axes == {"model"} for _, _, axes in inside), inside
    data = [(op, s) for op, s, axes in after if "data" in axes]
    assert [op for op, _ in data] == ["all-reduce"], after
    assert data[0][1] >= _grad_bytes() // 2  # each device's half of the model
