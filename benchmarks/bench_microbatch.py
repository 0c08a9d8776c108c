# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Fused micro-batch step vs the alternatives: time ratios and memory.

One process, interleaved rounds, median ratios (absolute CPU times are noise).
Every variant does one optimizer step (Adam) on the same effective batch of
``k * micro`` rows of a ReLU MLP: `optax_accum.microbatch`, a hand-written
``lax.scan``, ``optax.microbatching.microbatch`` (MEAN), the full batch in one
step, and k calls of `optax_accum.accumulate` and of ``optax.MultiSteps``. Run
``python benchmarks/bench_microbatch.py`` (four 1024x1024 layers, micro-batch
256, k = 16) or add ``--quick`` for a small config. `measure` returns the rows
as data (``config=`` sets other sizes, as ``benchmarks/run.py --device``
does), `markdown` renders them, ``--out PATH`` also writes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import microbatching

import optax_accum

CONFIGS: dict[str, dict[str, int]] = {
    "cpu": {"width": 1024, "layers": 4, "micro": 256, "k": 16, "rounds": 5},
    "quick": {"width": 256, "layers": 4, "micro": 64, "k": 8, "rounds": 5},
}
FUSED = "fused `microbatch` + adam (1 jit call)"


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
        FUSED: (fused, False),
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


def _compile(fun: Callable[..., Any], params: Any, state: Any, x: Any, y: Any) -> Any:
    # The optimizer state is an argument, not a closed-over constant: XLA would
    # otherwise fold the window counters and drop the optimizer branch. Params
    # and optimizer state are donated, as in a real train step.
    return jax.jit(fun, donate_argnums=(0, 1)).lower(params, state, x, y).compile()


def _time_update(
    step: Any, per_micro: bool, state: Any, batch: tuple, micro_batches: list
) -> harness.Timed:
    """One update from a fresh copy of ``state``: one call or k calls."""

    def run(inputs):
        p, s = inputs
        for xi, yi in micro_batches if per_micro else [batch]:
            p, s = step(p, s, xi, yi)
        return p, s

    return harness.Timed(run, lambda: jax.tree.map(jnp.copy, state))


def _memory(compiled: Any) -> dict[str, int]:
    mem = harness.compiled_memory(compiled)
    return {"temp_bytes": mem["temp"], "peak_bytes": mem["peak"]}


def _k_rows(
    k: int, micro: int, width: int, params: Any, state: Any, memory: dict
) -> list:
    """The fused step's memory against k, at a fixed micro-batch."""
    rows = []
    for kk in sorted({max(1, k // 4), k}):
        if kk == k:
            mem = memory[FUSED]
        else:
            fn = _variants(kk, micro)[FUSED][0]
            shape = jax.ShapeDtypeStruct((kk * micro, width), jnp.float32)
            labels = jax.ShapeDtypeStruct((kk * micro,), jnp.int32)
            mem = _memory(_compile(fn, params, state, shape, labels))
        rows.append({"k": kk, **mem})
    return rows


def measure(
    quick: bool = False,
    rounds: int | None = None,
    config: dict[str, int] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Runs the benchmark; returns its rows and config as a JSON-able dict.

    Args:
      quick: the small config of `CONFIGS`.
      rounds: timed rounds (after one warm-up call each), default the config's.
      config: ``width``, ``layers``, ``micro``, ``k``, ``rounds``; replaces the
        entry of `CONFIGS`.
      log: called with a line of progress (default: silent).
    """
    cfg = harness.cli.sizes(CONFIGS, quick, config, rounds=rounds)
    width, k, micro = cfg["width"], cfg["k"], cfg["micro"]
    log = log or (lambda _: None)
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
    states = {name: _init_state(name, k, params) for name in variants}
    updates, memory = {}, {}
    for name, (fn, per_micro) in variants.items():
        xs, ys = micro_batches[0] if per_micro else (x, y)
        compiled = _compile(fn, params, states[name], xs, ys)
        memory[name] = _memory(compiled)
        updates[name] = _time_update(
            compiled, per_micro, (params, states[name]), (x, y), micro_batches
        )
    log(f"compiled {len(updates)} variants")
    times = harness.interleaved(updates, cfg["rounds"])
    log(f"timed {cfg['rounds']} rounds")

    rows = [
        {
            "variant": name,
            "calls_per_update": k if variants[name][1] else 1,
            "time_per_update_s": harness.median(times[name]),
            "time_vs_fused": ratio.median,
            "time_vs_fused_iqr": [ratio.q25, ratio.q75],
            **memory[name],
        }
        for name, ratio in harness.ratios(times, FUSED).items()
    ]
    k_rows = _k_rows(k, micro, width, params, states[FUSED], memory)
    device = jax.devices()[0]
    return {
        "benchmark": "bench_microbatch",
        "config": cfg,
        "params": int(sum(v.size for v in jax.tree.leaves(params))),
        "optimizer": "adam(1e-3)",
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "compilations": len(updates) + len(k_rows) - 1,
        "rows": rows,
        "k_rows": k_rows,
    }


def markdown(data: dict[str, Any]) -> str:
    """The Markdown tables of `measure`'s result."""
    cfg = data["config"]
    width = cfg["width"]
    fused = next(r for r in data["rows"] if r["variant"] == FUSED)
    head = (
        f"MLP {cfg['layers']}x{width}x{width} ({data['params'] / 1e6:.1f}M params), "
        f"micro-batch {cfg['micro']}, k = {cfg['k']}, {data['optimizer']}; "
        f"{data['device']} ({data['backend']}), median of {cfg['rounds']} "
        f"interleaved rounds (fused step: {fused['time_per_update_s'] * 1e3:.1f} "
        "ms per update). Memory: compiled, of one call (peak = argument + output "
        "- alias + temp; one micro-batch for the k-call variants)."
    )
    mib = harness.mib
    variants = harness.table(
        ["variant", "time / fused", "temp memory (MiB)", "peak memory (MiB)"],
        (
            [
                r["variant"],
                f"{r['time_vs_fused']:.3f}",
                mib(r["temp_bytes"]),
                mib(r["peak_bytes"]),
            ]
            for r in data["rows"]
        ),
        "lrrr",
    )
    by_k = harness.table(
        ["k (micro-batch fixed)", "fused temp memory (MiB)", "fused peak (MiB)"],
        ([r["k"], mib(r["temp_bytes"]), mib(r["peak_bytes"])] for r in data["k_rows"]),
        "rrr",
    )
    return "\n".join([head, "", *variants, "", *by_k])


def main(argv: list[str] | None = None) -> int:
    return harness.script_main("bench_microbatch", __doc__, measure, markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
