# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The fused loop on a conv net: the Flax NNX MNIST tutorial's CNN.

conv 32 -> avg pool -> conv 64 -> avg pool -> dense 256 -> dense 10 on 28x28x1
inputs, batch 32, k = 4 (issue 33, section 7). One process, interleaved
rounds, median ratios with their 25th and 75th percentiles. Two tables:

1. gradients of one batch: ``jax.value_and_grad`` of the whole batch,
   `microbatch` at k = 1 and k = 4 (the loop; and ``unroll=True``), a
   hand-written ``lax.scan`` over the micro-batches ``i::k``, and the same k
   micro-batches unrolled in Python (the floor);
2. one optimizer step (Adam) of the ``nnx.Module``: `nnx_train_step` at
   k = 4 against one large-batch step and against ``optax.MultiSteps``
   (k jit calls of a micro-batch step).

On the CPU, XLA lays out a convolution for its fast kernels only outside a
loop; the hand-written scan shows what that costs, and `microbatch` relays
its loop body's convolutions out (``optax_accum/_microbatch/_layout.py``).
Run ``python benchmarks/bench_conv.py --out benchmarks/results/conv.md``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import harness
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax

import optax_accum
from optax_accum.flax import nnx_train_step

CONFIGS: dict[str, dict[str, int]] = {
    "cpu": {"batch": 32, "k": 4, "k_unroll": 16, "rounds": 9},
    "quick": {"batch": 16, "k": 4, "k_unroll": 8, "rounds": 5},
}
FLOOR = "k micro-batches unrolled in Python (the floor)"


