# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Gradient accumulation with sharded parameters: DP, FSDP, TP and HSDP.

A template: a small MLP trained with ``optax_accum.accumulate`` (or the fused
``microbatch``) on an Explicit mesh, its parameters sharded by the chosen
layout, checked against the same training on one device with the full batch.

    python examples/fsdp.py --layout hsdp
    python examples/fsdp.py --layout tp --defer       # one data reduction per update
    python examples/fsdp.py --layout fsdp --face microbatch

It runs on 8 CPU devices by default (``--devices 0`` keeps JAX's devices, for
a machine with 8 accelerators). It exits with status 1 if the sharded result
differs from the reference by more than 1e-5 relative.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, reshard
from jax.sharding import PartitionSpec as P

import optax_accum

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--layout", choices=["dp", "fsdp", "tp", "hsdp"], default="fsdp")
ARGS.add_argument("--face", choices=["accumulate", "microbatch"], default="accumulate")
ARGS.add_argument(
    "--defer",
    action="store_true",
    help="accumulate: reduce over the pure data axis once per update",
)
ARGS.add_argument("--devices", type=int, default=8, help="CPU devices (0: keep)")
ARGS.add_argument("--k", type=int, default=4, help="micro-batches per update")
ARGS.add_argument("--updates", type=int, default=3)

D_IN, HIDDEN, D_OUT, MICRO_ROWS = 16, 64, 8, 32


def optimizer():
    # SGD with momentum: unlike Adam, its steps scale with the gradient, so
    # the check below also catches a gradient off by a constant factor.
    return optax.sgd(0.1, momentum=0.9)


# name: (mesh shape, mesh axes, batch axes, stored parameter specs, the specs
# the loss gathers them to). FSDP weights are stored sharded and gathered
# whole per use; tensor-parallel weights are used sharded.
LAYOUTS = {
    "dp": ((8,), ("data",), ("data",), {"w1": P(), "b1": P(), "w2": P()}, None),
    "fsdp": (
        (8,),
        ("data",),
        ("data",),
        {"w1": P("data", None), "b1": P("data"), "w2": P("data", None)},
        {"w1": P(), "b1": P(), "w2": P()},
    ),
    "tp": (
        (4, 2),
        ("data", "model"),
        ("data",),
        {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)},
        None,
    ),
    "hsdp": (
        (2, 4),
        ("data", "fsdp"),
        ("data", "fsdp"),
        {"w1": P("fsdp", None), "b1": P("fsdp"), "w2": P("fsdp", None)},
        {"w1": P(), "b1": P(), "w2": P()},
    ),
}


def reference_loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def sharded_loss(layout: str, deferred: bool = False, manual: tuple = ()):
    """The same loss with the annotations an Explicit mesh asks for.

    ``deferred``: the weights are gathered typed ``reduced`` over the batch
    axes, so their gradients stay unreduced there (`defer_reduction`).
    ``manual``: axes that are Manual where the loss runs (``microbatch``'s
    device-local loop), which annotations must not name.
    """
    _, _, batch, stored, compute = LAYOUTS[layout]
    compute = compute or stored
    rows = tuple(a for a in batch if a not in manual) or None

    def gather(w, spec):
        return reshard(w, spec.update(reduced=frozenset(batch)) if deferred else spec)

    def loss(p, x, y):
        w1, b1, w2 = (gather(p[n], compute[n]) for n in ("w1", "b1", "w2"))
        cols = "model" if layout == "tp" else None  # TP splits the hidden units
        h = jnp.matmul(x, w1, out_sharding=P(rows, cols))
        if deferred:  # a reduced bias meets batch-sharded rows: shard it so
            b1 = reshard(jnp.broadcast_to(b1, h.shape), P(rows, cols))
        h = jnp.tanh(h + b1)
        out = jnp.matmul(h, w2, out_sharding=P(rows, None))
        return jnp.mean((out - y) ** 2)

    return loss


def data(updates: int, k: int):
    """Initial parameters and each update's batch, as float32 numpy arrays."""
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(D_IN, HIDDEN)) / np.sqrt(D_IN),
        "b1": rng.normal(size=HIDDEN) * 0.1,
        "w2": rng.normal(size=(HIDDEN, D_OUT)) / np.sqrt(HIDDEN),
    }
    rows = k * MICRO_ROWS
    xs = rng.normal(size=(updates, rows, D_IN))
    ys = rng.normal(size=(updates, rows, D_OUT))
    return jax.tree.map(lambda a: a.astype(np.float32), (params, xs, ys))


