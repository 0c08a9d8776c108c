# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The boundary branch survives XLA:GPU and XLA:TPU.

`accumulate` runs the inner optimizer on boundary micro-steps only. On CPU
`tests/test_accumulate_hlo.py` holds that in the compiled program; here the
same step is compiled for an H100 and a TPU v5e chip. XLA:GPU turns a
conditional with elementwise branches into selects (the control below), so
there the branch is a loop of at most one trip (`_compiler.boundary_cond`);
XLA:TPU keeps the conditional. On both, the inner optimizer's work (Adam's
sqrt) is reachable only through the branch, the hold path copies nothing
large, and the working memory is at most `optax.MultiSteps`'s plus the
updates, which a branch must write out (`optax.MultiSteps`' selects fuse them
into ``apply_updates``).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _targets
from tests.helpers import hlo as _hlo
from tests.helpers.models import mlp_loss, mlp_params

from .conftest import require

SIZES = (256, 256, 256, 256, 256)  # repeated shapes: XLA merges their zeros
TARGETS = ("h100", "v5e")
FACES = {
    "accumulate": lambda: optax_accum.accumulate(optax.adam(1e-3), 4),
    "drop_in": lambda: optax_accum.MultiSteps(
        optax.adam(1e-3), 4
    ).gradient_transformation(),
    "optax": lambda: optax.MultiSteps(optax.adam(1e-3), 4).gradient_transformation(),
}


def _params():
    return jax.eval_shape(lambda: mlp_params(0, SIZES))


@functools.cache
def _compiled(target: str, face: str) -> _targets.Compiled:
    """One micro-step, params and state donated (compiled once a session)."""
    tx = FACES[face]()

    def step(params, state, x, y):
        grads = jax.grad(mlp_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = _params()
    x = jax.ShapeDtypeStruct((4, SIZES[0]), jnp.float32)
    y = jax.ShapeDtypeStruct((4, SIZES[-1]), jnp.float32)
    state = jax.eval_shape(tx.init, params)
    return _targets.compile_for(
        step, params, state, x, y, target=target, donate_argnums=(0, 1)
    )


def _inner_work(comps):
    """The computations holding Adam's sqrt, the inner update's marker."""
    return {c for c, lines in comps.items() for line in lines if " sqrt(" in line}


def _behind_branches(comps):
    """Everything a conditional's branch or a loop's body reaches."""
    roots = _hlo.branch_roots(comps) | _hlo.while_bodies(comps)
    return _hlo.reachable(comps, roots)


@pytest.mark.parametrize("face", ["accumulate", "drop_in"])
@pytest.mark.parametrize("target", TARGETS)
def test_inner_optimizer_runs_only_behind_the_boundary_branch(target, face):
    require(target)
    comps, _ = _hlo.computations(_compiled(target, face).as_text())
    work = _inner_work(comps)
    assert work and work <= _behind_branches(comps), (target, work)
    if target == "v5e":  # XLA:TPU keeps the lax.cond itself
        assert sum(" conditional(" in ln for ls in comps.values() for ln in ls) == 1


def test_xla_gpu_turns_an_elementwise_cond_into_selects():
    """The control: what `_compiler.boundary_cond` works around. If it fails,
    XLA:GPU keeps such branches and the loop may go back to a ``lax.cond``."""
    require("h100")
    comps, _ = _hlo.computations(_compiled("h100", "optax").as_text())
    assert not _hlo.branch_roots(comps)
    assert _inner_work(comps) - _behind_branches(comps)

    def step(pred, m, g):  # an update, or the state and zeros (not an empty branch)
        update = lambda m, g: (0.9 * m + g, -m)
        hold = lambda m, g: (m, jnp.zeros_like(g))
        return jax.lax.cond(pred, update, hold, m, g)

    m = jax.ShapeDtypeStruct((1024,), jnp.float32)
    pred = jax.ShapeDtypeStruct((), jnp.bool_)
    text = _targets.compile_for(step, pred, m, m, target="h100").as_text()
    assert " conditional(" not in text and " select(" in text


@pytest.mark.parametrize("face", ["accumulate", "drop_in"])
@pytest.mark.parametrize("target", TARGETS)
def test_hold_path_has_no_large_copies(target, face):
    """A conditional XLA:GPU keeps copies the state its hold branch passes
    through; the loop updates it in place."""
    require(target)
    comps, _ = _hlo.computations(_compiled(target, face).as_text())
    assert _hlo.large_copies(comps) == []


@pytest.mark.parametrize("target", TARGETS)
def test_temp_memory_is_optax_multisteps_plus_the_updates_at_most(target):
    require(target)
    ours = _compiled(target, "accumulate").memory().temp
    theirs = _compiled(target, "optax").memory().temp
    leaves = jax.tree.leaves(_params())
    updates = sum(np.prod(p.shape) * p.dtype.itemsize for p in leaves)
    assert ours <= theirs + updates, (ours, theirs, updates)


@pytest.mark.parametrize("target", ["h100x8", "v5e:2x2"])
def test_per_device_windows_reduce_once_inside_the_branch(target):
    """With ``axis_name`` (one window per device), the inner optimizer and the
    one all-reduce of the window run only inside the branch."""
    require(target)
    tx = optax_accum.accumulate(optax.adam(1e-3), 4, axis_name="data")
    mesh = _targets.target_mesh(target)
    n = mesh.devices.size
    params = _params()
    state = jax.eval_shape(tx.init, params)
    specs = optax_accum.state_specs(state, "data")
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(
            (n, *a.shape[1:]) if s == P("data") else a.shape, a.dtype
        ),
        state,
        specs,
    )

    def step(params, state, x, y):
        @functools.partial(
            jax.shard_map,
            mesh=mesh,
            in_specs=(P(), specs, P("data"), P("data")),
            out_specs=(P(), specs),
        )
        def local(params, state, x, y):
            # This device's gradients: no pmean, and none from AD either.
            varying = jax.lax.pcast(params, "data", to="varying")
            grads = jax.grad(mlp_loss)(varying, x, y)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return local(params, state, x, y)

    x = jax.ShapeDtypeStruct((2 * n, SIZES[0]), jnp.float32)
    y = jax.ShapeDtypeStruct((2 * n, SIZES[-1]), jnp.float32)
    compiled = _targets.compile_for(
        step, params, state, x, y, target=target,
        specs=(None, specs, P("data"), P("data")), donate_argnums=(0, 1),
    )  # fmt: skip
    comps, _ = _hlo.computations(compiled.as_text())
    inside = _behind_branches(comps)
    work = _inner_work(comps)
    assert work and work <= inside, work
    assert _hlo.count(comps, inside) == 1  # the window's one all-reduce
    assert _hlo.count(comps, set(comps) - inside) == 0
    assert _hlo.large_copies(comps) == []


