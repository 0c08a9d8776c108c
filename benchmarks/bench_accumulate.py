# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Time and compiled memory of `accumulate` and `MultiSteps` vs ``optax.MultiSteps``.

Config (issue 2): a 4.2M-parameter MLP (four 1024x1024 dense layers with GELU),
micro-batch 8, k = 8, Adam, a jit train step that donates params and optimizer
state, on the CPU. Rows are ratios against ``optax.MultiSteps`` measured in one
process, interleaved, as the median of several rounds.

Run: ``python benchmarks/bench_accumulate.py [--quick] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum


def _mlp(width: int, depth: int):
    keys = jax.random.split(jax.random.key(0), depth)
    params = [
        {
            "w": jax.random.normal(k, (width, width), jnp.float32) / np.sqrt(width),
            "b": jnp.zeros(width, jnp.float32),
        }
        for k in keys
    ]

    def loss(params, x, y):
        h = x
        for i, layer in enumerate(params):
            h = h @ layer["w"] + layer["b"]
            if i < len(params) - 1:
                h = jax.nn.gelu(h)
        return jnp.mean((h - y) ** 2)

    return params, loss


def _train_step(tx: optax.GradientTransformation, loss: Callable) -> Callable:
    def step(params, opt_state, x, y):
        grads = jax.grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1))


def run(quick: bool = False, rounds: int = 7, micro: int | None = None) -> str:
    """Runs the benchmark and returns a Markdown table."""
    width, depth, default_micro, k = (256, 4, 8, 4) if quick else (1024, 4, 8, 8)
    micro = micro or default_micro
    params0, loss = _mlp(width, depth)
    n_params = sum(x.size for x in jax.tree.leaves(params0))
    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.normal(size=(micro, width)), jnp.float32) for _ in range(k)]
    ys = [jnp.asarray(rng.normal(size=(micro, width)), jnp.float32) for _ in range(k)]
    adam = optax.adam(1e-3)

    candidates = {
        "optax.MultiSteps": optax.MultiSteps(adam, k).gradient_transformation(),
        "optax_accum.accumulate": optax_accum.accumulate(adam, k),
        # Issue 9: the noise-scale estimator on (one squared norm per step).
        "optax_accum.accumulate, noise scale on": optax_accum.accumulate(
            adam, k, noise_scale_decay=0.9
        ),
        "optax_accum.MultiSteps": optax_accum.MultiSteps(
            adam, k
        ).gradient_transformation(),
    }
    steps, states, mem = {}, {}, {}
    for name, tx in candidates.items():
        step = _train_step(tx, loss)
        p = jax.tree.map(jnp.copy, params0)
        s = tx.init(p)
        compiled = step.lower(p, s, xs[0], ys[0]).compile()
        mem[name] = compiled.memory_analysis().temp_size_in_bytes
        steps[name], states[name] = step, (p, s)

    # The floor: k backward passes plus a single Adam step on a summed gradient.
    grad_fn = jax.jit(jax.grad(loss))
    add_fn = jax.jit(lambda a, g: jax.tree.map(jnp.add, a, g), donate_argnums=0)

    def apply_adam(params, opt_state, grads):
        updates, opt_state = adam.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    floor_apply = jax.jit(apply_adam, donate_argnums=(0, 1))
    fp = jax.tree.map(jnp.copy, params0)
    fs = adam.init(fp)

    def one_update(name):
        p, s = states[name]
        step = steps[name]
        t0 = time.perf_counter()
        for i in range(k):
            p, s = step(p, s, xs[i], ys[i])
        jax.block_until_ready((p, s))
        states[name] = (p, s)
        return time.perf_counter() - t0

    def one_floor():
        nonlocal fp, fs
        t0 = time.perf_counter()
        acc = grad_fn(fp, xs[0], ys[0])
        for i in range(1, k):
            acc = add_fn(acc, grad_fn(fp, xs[i], ys[i]))
        fp, fs = floor_apply(fp, fs, acc)
        jax.block_until_ready((fp, fs))
        return time.perf_counter() - t0

    names = [*candidates, "floor (k grads + 1 Adam)"]
    times = {n: [] for n in names}
    for r in range(rounds + 1):  # round 0 warms up
        for name in candidates:
            t = one_update(name)
            if r:
                times[name].append(t)
        t = one_floor()
        if r:
            times[names[-1]].append(t)

    anchor = statistics.median(times["optax.MultiSteps"])
    lines = [
        f"Config: MLP {depth}x{width}x{width} ({n_params / 1e6:.1f}M params), "
        f"micro-batch {micro}, k = {k}, Adam, CPU, median of {rounds} interleaved "
        f"rounds; optax.MultiSteps = {anchor * 1e3:.1f} ms per update.",
        "",
        "| step | time per update (k calls) vs optax.MultiSteps "
        "| compiled temp memory vs optax.MultiSteps |",
        "|---|---|---|",
    ]
    for name in names:
        ratio = statistics.median(times[name]) / anchor
        m = f"{mem[name] / mem['optax.MultiSteps']:.2f}x" if name in mem else "n/a"
        lines.append(f"| {name} | {ratio:.2f}x | {m} |")
    on, off = "optax_accum.accumulate, noise scale on", "optax_accum.accumulate"
    per_round = [a / b for a, b in zip(times[on], times[off], strict=True)]
    lines.append("")
    lines.append(
        f"Noise scale on vs off: {statistics.median(per_round):.3f}x time per "
        "update (median of the per-round ratios)."
    )
    lines.append(
        "Temp memory (bytes): " + ", ".join(f"{n} {mem[n]:,}" for n in candidates)
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small config")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--micro", type=int, default=None, help="micro-batch size")
    args = parser.parse_args()
    print(run(args.quick, args.rounds, args.micro))


if __name__ == "__main__":
    main()