class CNN(nnx.Module):
    """The Flax NNX MNIST tutorial's model (without dropout)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.conv1(x)))
        x = self.avg_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


def _model_loss(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _data(batch: int) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (batch, 28, 28, 1), jnp.float32)
    return x, jax.random.randint(ky, (batch,), 0, 10)


def _gradient_variants(k: int) -> tuple[dict[str, Any], Any]:
    graphdef, params = nnx.split(CNN(rngs=nnx.Rngs(0)))

    def loss(p, x, y):
        return _model_loss(nnx.merge(graphdef, p), x, y)

    vg = jax.value_and_grad(loss)
    mb = partial(optax_accum.microbatch, vg, batch_argnums=(1, 2))

    def hand_scan(p, x, y):
        xs = x.reshape(x.shape[0] // k, k, *x.shape[1:])
        ys = y.reshape(y.shape[0] // k, k)

        def body(acc, i):
            xi = lax.dynamic_index_in_dim(xs, i, 1, keepdims=False)
            yi = lax.dynamic_index_in_dim(ys, i, 1, keepdims=False)
            return jax.tree.map(jnp.add, acc, vg(p, xi, yi)), None

        zeros = jax.tree.map(jnp.zeros_like, (jnp.float32(0), p))
        acc, _ = lax.scan(body, zeros, jnp.arange(k))
        return jax.tree.map(lambda a: a / k, acc)

    def block_scan(p, x, y):  # micro-batch i = rows i*B/k ... (i+1)*B/k - 1
        xs = x.reshape(k, x.shape[0] // k, *x.shape[1:])
        ys = y.reshape(k, y.shape[0] // k)

        def body(acc, xy):
            return jax.tree.map(jnp.add, acc, vg(p, *xy)), None

        zeros = jax.tree.map(jnp.zeros_like, (jnp.float32(0), p))
        acc, _ = lax.scan(body, zeros, (xs, ys))
        return jax.tree.map(lambda a: a / k, acc)

    def unrolled(p, x, y):
        outs = [vg(p, x[i::k], y[i::k]) for i in range(k)]
        return jax.tree.map(lambda *a: sum(a) / k, *outs)

    variants = {
        "`jax.value_and_grad`, whole batch": vg,
        "`microbatch`, k = 1": mb(1),
        f"`microbatch`, k = {k} (the loop)": mb(k),
        f"`microbatch`, k = {k}, `unroll=True`": mb(k, unroll=True),
        f"hand-written `lax.scan`, k = {k}": hand_scan,
        f"hand-written `lax.scan` over contiguous blocks, k = {k}": block_scan,
        FLOOR: unrolled,
    }
    return variants, params


def _gradient_rows(cfg: dict, rounds: int) -> dict:
    variants, params = _gradient_variants(cfg["k"])
    x, y = _data(cfg["batch"])
    compiled = {
        n: jax.jit(f).lower(params, x, y).compile() for n, f in variants.items()
    }
    times = harness.interleaved(
        {n: partial(c, params, x, y) for n, c in compiled.items()}, rounds
    )
    return _rows(times, [FLOOR, "`jax.value_and_grad`, whole batch"])


def _unroll_rows(cfg: dict, rounds: int) -> dict:
    """``unroll`` at a larger k: time against the loop, compiled temp memory."""
    k = cfg["k_unroll"]
    graphdef, params = nnx.split(CNN(rngs=nnx.Rngs(0)))

    def loss(p, x, y):
        return _model_loss(nnx.merge(graphdef, p), x, y)

    x, y = _data(cfg["batch"] * k // cfg["k"])
    vg = jax.value_and_grad(loss)
    compiled = {
        f"`unroll={u}`": jax.jit(
            optax_accum.microbatch(vg, k, batch_argnums=(1, 2), unroll=u)
        )
        .lower(params, x, y)
        .compile()
        for u in (1, 4, True)
    }
    times = harness.interleaved(
        {n: partial(c, params, x, y) for n, c in compiled.items()}, rounds
    )
    out = _rows(times, ["`unroll=1`"])
    for row in out["rows"]:
        row["temp_bytes"] = harness.compiled_memory(compiled[row["variant"]])["temp"]
    out["k"], out["rows_per_micro_batch"] = k, x.shape[0] // k
    return out


def _step_rows(cfg: dict, rounds: int) -> dict:
    k, x_y = cfg["k"], _data(cfg["batch"])
    x, y = x_y
    micro = [(x[i::k], y[i::k]) for i in range(k)]

    def plain_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(_model_loss)(model, x, y)
        optimizer.update(model, grads)
        return loss

    def pure(step, tx):
        """``step`` as a jitted function of the split state (compiled once)."""
        model = CNN(rngs=nnx.Rngs(0))
        graphdef, state = nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))

        @jax.jit
        def call(state, x, y):
            model, optimizer = nnx.merge(graphdef, state)
            loss = step(model, optimizer, x, y)
            return loss, nnx.state((model, optimizer))

        return call, state

    def timed(step, tx, batches):
        call, state = pure(step, tx)

        def go(state):
            for bx, by in batches:
                _, state = call(state, bx, by)
            return state

        return harness.Timed(go, lambda: jax.tree.map(jnp.copy, state))

    adam = optax.adam(1e-3)
    variants = {
        "one large-batch step (`nnx.value_and_grad`)": timed(plain_step, adam, [x_y]),
        f"`nnx_train_step`, k = {k} (1 jit call)": timed(
            nnx_train_step(_model_loss, k), adam, [x_y]
        ),
        f"`optax.MultiSteps`, k = {k} ({k} jit calls)": timed(
            plain_step, optax.MultiSteps(adam, k), micro
        ),
    }
    times = harness.interleaved(variants, rounds)
    return _rows(times, list(variants)[::2])


def _rows(times: dict, anchors: list[str]) -> dict:
    ratios = {a: harness.ratios(times, a) for a in anchors}
    return {
        "anchors": anchors,
        "rows": [
            {
                "variant": name,
                "median_ms": 1e3 * harness.median(ts),
                **{f"vs {a}": ratios[a][name]._asdict() for a in anchors},
            }
            for name, ts in times.items()
        ],
    }


def measure(quick: bool = False, rounds: int | None = None, config=None) -> dict:
    cfg = harness.cli.sizes(CONFIGS, quick, config, rounds=rounds)
    return {
        "config": cfg,
        "gradients": _gradient_rows(cfg, cfg["rounds"]),
        "steps": _step_rows(cfg, cfg["rounds"]),
        "unroll": _unroll_rows(cfg, cfg["rounds"]),
    }


def _ratio(r: dict) -> str:
    return f"{r['median']:.2f}x ({r['q25']:.2f}-{r['q75']:.2f})"


def _table(part: dict, memory: bool = False) -> list[str]:
    header = ["variant", "median ms", *(f"vs {a}" for a in part["anchors"])]
    rows = [
        [
            r["variant"],
            f"{r['median_ms']:.1f}",
            *(_ratio(r[f"vs {a}"]) for a in part["anchors"]),
            *([harness.mib(r["temp_bytes"])] if memory else []),
        ]
        for r in part["rows"]
    ]
    if memory:
        header.append("compiled temp MiB")
    align = "lr" + "r" * len(part["anchors"]) + ("r" if memory else "")
    return harness.table(header, rows, align)


def markdown(data: dict) -> str:
    cfg = data["config"]
    env = harness.device_info()
    lines = [
        "# The fused loop on a conv net (the Flax NNX MNIST tutorial's CNN)",
        "",
        f"Batch {cfg['batch']} of 28x28x1, k = {cfg['k']}, on {env['device']} "
        f"({env['backend']}), XLA's default flags; {cfg['rounds']} interleaved "
        "rounds, median time ratios with the 25th-75th percentiles. Made by "
        f"`{harness.report.command_line()}`.",
        "",
        "## Gradients of one batch",
        "",
        *_table(data["gradients"]),
        "",
        "The hand-written `lax.scan` shows the cost of a convolution inside a "
        "loop on the CPU: XLA's `ConvCanonicalization` lays out convolutions "
        "for the fast kernels in the entry computation only, so the weight "
        "gradients' convolutions (`dim_labels=f01b_i01o->01bf`) run a naive "
        "kernel. The strided split (rows `i::k`) is not the cause: a scan over "
        "contiguous blocks is as slow, and the same strided micro-batches "
        "unrolled are fast. `microbatch` relays its loop body's convolutions "
        "out as that pass would, and runs k = 1 without a loop.",
        "",
        "## One optimizer step (Adam) of the `nnx.Module`",
        "",
        *_table(data["steps"]),
        "",
        f"## `unroll` at k = {data['unroll']['k']}",
        "",
        f"`microbatch` at k = {data['unroll']['k']} "
        f"({data['unroll']['rows_per_micro_batch']} rows a micro-batch): the "
        "time against the loop (`unroll=1`, the default) and the compiled "
        "temporary memory, which an unrolled loop lets grow with k.",
        "",
        *_table(data["unroll"], memory=True),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(harness.script_main("conv", __doc__, measure, markdown))