@pytest.mark.parametrize("target", TARGETS)
def test_offloaded_state_stays_on_the_host_and_is_not_copied(target):
    """`offload`'s state in host memory (compiled from the CPU-mesh lowering):
    the inner optimizer still runs only behind the branch, and no large array
    is copied (a conditional that XLA:GPU keeps copied the host state it
    passes through, 32 copies for this model, on every micro-step)."""
    require(target)
    tx = optax_accum.accumulate(optax_accum.offload(optax.adam(1e-3)), 4)
    params = _params()
    state = jax.eval_shape(tx.init, params)
    host = jax.tree.map(lambda _: None, state)._replace(
        inner_state=jax.tree.map(lambda _: "pinned_host", state.inner_state)
    )

    def step(params, state, x, y):
        grads = jax.grad(mlp_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    x = jax.ShapeDtypeStruct((4, SIZES[0]), jnp.float32)
    y = jax.ShapeDtypeStruct((4, SIZES[-1]), jnp.float32)
    compiled = _targets.compile_for(
        step, params, state, x, y, target=target, donate_argnums=(0, 1),
        memory_kinds=(None, host, None, None),
    )  # fmt: skip
    stats = compiled.program.get_compiled_memory_stats()
    moments = 2 * sum(np.prod(p.shape) * 4 for p in jax.tree.leaves(params))
    assert stats.host_argument_size_in_bytes >= moments
    comps, _ = _hlo.computations(compiled.as_text())
    work = _inner_work(comps)
    assert work and work <= _behind_branches(comps), work
    assert _hlo.large_copies(comps) == []
    host_copies = [ln for ls in comps.values() for ln in ls if _host_copy(ln)]
    assert host_copies == [], host_copies[:3]


@functools.cache
def _offload_step(offloaded: bool, rows: int) -> _targets.Compiled:
    """`accumulate`'s micro-step on an H100, the inner state in host memory
    or not, params and state donated."""
    adam = optax.adam(1e-3)
    tx = optax_accum.accumulate(optax_accum.offload(adam) if offloaded else adam, 4)
    params = _params()
    state = jax.eval_shape(tx.init, params)
    kinds = None
    if offloaded:
        host = jax.tree.map(lambda _: None, state)._replace(
            inner_state=jax.tree.map(lambda _: "pinned_host", state.inner_state)
        )
        kinds = (None, host, None, None)

    def step(params, state, x, y):
        grads = jax.grad(mlp_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    x = jax.ShapeDtypeStruct((rows, SIZES[0]), jnp.float32)
    y = jax.ShapeDtypeStruct((rows, SIZES[-1]), jnp.float32)
    return _targets.compile_for(
        step, params, state, x, y, target="h100", donate_argnums=(0, 1),
        memory_kinds=kinds,
    )  # fmt: skip


def test_offload_saves_device_memory_where_the_micro_batch_dominates_on_gpu():
    """Where the backward pass sets the peak (a micro-batch of 1,024 rows), the
    offloaded step's device peak is the plain one's less Adam's moments. Where
    the update sets it (4 rows), offload costs more: the moments come in and
    the new ones go out at once (6.1 against 5.3 MB here)."""
    require("h100")
    leaves = jax.tree.leaves(_params())
    moments = 2 * sum(np.prod(p.shape) * 4 for p in leaves)
    offloaded, plain = _offload_step(True, 1024).memory(), _offload_step(False, 1024)
    assert offloaded.peak <= plain.memory().peak - moments * 3 // 4, (offloaded, plain)


def _host_copy(line: str) -> bool:
    """A copy of any size into host memory (an ``S(5)`` layout)."""
    return bool(re.search(r"S\(5\)\} copy\(", line))
