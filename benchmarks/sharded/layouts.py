# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The sharded MLP: its layouts, the user's annotations, its reference.

Four layouts on 8 devices with Explicit meshes (`LAYOUTS`): data parallel,
FSDP, tensor parallel (Megatron-style) and HSDP; per layout the stored and
gathered specs of every parameter, the loss with those annotations, and an
unsharded reference loss that every variant's gradients are checked against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, reshard
from jax.sharding import PartitionSpec as P


class Layout(NamedTuple):
    name: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    batch: tuple[str, ...]  # mesh axes that shard the batch rows
    pure: tuple[str, ...]  # batch axes that shard no parameter (pure DP)


LAYOUTS = {
    "dp": Layout("dp", (8,), ("data",), ("data",), ("data",)),
    "fsdp": Layout("fsdp", (8,), ("data",), ("data",), ()),
    "tp": Layout("tp", (4, 2), ("data", "model"), ("data",), ("data",)),
    "hsdp": Layout("hsdp", (2, 4), ("data", "fsdp"), ("data", "fsdp"), ("data",)),
}


def specs(layout: Layout, depth: int) -> tuple[list, list]:
    """Per layer: the stored (w, b) specs, and what the loss gathers them to."""
    stored, compute = [], []
    for i in range(depth):
        if layout.name == "dp":
            s = c = (P(), P())
        elif layout.name == "fsdp":
            s, c = (P("data", None), P("data")), (P(), P())
        elif layout.name == "hsdp":
            s, c = (P("fsdp", None), P("fsdp")), (P(), P())
        elif i % 2 == 0:  # tp: column-parallel, then row-parallel
            s = c = (P(None, "model"), P("model"))
        else:
            s = c = (P("model", None), P())
        stored.append({"w": s[0], "b": s[1]})
        compute.append({"w": c[0], "b": c[1]})
    return stored, compute


def make_mesh(layout: Layout):
    return jax.make_mesh(
        layout.shape, layout.axes, axis_types=(AxisType.Explicit,) * len(layout.axes)
    )


def make_loss(
    layout: Layout, depth: int, deferred: bool = False, manual: tuple = ()
) -> Callable:
    """The MLP's loss with the user's annotations for an Explicit ``layout``.

    ``deferred``: weights are gathered typed ``reduced`` over the batch axes
    (their gradients come back unreduced over the pure data axes).
    ``manual``: axes that are Manual where the loss runs (a shard_map body).
    """
    _, compute = specs(layout, depth)
    rows = tuple(a for a in layout.batch if a not in manual) or None

    def gather(x, spec):
        if deferred:
            spec = spec.update(reduced=frozenset(layout.batch))
        return reshard(x, spec)

    def loss(params, x, y):
        h = x
        for i, layer in enumerate(params):
            w = gather(layer["w"], compute[i]["w"])
            b = gather(layer["b"], compute[i]["b"])
            cols = compute[i]["w"][1] if len(compute[i]["w"]) > 1 else None
            h = jnp.matmul(h, w, out_sharding=P(rows, cols))
            if deferred:  # a reduced bias meets batch-sharded rows
                b = reshard(jnp.broadcast_to(b, h.shape), P(rows, cols))
            h = h + b
            if i < len(params) - 1:
                h = jnp.tanh(h)
        return jnp.mean((h - y) ** 2)

    return loss


def init_params(width: int, depth: int) -> list:
    rng = np.random.default_rng(0)
    return [
        {
            "w": jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), "f4"),
            "b": jnp.asarray(rng.normal(size=(width,)) * 0.1, "f4"),
        }
        for _ in range(depth)
    ]


def place(layout: Layout, mesh, params: list) -> list:
    stored, _ = specs(layout, len(params))
    return jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, stored
    )


def per_device_bytes(tree: Any) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def reference_loss(params, x, y):
    """The MLP's loss, unsharded: the reference for every variant's gradients."""
    h = x
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jnp.tanh(h)
    return jnp.mean((h - y) ** 2)


def relative_error(got: Any, want: Any) -> float:
    got, want = jax.device_get(got), jax.device_get(want)
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    diff = max(np.max(np.abs(a - b)) for a, b in pairs)
    return float(diff / max(np.max(np.abs(b)) for b in jax.tree.leaves(want)))


def temp_bytes(compiled) -> int:
    return compiled.memory_analysis().temp_size_in_bytes
