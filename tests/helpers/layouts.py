# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Sharded-parameter layouts on 8 CPU devices, a loss for each, and the reference.

Each layout names its mesh, how each parameter is sharded, how the loss uses
it (Explicit meshes need the user's own ``reshard`` / ``out_sharding``), and
which mesh axes shard the batch. The reference is the same loss, unsharded,
on one device.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, reshard
from jax.sharding import PartitionSpec as P

D_IN, HIDDEN, D_OUT = 8, 16, 8


class Layout(NamedTuple):
    name: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    batch: tuple[str, ...]  # mesh axes sharding the batch rows
    params: dict  # stored sharding of each parameter
    compute: dict  # what the loss reshards each parameter to (Explicit)


LAYOUTS = {
    "dp": Layout(
        "dp",
        (8,),
        ("data",),
        ("data",),
        {"w1": P(), "b1": P(), "w2": P()},
        {"w1": P(), "b1": P(), "w2": P()},
    ),
    "fsdp": Layout(
        "fsdp",
        (8,),
        ("data",),
        ("data",),
        {"w1": P("data", None), "b1": P("data"), "w2": P("data", None)},
        {"w1": P(), "b1": P(), "w2": P()},
    ),
    "tp": Layout(
        "tp",
        (4, 2),
        ("data", "model"),
        ("data",),
        {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)},
        {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)},
    ),
    "hsdp": Layout(
        "hsdp",
        (2, 4),
        ("data", "fsdp"),
        ("data", "fsdp"),
        {"w1": P("fsdp", None), "b1": P(), "w2": P("fsdp", None)},
        {"w1": P(), "b1": P(), "w2": P()},
    ),
    "3d": Layout(
        "3d",
        (2, 2, 2),
        ("data", "fsdp", "model"),
        ("data", "fsdp"),
        {"w1": P("fsdp", "model"), "b1": P("model"), "w2": P("model", "fsdp")},
        {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)},
    ),
}


def mesh(layout: Layout, explicit: bool = True):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(
        layout.shape, layout.axes, axis_types=(kind,) * len(layout.axes)
    )


def params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(size=(D_IN, HIDDEN)) / np.sqrt(D_IN), jnp.float32),
        "b1": jnp.asarray(rng.normal(size=(HIDDEN,)) * 0.1, jnp.float32),
        "w2": jnp.asarray(
            rng.normal(size=(HIDDEN, D_OUT)) / np.sqrt(HIDDEN), jnp.float32
        ),
    }


def data(rows: int, seed: int = 1) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(rows, D_IN)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(rows, D_OUT)), jnp.float32)
    return x, y


def loss_fn(
    layout: Layout | None,
    explicit: bool = True,
    row_sum: bool = False,
    deferred: bool = False,
    manual: tuple[str, ...] = (),
):
    """The MLP loss; with an Explicit ``layout``, the user's sharding annotations.

    ``deferred``: the weights are gathered typed ``reduced`` over the batch
    axes, so that their gradients stay unreduced over the data axis.
    ``manual``: axes that are Manual where the loss runs (a shard_map body),
    which annotations must not name.
    """
    out_rows = tuple(a for a in (layout.batch if layout else ()) if a not in manual)
    annotate = layout is not None and explicit

    def gather(p, n):
        spec = layout.compute[n]
        if deferred:
            spec = spec.update(reduced=frozenset(layout.batch))
        return reshard(p[n], spec)

    def loss(p, x, y):
        w1, b1, w2 = p["w1"], p["b1"], p["w2"]
        if annotate:
            w1, b1, w2 = (gather(p, n) for n in ("w1", "b1", "w2"))
        if annotate and deferred:
            # A reduced bias meets batch-sharded rows: shard it over them first.
            rows = P(layout.batch, *layout.compute["b1"])
            b1 = reshard(jnp.broadcast_to(b1, (x.shape[0], HIDDEN)), rows)
        h = jnp.tanh(x @ w1 + b1)
        if annotate:
            out = jnp.matmul(h, w2, out_sharding=P(out_rows or None, None))
        else:
            out = h @ w2
        per_row = jnp.mean((out - y) ** 2, axis=-1)
        return jnp.sum(per_row) if row_sum else jnp.mean(per_row)

    return loss


def place(layout: Layout, m, tree: dict) -> dict:
    return {
        n: jax.device_put(v, NamedSharding(m, layout.params[n]))
        for n, v in tree.items()
    }


def place_batch(layout: Layout, m, *arrays):
    return tuple(jax.device_put(a, NamedSharding(m, P(layout.batch))) for a in arrays)
