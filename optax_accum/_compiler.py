# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The places where the library steers XLA, each guarded by an HLO test.

Each is about what the optimized program must, or must not, contain, on the
compilers it is checked for. If XLA changes and one of them stops working,
its test names the symptom.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import _sharding
from ._dtypes import is_float0
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


def after(values: Any, ready: Any) -> tuple[Any, Any]:
    """``(values, ready)`` through one optimization barrier: what reads the
    returned ``values`` waits for ``ready``.

    `offload` brings the optimizer's state to the device for the update. In a
    fused step (a micro-batch loop, then the update) XLA:GPU's scheduler
    starts that move before the loop, so the state sat in device memory
    through it and offload saved nothing. Tied to the gradients (``ready``),
    the move cannot start before the loop has made them. Guarded by
    ``tests/compilers/test_offload_fused.py``. Where the update itself is
    differentiated, no barrier: its transpose cannot type a cotangent in
    host memory (JAX 0.10).
    """
    if _differentiated((values, ready)):
        return values, ready
    return lax.optimization_barrier((values, ready))


def gather_once(args: Sequence[Any], axes: Sequence[str]) -> list[Any]:
    """``args`` gathered over the mesh ``axes`` now, ahead of a loop.

    XLA:CPU hoists an FSDP parameter's loop-invariant all-gather out of the
    micro-batch loop by itself; XLA:GPU keeps it in the loop, one gather per
    micro-batch. Each leaf of ``args`` that an Explicit mesh shards over
    ``axes`` is resharded without them here, so the gather runs once, before
    the loop, on every compiler; the optimization barrier keeps XLA from
    moving it back into the loop. Leaves not sharded over ``axes`` pass as
    they are. Guarded by ``tests/compilers/test_param_gather.py``.
    """
    drop = set(axes)

    def gather(x):
        spec = _sharding.explicit_spec(x)
        if not _sharding.used_axes(spec) & drop:
            return x
        entries = [
            tuple(a for a in _sharding.axes_of(e) if a not in drop) or None
            for e in spec.partitions
        ]
        return jax.sharding.reshard(x, jax.sharding.PartitionSpec(*entries))

    return lax.optimization_barrier(jax.tree.map(gather, list(args)))


def boundary_cond(
    pred: jax.Array,
    boundary: Callable[..., Any],
    hold: Callable[..., Any],
    *operands: Any,
    carried: int,
) -> Any:
    """``lax.cond(pred, boundary, hold, *operands)`` that stays a branch on GPU.

    XLA:GPU's conditional simplifier turns a two-way conditional whose
    branches hold only elementwise work (an optimizer's update is) into
    selects, so that ``boundary`` runs on every micro-step. A conditional it
    keeps (one with an ``optimization_barrier`` in a branch, or `offload`'s
    memory moves) copies each array the hold branch passes through: the inner
    state, on every micro-step.
    On CUDA and ROCm the branch is therefore a loop of zero or one trips,
    which XLA keeps (it cannot know the trip count) and updates in place:
    ``hold``'s outputs are the carry, and the one trip replaces them with
    ``boundary``'s, reading the array it updates (``operands[carried]``, which
    ``hold`` returns as its second output) from the carry. Elsewhere it is
    the ``lax.cond``, and CPU and TPU compile the program they compiled before.

    Both functions return ``(updates, state, stepped, *rest)`` with the same
    types; ``float0`` leaves (integer inputs' gradients) are the same in both.
    Guarded by ``tests/compilers/test_boundary_branch.py``.
    """

    def branch(pred, *ops):
        return lax.cond(pred, boundary, hold, *ops)

    def loop(pred, *ops):
        return _at_most_once(pred, boundary, hold, ops, carried)

    if _differentiated(operands):
        # A loop cannot be transposed (and `platform_dependent` traces every
        # platform's branch): under `jax.grad` of an update, the conditional.
        return branch(pred, *operands)

    return lax.platform_dependent(pred, *operands, default=branch, cuda=loop, rocm=loop)


def _at_most_once(pred, boundary, hold, ops, carried):
    """``hold(*ops)``, replaced by ``boundary``'s outputs where ``pred``."""
    start = hold(*ops)
    leaves, treedef = jax.tree.flatten(start)
    static = [is_float0(x) for x in leaves]

    def rebuild(dynamic):
        it = iter(dynamic)
        return jax.tree.unflatten(
            treedef, [x if s else next(it) for x, s in zip(leaves, static, strict=True)]
        )

    def dynamic_of(tree):
        return [
            jnp.asarray(x)
            for x, s in zip(jax.tree.leaves(tree), static, strict=True)
            if not s
        ]

    def body(carry):
        _, dynamic = carry
        ops_now = list(ops)
        ops_now[carried] = rebuild(dynamic)[1]  # updated in place
        return jnp.zeros([], jnp.bool_), dynamic_of(boundary(*ops_now))

    _, dynamic = lax.while_loop(
        lambda carry: carry[0], body, (jnp.asarray(pred, jnp.bool_), dynamic_of(start))
    )
    return rebuild(dynamic)


_DIFFERENTIATING = ("JVPTrace", "LinearizeTrace")


def _differentiated(tree: Any) -> bool:
    """Whether ``tree`` may be differentiated (forward or reverse mode): one
    of its leaves is a JVP tracer, or a JVP trace is anywhere below the
    current one (``jax.grad`` of a ``jax.vmap`` or of a ``jax.jit``, whose
    tracers are the batch's or the jaxpr's). A false positive costs only the
    GPU's structure, never the values."""
    if any(
        type(x).__name__ in ("JVPTracer", "LinearizeTracer")
        for x in jax.tree.leaves(tree)
    ):
        return True
    from jax._src import core  # the trace stack; no public reader

    trace = getattr(getattr(core, "trace_ctx", None), "trace", None)
    while trace is not None:
        if type(trace).__name__ in _DIFFERENTIATING:
            return True
        trace = getattr(trace, "parent_trace", None)
    return False
