# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The variants: `accumulate` (k calls) and `microbatch` (one call) per layout.

Each against its anchor: ``optax.MultiSteps`` for the k-call faces, a
hand-written ``lax.scan`` with the library's collective pattern for the
one-call faces.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import optax_accum

from .layouts import Layout, make_loss


def k_call_variants(layout: Layout, depth: int, k: int) -> dict:
    """name -> (tx, step(p, s, x, y)): one micro-batch per jit call."""
    adam = optax.adam(1e-3)

    def make(tx, loss, defer):
        def step(p, s, x, y):
            q = optax_accum.defer_reduction(p, layout.batch) if defer else p
            g = jax.grad(loss)(q, x, y)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        return tx, jax.jit(step, donate_argnums=(0, 1))

    plain, deferred = make_loss(layout, depth), make_loss(layout, depth, True)
    out = {
        "optax.MultiSteps": make(
            optax.MultiSteps(adam, k).gradient_transformation(), plain, False
        ),
        "accumulate": make(optax_accum.accumulate(adam, k), plain, False),
    }
    if layout.pure:  # FSDP: no axis shards the batch but not the parameters
        out["accumulate + defer_reduction"] = make(
            optax_accum.accumulate(adam, k, data_axes=layout.batch), deferred, True
        )
    return out


def hand_scan(layout: Layout, mesh, depth: int, k: int) -> Callable:
    """``grads(params, x, y)``: a hand-written scan with the library's pattern.

    Pure data-parallel axes: ``shard_map`` over them, the scan inside (FSDP /
    TP collectives stay Explicit, per micro-batch), one ``psum`` after. No pure
    axis (FSDP): the scan in the global view. Parameters sharded over the
    batch's axes pass an optimization barrier with the loop index, so their
    gathers stay per micro-batch.
    """
    barrier = layout.name in ("fsdp", "hsdp")
    manual = layout.pure
    loss = make_loss(layout, depth, manual=manual)

    def scan(params, x, y):
        xs = x.reshape(x.shape[0] // k, k, *x.shape[1:])
        ys = y.reshape(y.shape[0] // k, k, *y.shape[1:])

        def body(acc, i):
            p = lax.optimization_barrier((params, i))[0] if barrier else params
            g = jax.grad(loss)(p, xs[:, i], ys[:, i])
            return jax.tree.map(jnp.add, acc, g), None

        acc, _ = lax.scan(body, jax.tree.map(jnp.zeros_like, params), jnp.arange(k))
        return acc

    if not manual:
        return lambda params, x, y: jax.tree.map(lambda a: a / k, scan(params, x, y))

    n = int(np.prod([mesh.shape[a] for a in manual]))

    def local(params, x, y):
        params = lax.pcast(params, manual, to="varying")  # no psum in the loop
        acc = lax.psum(scan(params, x, y), manual)
        return jax.tree.map(lambda a: a / (k * n), acc)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(manual), P(manual)),
        out_specs=P(),
        axis_names=set(manual),
    )


def one_call_variants(layout: Layout, mesh, depth: int, k: int) -> dict:
    """name -> grads(params, x, y): the whole batch in one jit call."""

    def mb(**kw):
        manual = kw.get("data_axes") or ()
        manual = (manual,) if isinstance(manual, str) else manual
        vg = jax.value_and_grad(make_loss(layout, depth, manual=manual))
        fun = optax_accum.microbatch(vg, k, batch_argnums=(1, 2), **kw)
        return lambda p, x, y: fun(p, x, y)[1]

    out = {"microbatch (global view)": mb()}
    if layout.pure:
        out['microbatch data_axes="data"'] = mb(data_axes="data")
    if layout.name == "fsdp":
        out['microbatch param_gather="once"'] = mb(param_gather="once")
    out["hand-written scan"] = hand_scan(layout, mesh, depth, k)
    return out


def with_adam(grads_fn: Callable) -> Callable:
    """A donated jit step: ``grads_fn``'s gradients, then Adam."""
    adam = optax.adam(1e-3)

    def step(p, s, x, y):
        u, s = adam.update(grads_fn(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    return jax.jit(step, donate_argnums=(0, 1))


def k_call_grads(layout: Layout, depth: int, defer: bool) -> Callable:
    """One micro-batch's gradient as a k-call variant computes it, reduced by
    ``accumulate(sgd(1), 1)`` (whose update is minus the gradient)."""
    loss = make_loss(layout, depth, deferred=defer)
    tx = optax_accum.accumulate(
        optax.sgd(1.0), 1, data_axes=layout.batch if defer else None
    )

    @jax.jit
    def grads(p, x, y):
        q = optax_accum.defer_reduction(p, layout.batch) if defer else p
        u, _ = tx.update(jax.grad(loss)(q, x, y), tx.init(p), p)
        return jax.tree.map(jnp.negative, u)

    return grads
