# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Fused micro-batch step vs the alternatives: time ratios and temp memory.

One process, interleaved rounds, median ratios (absolute CPU times are noise).
Every variant does one optimizer step (Adam) on the same effective batch of
``k * micro`` rows of a ReLU MLP. Run ``python benchmarks/bench_microbatch.py``
(the issue's config: four 1024x1024 layers, micro-batch 256, k = 16) or add
``--quick`` for a small one. ``run(quick)`` returns the Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import microbatching

import optax_accum

CONFIGS = {
    False: {"width": 1024, "layers": 4, "micro": 256, "k": 16, "rounds": 5},
    True: {"width": 256, "layers": 4, "micro": 64, "k": 8, "rounds": 5},
}


def _loss(params, x, y):
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(x, y))


def _variants(k: int, micro: int) -> dict[str, tuple[Callable[..., Any], bool]]:
    """name -> (step(params, opt_state, x, y) -> (params, opt_state), per-micro)."""
    vg = jax.value_and_grad(_loss)
    tx = optax.adam(1e-3)

    def apply(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def fused(params, opt_state, x, y):
        _, grads = optax_accum.microbatch(vg, k, batch_argnums=(1, 2))(params, x, y)
        return apply(params, opt_state, grads)

    def hand_scan(params, opt_state, x, y):
        xs = x.reshape(micro, k, *x.shape[1:])
        ys = y.reshape(micro, k)

        def body(acc, i):
            _, g = vg(params, xs[:, i], ys[:, i])
            return jax.tree.map(jnp.add, acc, g), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        acc, _ = jax.lax.scan(body, zeros, jnp.arange(k))
        return apply(params, opt_state, jax.tree.map(lambda a: a / k, acc))

    def optax_mb(params, opt_state, x, y):
        mean = microbatching.AccumulationType.MEAN
        fun = microbatching.microbatch(
            vg, argnums=(1, 2), microbatch_size=micro, accumulator=mean
        )
        _, grads = fun(params, x, y)
        return apply(params, opt_state, grads)

    def full(params, opt_state, x, y):
        return apply(params, opt_state, vg(params, x, y)[1])

    def micro_step(tx_k):
        def step(params, opt_state, x, y):
            _, grads = vg(params, x, y)
            updates, opt_state = tx_k.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return step

    return {
        "fused `microbatch` + adam (1 jit call)": (fused, False),
        "hand-written `lax.scan` (the floor)": (hand_scan, False),
        "`optax.microbatching.microbatch` (MEAN)": (optax_mb, False),
        "full batch, no accumulation": (full, False),
        "`optax_accum.accumulate` (k jit calls)": (
            micro_step(optax_accum.accumulate(tx, k)),
            True,
        ),
        "`optax.MultiSteps` (k jit calls)": (
            micro_step(optax.MultiSteps(tx, k)),
            True,
        ),
    }


def _init_state(name: str, tx_k: int, params: Any) -> Any:
    tx = optax.adam(1e-3)
    if "accumulate" in name:
        return optax_accum.accumulate(tx, tx_k).init(params)
    if "MultiSteps" in name:
        return optax.MultiSteps(tx, tx_k).init(params)
    return tx.init(params)


def temp_mib(
    fun: Callable[..., Any], params: Any, state: Any, rows: int, width: int
) -> float:
    # The optimizer state is an argument, not a closed-over constant: XLA would
    # otherwise fold the window counters and drop the optimizer branch.
    x = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    y = jax.ShapeDtypeStruct((rows,), jnp.int32)
    # Donated like a real train step's params and optimizer state.
    compiled = jax.jit(fun, donate_argnums=(0, 1)).lower(params, state, x, y).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def run(quick: bool = False, rounds: int | None = None) -> str:
    """Runs the benchmark and returns the Markdown table (header included)."""
    cfg = CONFIGS[quick]
    width, k, micro = cfg["width"], cfg["k"], cfg["micro"]
    rounds = rounds or cfg["rounds"]
    keys = jax.random.split(jax.random.key(0), cfg["layers"] + 2)
    params = [
        {
            "w": jax.random.normal(kk, (width, width)) / np.sqrt(width),
            "b": jnp.zeros(width),
        }
        for kk in keys[: cfg["layers"]]
    ]
    x = jax.random.normal(keys[-2], (k * micro, width))
    y = jax.random.randint(keys[-1], (k * micro,), 0, width)
    micro_batches = [(x[i::k], y[i::k]) for i in range(k)]  # microbatch's split

    variants = _variants(k, micro)
    # Params and optimizer state are donated, as in a real train step.
    steps = {
        name: jax.jit(fn, donate_argnums=(0, 1)) for name, (fn, _) in variants.items()
    }
    states = {name: _init_state(name, k, params) for name in variants}

    def time_one(name: str) -> float:
        step, per_micro = steps[name], variants[name][1]
        p, s = jax.tree.map(jnp.copy, (params, states[name]))
        jax.block_until_ready((p, s))
        start = time.perf_counter()
        if per_micro:
            for xi, yi in micro_batches:
                p, s = step(p, s, xi, yi)
        else:
            p, s = step(p, s, x, y)
        jax.block_until_ready((p, s))
        return time.perf_counter() - start

    for name in variants:  # compile and warm up
        time_one(name)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name in variants:
            times[name].append(time_one(name))
    fused_name = next(iter(variants))
    ratios = {
        name: statistics.median(
            t / f for t, f in zip(times[name], times[fused_name], strict=True)
        )
        for name in variants
    }

    mem = {}
    for name, (fn, per_micro) in variants.items():
        state = states[name]
        mem[name] = temp_mib(
            fn, params, state, micro if per_micro else k * micro, width
        )

    n_params = sum(v.size for v in jax.tree.leaves(params))
    lines = [
        f"MLP {cfg['layers']}x{width}x{width} ({n_params / 1e6:.1f}M params), "
        f"micro-batch {micro}, k = {k}, Adam; median of {rounds} interleaved "
        f"rounds on {jax.devices()[0].platform} "
        f"(fused step: {statistics.median(times[fused_name]) * 1e3:.0f} ms).",
        "",
        "| variant | time / fused | temp memory (MiB) |",
        "|---|---:|---:|",
    ]
    for name in variants:
        lines.append(f"| {name} | {ratios[name]:.3f} | {mem[name]:.1f} |")

    lines += ["", "| k (micro-batch fixed) | fused temp memory (MiB) |", "|---:|---:|"]
    for kk in (k // 4, k):
        fn = _variants(kk, micro)[fused_name][0]
        mib = temp_mib(fn, params, states[fused_name], kk * micro, width)
        lines.append(f"| {kk} | {mib:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small config")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    print(run(quick=args.quick, rounds=args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