@jax.jit
def reference(params, xs, ys):
    """One device, the full batch of each update."""
    tx = optimizer()
    state = tx.init(params)
    for x, y in zip(xs, ys, strict=True):
        grads = jax.grad(reference_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def train_accumulate(args, params, xs, ys, batch, place_rows):
    """k jit calls per update of a step with `optax_accum.accumulate`."""
    tx = optax_accum.accumulate(
        optimizer(), args.k, data_axes=batch if args.defer else None
    )
    loss = sharded_loss(args.layout, deferred=args.defer)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, x, y):
        q = optax_accum.defer_reduction(p, batch) if args.defer else p
        updates, s = tx.update(jax.grad(loss)(q, x, y), s, p)
        return optax.apply_updates(p, updates), s

    # Explicit mesh: the state is sharded like the parameters. Under an
    # Auto mesh pass out_shardings=optax_accum.state_shardings(tx, params).
    state = jax.jit(tx.init)(params)
    for x, y in zip(xs, ys, strict=True):
        for xm, ym in zip(
            x.reshape(args.k, -1, D_IN), y.reshape(args.k, -1, D_OUT), strict=True
        ):
            params, state = step(params, state, place_rows(xm), place_rows(ym))
    return params, state.accumulator, "accumulator"


def train_microbatch(args, params, xs, ys, pure, place_rows):
    """One jit call per update: `optax_accum.microbatch`, then the optimizer.

    The device-local loop over the pure data axes (one reduction after it),
    or the global view where every batch axis shards a parameter (FSDP: its
    gathers stay per micro-batch).
    """
    data_axes, opt = pure or None, optimizer()
    loss = sharded_loss(args.layout, manual=pure)
    fun = optax_accum.microbatch(
        jax.value_and_grad(loss), args.k, batch_argnums=(1, 2), data_axes=data_axes
    )

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, x, y):
        _, grads = fun(p, x, y)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, grads

    state = jax.jit(opt.init)(params)
    for x, y in zip(xs, ys, strict=True):
        params, state, grads = step(params, state, place_rows(x), place_rows(y))
    return params, grads, f"gradients (data_axes={data_axes!r})"


def report(params, buffers, label: str, expected) -> bool:
    """Prints each parameter's and buffer's layout; whether they match."""
    print(f"{'param':6} {'param spec':24} {label + ' spec':30} bytes/device")
    for n, p in params.items():
        b = buffers[n]
        p_bytes = p.addressable_shards[0].data.nbytes
        b_bytes = b.addressable_shards[0].data.nbytes
        b_spec = str(b.sharding.spec)
        print(f"{n:6} {p.sharding.spec!s:24} {b_spec:30} {p_bytes} / {b_bytes}")
    diff = max(
        np.max(np.abs(jax.device_get(params[n]) - v)) for n, v in expected.items()
    )
    scale = max(np.max(np.abs(v)) for v in expected.values())
    print(f"max abs difference vs one device, full batch: {diff:.2e}")
    print(f"relative to the largest parameter: {diff / scale:.2e} (limit 1e-5)")
    return diff <= 1e-5 * scale


def main(argv=None) -> int:
    args = ARGS.parse_args(argv)
    if args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)  # before JAX starts
        jax.config.update("jax_platforms", "cpu")
    shape, axes, batch, stored, _ = LAYOUTS[args.layout]
    pure = tuple(a for a in batch if all(a not in s for s in stored.values()))
    if args.defer and (args.face != "accumulate" or not pure):
        ARGS.error("--defer needs --face accumulate and a pure data axis (not fsdp)")
    mesh = jax.make_mesh(shape, axes)  # Explicit axes by default
    params0, xs, ys = data(args.updates, args.k)
    with jax.set_mesh(mesh):
        params = {n: jax.device_put(v, stored[n]) for n, v in params0.items()}
        place_rows = lambda a: jax.device_put(a, NamedSharding(mesh, P(batch)))
        if args.face == "accumulate":
            out = train_accumulate(args, params, xs, ys, batch, place_rows)
        else:
            out = train_microbatch(args, params, xs, ys, pure, place_rows)
    print(f"layout {args.layout}: mesh {dict(mesh.shape)}, face {args.face}")
    return 0 if report(*out, jax.device_get(reference(params0, xs, ys))) else 1


if __name__ == "__main__":
    sys.exit(main())
