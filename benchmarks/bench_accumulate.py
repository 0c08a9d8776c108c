# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Time and compiled memory of `accumulate` and `MultiSteps` vs ``optax.MultiSteps``.

Config: a 4.2M-parameter MLP (four 1024x1024 dense layers with GELU),
micro-batch 8, k = 8, Adam, a jit train step that donates params and optimizer
state, on the CPU. Rows are ratios against ``optax.MultiSteps`` measured in one
process, interleaved, as the median of the per-round ratios.

Run: ``python benchmarks/bench_accumulate.py [--quick] [--rounds N]``.
`measure` returns the rows as data (``config=`` sets other sizes, as
``benchmarks/run.py --device`` does), `markdown` renders them.
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

import optax_accum

CONFIGS: dict[str, dict[str, int]] = {
    "cpu": {"width": 1024, "depth": 4, "micro": 8, "k": 8, "rounds": 7},
    "quick": {"width": 256, "depth": 4, "micro": 8, "k": 4, "rounds": 7},
}
ANCHOR = "optax.MultiSteps"
FLOOR = "floor (k grads + 1 Adam)"
NOISE_ON = "optax_accum.accumulate, noise scale on"
NOISE_OFF = "optax_accum.accumulate"


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


def _per_round_median(times: dict[str, list[float]], name: str, anchor: str) -> float:
    return statistics.median(
        t / a for t, a in zip(times[name], times[anchor], strict=True)
    )


def measure(
    quick: bool = False,
    rounds: int | None = None,
    micro: int | None = None,
    config: dict[str, int] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Runs the benchmark; returns its rows and config as a JSON-able dict.

    Args:
      quick: the small config of `CONFIGS`.
      rounds: timed rounds (after one warm-up round), default the config's.
      micro: micro-batch size, default the config's.
      config: ``width``, ``depth``, ``micro``, ``k``, ``rounds``; replaces
        the entry of `CONFIGS`.
      log: called with a line of progress (default: silent).
    """
    cfg = dict(config if config is not None else CONFIGS["quick" if quick else "cpu"])
    if micro:
        cfg["micro"] = micro
    if rounds:
        cfg["rounds"] = rounds
    width, depth, micro, k = cfg["width"], cfg["depth"], cfg["micro"], cfg["k"]
    rounds = cfg["rounds"]
    log = log or (lambda _: None)
    params0, loss = _mlp(width, depth)
    n_params = sum(x.size for x in jax.tree.leaves(params0))
    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.normal(size=(micro, width)), jnp.float32) for _ in range(k)]
    ys = [jnp.asarray(rng.normal(size=(micro, width)), jnp.float32) for _ in range(k)]
    adam = optax.adam(1e-3)

    candidates = {
        ANCHOR: optax.MultiSteps(adam, k).gradient_transformation(),
        NOISE_OFF: optax_accum.accumulate(adam, k),
        # The noise-scale estimator on: one squared norm more per step.
        NOISE_ON: optax_accum.accumulate(adam, k, noise_scale_decay=0.9),
        "optax_accum.MultiSteps": optax_accum.MultiSteps(
            adam, k
        ).gradient_transformation(),
    }
    steps, states, memory = {}, {}, {}
    compilations = 0
    for name, tx in candidates.items():
        p = jax.tree.map(jnp.copy, params0)
        s = tx.init(p)
        compiled = _train_step(tx, loss).lower(p, s, xs[0], ys[0]).compile()
        compilations += 1
        stats = compiled.memory_analysis()
        memory[name] = {
            "temp": int(stats.temp_size_in_bytes),
            "peak": optax_accum.compiled_memory_bytes(compiled),
        }
        steps[name], states[name] = compiled, (p, s)
    log(f"compiled {compilations} steps")

    # The floor: k backward passes plus a single Adam step on a summed gradient.
    grad_fn = jax.jit(jax.grad(loss))
    add_fn = jax.jit(lambda a, g: jax.tree.map(jnp.add, a, g), donate_argnums=0)

    def apply_adam(params, opt_state, grads):
        updates, opt_state = adam.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    floor_apply = jax.jit(apply_adam, donate_argnums=(0, 1))
    compilations += 3  # on the first floor round
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

    names = [*candidates, FLOOR]
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):  # round 0 warms up
        for name in candidates:
            t = one_update(name)
            if r:
                times[name].append(t)
        t = one_floor()
        if r:
            times[FLOOR].append(t)
    log(f"timed {rounds} rounds")

    anchor_mem = memory[ANCHOR]
    rows = []
    for name in names:
        mem = memory.get(name)
        rows.append(
            {
                "step": name,
                "time_per_update_s": statistics.median(times[name]),
                "time_vs_optax_multisteps": _per_round_median(times, name, ANCHOR),
                "temp_bytes": mem["temp"] if mem else None,
                "peak_bytes": mem["peak"] if mem else None,
                "temp_vs_optax_multisteps": (
                    mem["temp"] / anchor_mem["temp"] if mem else None
                ),
            }
        )
    device = jax.devices()[0]
    return {
        "benchmark": "bench_accumulate",
        "config": cfg,
        "params": int(n_params),
        "optimizer": "adam(1e-3)",
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "compilations": compilations,
        "rows": rows,
        "noise_scale_on_vs_off_time": _per_round_median(times, NOISE_ON, NOISE_OFF),
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def markdown(data: dict[str, Any]) -> str:
    """The Markdown table of `measure`'s result."""
    cfg = data["config"]
    width, depth = cfg["width"], cfg["depth"]
    anchor = next(r for r in data["rows"] if r["step"] == ANCHOR)
    lines = [
        f"Config: MLP {depth}x{width}x{width} ({data['params'] / 1e6:.1f}M params), "
        f"micro-batch {cfg['micro']}, k = {cfg['k']}, {data['optimizer']}, "
        f"{data['device']} ({data['backend']}), median of {cfg['rounds']} "
        f"interleaved rounds; {ANCHOR} = "
        f"{anchor['time_per_update_s'] * 1e3:.2f} ms per update. Memory: "
        "compiled, of one call (peak = argument + output - alias + temp).",
        "",
        f"| step | time per update (k calls) vs {ANCHOR} "
        f"| compiled temp memory vs {ANCHOR} | temp (MiB) | peak (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        temp = r["temp_vs_optax_multisteps"]
        lines.append(
            f"| {r['step']} | {r['time_vs_optax_multisteps']:.2f}x | "
            + ("n/a" if temp is None else f"{temp:.2f}x")
            + f" | {_mib(r['temp_bytes'])} | {_mib(r['peak_bytes'])} |"
        )
    lines += [
        "",
        f"Noise scale on vs off: {data['noise_scale_on_vs_off_time']:.3f}x time per "
        "update (median of the per-round ratios).",
    ]
    return "\n".join(lines)


def run(
    quick: bool = False, rounds: int | None = None, micro: int | None = None
) -> str:
    """Runs the benchmark and returns the Markdown table."""
    return markdown(measure(quick, rounds, micro))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small config")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--micro", type=int, default=None, help="micro-batch size")
    args = parser.parse_args()
    print(run(args.quick, args.rounds, args.micro))


if __name__ == "__main__":
    main()
