# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Time and compiled memory of `accumulate` and `MultiSteps` vs ``optax.MultiSteps``.

Config: a 4.2M-parameter MLP (four 1024x1024 dense layers with GELU),
micro-batch 8, k = 8, Adam, a jit train step that donates params and optimizer
state, on the CPU. Rows are ratios against ``optax.MultiSteps`` measured in one
process, interleaved, as the median of the per-round ratios.

Run: ``python benchmarks/bench_accumulate.py [--quick] [--rounds N] [--out PATH]``.
`measure` returns the rows as data (``config=`` sets other sizes, as
``benchmarks/run.py --device`` does), `markdown` renders them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import harness
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


def _k_calls(compiled: Any, state: list, xs: list, ys: list) -> Callable[[], Any]:
    """One update: k calls of ``compiled``, carrying ``state[0]`` along."""

    def update():
        p, s = state[0]
        for x, y in zip(xs, ys, strict=True):
            p, s = compiled(p, s, x, y)
        state[0] = (p, s)
        return state[0]

    return update


def _floor(adam: Any, loss: Callable, params: Any, xs: list, ys: list) -> Callable:
    """k backward passes plus a single Adam step on the summed gradient."""
    grad_fn = jax.jit(jax.grad(loss))
    add_fn = jax.jit(lambda a, g: jax.tree.map(jnp.add, a, g), donate_argnums=0)

    def apply_adam(params, opt_state, grads):
        updates, opt_state = adam.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    floor_apply = jax.jit(apply_adam, donate_argnums=(0, 1))
    state = [(jax.tree.map(jnp.copy, params), adam.init(params))]

    def update():
        p, s = state[0]
        acc = grad_fn(p, xs[0], ys[0])
        for x, y in zip(xs[1:], ys[1:], strict=True):
            acc = add_fn(acc, grad_fn(p, x, y))
        state[0] = floor_apply(p, s, acc)
        return state[0]

    return update


def _candidates(k: int) -> dict[str, optax.GradientTransformation]:
    adam = optax.adam(1e-3)
    return {
        ANCHOR: optax.MultiSteps(adam, k).gradient_transformation(),
        NOISE_OFF: optax_accum.accumulate(adam, k),
        # The noise-scale estimator on: one squared norm more per step.
        NOISE_ON: optax_accum.accumulate(adam, k, noise_scale_decay=0.9),
        "optax_accum.MultiSteps": optax_accum.MultiSteps(
            adam, k
        ).gradient_transformation(),
    }


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
    cfg = harness.cli.sizes(CONFIGS, quick, config, micro=micro, rounds=rounds)
    log = log or (lambda _: None)
    params0, loss = _mlp(cfg["width"], cfg["depth"])
    rng = np.random.default_rng(0)
    shape = (cfg["micro"], cfg["width"])
    xs = [jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(cfg["k"])]
    ys = [jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(cfg["k"])]

    updates, memory = {}, {}
    for name, tx in _candidates(cfg["k"]).items():
        p = jax.tree.map(jnp.copy, params0)
        s = tx.init(p)
        compiled = _train_step(tx, loss).lower(p, s, xs[0], ys[0]).compile()
        memory[name] = harness.compiled_memory(compiled)
        updates[name] = _k_calls(compiled, [(p, s)], xs, ys)
    log(f"compiled {len(updates)} steps")
    updates[FLOOR] = _floor(optax.adam(1e-3), loss, params0, xs, ys)
    times = harness.interleaved(updates, cfg["rounds"])
    log(f"timed {cfg['rounds']} rounds")
    return _result(cfg, params0, times, memory)


def _result(cfg: dict, params: Any, times: dict, memory: dict) -> dict[str, Any]:
    rows = []
    for name, ratio in harness.ratios(times, ANCHOR).items():
        mem = memory.get(name)
        rows.append(
            {
                "step": name,
                "time_per_update_s": harness.median(times[name]),
                "time_vs_optax_multisteps": ratio.median,
                "time_vs_optax_multisteps_iqr": [ratio.q25, ratio.q75],
                "temp_bytes": mem["temp"] if mem else None,
                "peak_bytes": mem["peak"] if mem else None,
                "temp_vs_optax_multisteps": (
                    mem["temp"] / memory[ANCHOR]["temp"] if mem else None
                ),
            }
        )
    device = jax.devices()[0]
    return {
        "benchmark": "bench_accumulate",
        "config": cfg,
        "params": int(sum(x.size for x in jax.tree.leaves(params))),
        "optimizer": "adam(1e-3)",
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "compilations": len(memory) + 3,  # and the floor's three programs
        "rows": rows,
        "noise_scale_on_vs_off_time": harness.ratio(times, NOISE_ON, NOISE_OFF).median,
    }


def markdown(data: dict[str, Any]) -> str:
    """The Markdown table of `measure`'s result."""
    cfg = data["config"]
    anchor = next(r for r in data["rows"] if r["step"] == ANCHOR)
    head = (
        f"Config: MLP {cfg['depth']}x{cfg['width']}x{cfg['width']} "
        f"({data['params'] / 1e6:.1f}M params), micro-batch {cfg['micro']}, "
        f"k = {cfg['k']}, {data['optimizer']}, {data['device']} "
        f"({data['backend']}), median of {cfg['rounds']} interleaved rounds; "
        f"{ANCHOR} = {anchor['time_per_update_s'] * 1e3:.2f} ms per update. "
        "Memory: compiled, of one call (peak = argument + output - alias + temp)."
    )
    rows = [
        [
            r["step"],
            f"{r['time_vs_optax_multisteps']:.2f}x",
            "n/a"
            if r["temp_bytes"] is None
            else f"{r['temp_vs_optax_multisteps']:.2f}x",
            harness.mib(r["temp_bytes"]),
            harness.mib(r["peak_bytes"]),
        ]
        for r in data["rows"]
    ]
    header = [
        "step",
        f"time per update (k calls) vs {ANCHOR}",
        f"compiled temp memory vs {ANCHOR}",
        "temp (MiB)",
        "peak (MiB)",
    ]
    noise = (
        f"Noise scale on vs off: {data['noise_scale_on_vs_off_time']:.3f}x time per "
        "update (median of the per-round ratios)."
    )
    return "\n".join([head, "", *harness.table(header, rows, "lrrrr"), "", noise])


def main(argv: list[str] | None = None) -> int:
    return harness.script_main(
        "bench_accumulate",
        __doc__,
        measure,
        markdown,
        argv,
        lambda p: p.add_argument("--micro", type=int, help="micro-batch size"),
    )


if __name__ == "__main__":
    raise SystemExit(main())
