# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The transformer workload: remat x precision x accumulation, memory and time.

The reference GPT of ``examples/gpt.py`` (``cpu_small``, 10.3M parameters and
sequence 128 on the CPU; ``gpt2_small``, 124M and 1024 on a GPU or TPU) trained
with AdamW, for remat in {none, dots, full} x compute in {f32, bf16} x k
micro-batches of a fixed size, two ways: the fused `optax_accum.microbatch`
step (one call) and k calls of a step with `optax_accum.accumulate`.

- Memory: XLA's compiled peak per device, ``argument + output - alias +
  temp`` (`optax_accum.compiled_memory_bytes`), of one call: the whole update
  for the fused step, one micro-batch for `accumulate`.
- Time per token, as a ratio to the f32, no-remat, full-batch step on the same
  tokens, measured in one process, interleaved, median over rounds.
- Anchors for the targets: a hand-written ``lax.scan`` of the same step, and
  ``optax.MultiSteps`` (k calls).
- The largest micro-batch (and effective batch) that fits a memory budget,
  per combination, from `optax_accum.plan_microbatch`.
- The small-micro-batch slowdown: time per token against the micro-batch size
  at a fixed effective batch.

Every step donates its params and optimizer state. Run
``python benchmarks/bench_transformer.py`` (writes the table, a JSON file and a
plot to ``benchmarks/results/``) or ``--quick`` (a tiny model, seconds).
``run(quick)`` returns the Markdown and writes nothing unless given an
``out_dir``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

import optax_accum

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
MiB = 2**20


def _load_gpt():
    path = ROOT / "examples" / "gpt.py"
    module = sys.modules.get("gpt")
    if module is not None and getattr(module, "__file__", None) == str(path):
        return module
    spec = importlib.util.spec_from_file_location("gpt", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpt"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gpt = _load_gpt()

REMATS = ("none", "dots", "full")
DTYPES = {"f32": "float32", "bf16": "bfloat16"}
COMBOS = tuple((r, d) for r in REMATS for d in DTYPES)
ANCHOR = ("none", "f32")
# Sizes by backend. "ks" are the k of the fused step for the anchor combination
# (no remat, f32), "ks_other" for the others; `accumulate` runs k calls of one
# compiled step whose buffers do not depend on k, so it is measured at
# "acc_ks" (anchor) and "acc_ks_other". The hand scan and optax.MultiSteps are
# measured at "target_ks". On the CPU, XLA compiles the 10M model in 5 to 30 s
# per variant on 2 busy cores, so the grid is cut there: 43
# variants, 39 minutes on a 2-core machine loaded by other jobs.
SIZES: dict[str, dict[str, Any]] = {
    "cpu": {
        "preset": "cpu_small",
        "micro": 2,
        "combos": COMBOS,
        "ks": (1, 2, 4, 8, 16),
        "ks_other": (1, 4, 16),
        "acc_ks": (4, 16),
        "acc_ks_other": (4,),
        "target_ks": (4, 16),
        "rounds": 3,
        "budget": 512 * MiB,
        "plan_target": 512,
        "plan_max": 64,
        "sweep_batch": 16,
        "sweep_micros": (1, 2, 4, 8),
    },
    "accelerator": {
        "preset": "gpt2_small",
        "micro": 4,
        "combos": COMBOS,
        "ks": (1, 2, 4, 8, 16),
        "ks_other": (1, 2, 4, 8, 16),
        "acc_ks": (2, 4, 8, 16),
        "acc_ks_other": (2, 4, 8, 16),
        "target_ks": (4, 16),
        "rounds": 5,
        "budget": None,  # the device's free memory
        "plan_target": 1024,
        "plan_max": 1024,
        "sweep_batch": 32,
        "sweep_micros": (1, 2, 4, 8, 16),
    },
    "quick": {  # a smoke test: 10 compilations of a one-layer model
        "preset": "tiny",
        "changes": {"n_layers": 1},
        "micro": 2,
        "combos": (ANCHOR,),
        "ks": (4,),
        "ks_other": (4,),
        "acc_ks": (4,),
        "acc_ks_other": (4,),
        "target_ks": (4,),
        "rounds": 2,
        "budget": 64 * MiB,
        "plan_target": 4,
        "plan_max": 4,
        "sweep_batch": 4,
        "sweep_micros": (1,),
    },
}


def sizes_for(quick: bool, backend: str | None = None) -> dict[str, Any]:
    if quick:
        return dict(SIZES["quick"])
    backend = backend or jax.default_backend()
    return dict(SIZES["cpu" if backend == "cpu" else "accelerator"])


def _tx() -> optax.GradientTransformation:
    return optax.adamw(3e-4, weight_decay=0.1)


class Variant:
    """One way to take an update: its compiled step, its inputs and its sizes."""

    def __init__(self, mode: str, remat: str, dtype: str, k: int, micro: int):
        self.mode, self.remat, self.dtype, self.k, self.micro = (
            mode,
            remat,
            dtype,
            k,
            micro,
        )
        self.per_micro = mode in ("accumulate", "multisteps")
        self.compiled: Any = None
        self.compile_seconds = 0.0
        self.memory: dict[str, int] = {}

    @property
    def key(self) -> tuple:
        return (self.mode, self.remat, self.dtype, self.k, self.micro)

    @property
    def rows(self) -> int:
        """Sequences per call."""
        return self.micro if self.per_micro else self.k * self.micro


def _step_fn(v: Variant, cfg: Any) -> tuple[Callable[..., Any], str]:
    """``(step(params, opt_state, batch) -> (params, opt_state), state kind)``."""
    loss = gpt.make_loss(cfg.replace(remat=v.remat, dtype=DTYPES[v.dtype]))
    vg = jax.value_and_grad(loss)
    tx, k = _tx(), v.k

    def apply(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    if v.mode == "full":
        return (lambda p, s, b: apply(p, s, vg(p, b)[1])), "adamw"
    if v.mode == "microbatch":
        fused = optax_accum.microbatch(vg, k, weight_fn=gpt.token_count)
        return (lambda p, s, b: apply(p, s, fused(p, b)[1])), "adamw"
    if v.mode == "scan":  # the same step, written by hand

        def scan_step(p, s, b):
            split = jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, -1), b)

            def body(carry, i):
                acc, wsum = carry
                mb = jax.tree.map(lambda x: x[:, i], split)
                w = gpt.token_count(mb)
                g = vg(p, mb)[1]
                acc = jax.tree.map(lambda a, gi: a + w * gi, acc, g)
                return (acc, wsum + w), None

            zeros = jax.tree.map(jnp.zeros_like, p)
            (acc, wsum), _ = jax.lax.scan(
                body, (zeros, jnp.zeros([], jnp.float32)), jnp.arange(k)
            )
            return apply(p, s, jax.tree.map(lambda a: a / wsum, acc))

        return scan_step, "adamw"
    if v.mode == "accumulate":
        acc_tx = optax_accum.accumulate(tx, k)

        def acc_step(p, s, b):
            g = jax.grad(loss)(p, b)
            u, s = acc_tx.update(g, s, p, weight=gpt.token_count(b))
            return optax.apply_updates(p, u), s

        return acc_step, "accumulate"
    if v.mode == "multisteps":
        ms = optax.MultiSteps(tx, k)

        def ms_step(p, s, b):
            g = jax.grad(loss)(p, b)
            u, s = ms.update(g, s, p)
            return optax.apply_updates(p, u), s

        return ms_step, "multisteps"
    raise ValueError(f"unknown mode {v.mode!r}")


def _init_state(kind: str, params: Any) -> Any:
    tx = _tx()
    if kind == "accumulate":
        return optax_accum.accumulate(tx, 2).init(params)
    if kind == "multisteps":
        return optax.MultiSteps(tx, 2).init(params)
    return tx.init(params)


def _nbytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


class Bench:
    """Compiles the variants once, measures memory, times them interleaved.

    ``sizes`` needs ``preset`` (and may have ``changes``) of `gpt.preset`; the
    optimizer states are made on first use, one per kind of step.
    """

    def __init__(self, sizes: dict[str, Any], log: Callable[[str], None] = print):
        self.sizes, self.log = sizes, log
        self.cfg = gpt.preset(sizes["preset"], **sizes.get("changes", {}))
        self.params = gpt.init_params(self.cfg)
        self.states: dict[str, Any] = {}
        self.variants: dict[tuple, Variant] = {}
        self.kinds: dict[tuple, str] = {}
        self.batches: dict[int, Any] = {}
        self.compilations = 0

    def state(self, kind: str) -> Any:
        """The optimizer state of a kind of step (``adamw``, ``accumulate``...)."""
        if kind not in self.states:
            self.states[kind] = _init_state(kind, self.params)
        return self.states[kind]

    def batch(self, rows: int) -> Any:
        if rows not in self.batches:
            key = jax.random.fold_in(jax.random.key(1), rows)
            self.batches[rows] = gpt.random_batch(key, self.cfg, rows)
        return self.batches[rows]

    def inputs(self, v: Variant) -> list[Any]:
        """What one update feeds: the batch, or its k micro-batches."""
        batch = self.batch(v.k * v.micro)
        if not v.per_micro:
            return [batch]
        # The rows `microbatch` gives micro-batch i: i, i + k, i + 2k, ...
        return [jax.tree.map(lambda x, i=i: x[i :: v.k], batch) for i in range(v.k)]

    def add(self, mode: str, remat: str, dtype: str, k: int, micro: int) -> Variant:
        return self.add_many([(mode, remat, dtype, k, micro)])[0]

    def add_many(
        self, keys: list[tuple], threads: int = 1, deadline: float | None = None
    ) -> list[Variant]:
        """Compiles the variants of ``keys``, ``(mode, remat, dtype, k, micro)``.

        Each is lowered here, then compiled in a pool of ``threads`` threads
        (XLA releases the GIL while it compiles), so the next lowering overlaps
        the compilations. After ``deadline`` (a `time.monotonic` value) no new
        variant is lowered. Returns the variants of ``keys`` that exist.
        """
        keys = [tuple(key) for key in keys]
        todo = list(dict.fromkeys(k for k in keys if k not in self.variants))

        def compile_(lowered: Any) -> tuple[Any, float]:
            start = time.perf_counter()
            compiled = lowered.compile()
            return compiled, time.perf_counter() - start

        with ThreadPoolExecutor(max(1, threads)) as pool:
            futures = {}
            for key in todo:
                if deadline is not None and time.monotonic() > deadline:
                    self.log(f"not compiled (time budget): {len(todo) - len(futures)}")
                    break
                v = Variant(*key)
                fn, kind = _step_fn(v, self.cfg)
                example = self.inputs(v)[0]
                lowered = jax.jit(fn, donate_argnums=(0, 1)).lower(
                    self.params, self.state(kind), example
                )
                futures[pool.submit(compile_, lowered)] = (v, kind)
            for future in as_completed(futures):
                v, kind = futures[future]
                v.compiled, v.compile_seconds = future.result()
                self._record(v, kind)
        return [self.variants[k] for k in keys if k in self.variants]

    def _record(self, v: Variant, kind: str) -> None:
        stats = v.compiled.memory_analysis()
        v.memory = {
            "peak": optax_accum.compiled_memory_bytes(v.compiled),
            "temp": int(stats.temp_size_in_bytes),
            "argument": int(stats.argument_size_in_bytes),
            "output": int(stats.output_size_in_bytes),
            "alias": int(stats.alias_size_in_bytes),
            "state": _nbytes((self.params, self.state(kind))),
        }
        self.log(
            f"compiled {v.key} in {v.compile_seconds:.1f} s: "
            f"peak {v.memory['peak'] / MiB:.1f} MiB"
        )
        self.variants[v.key], self.kinds[v.key] = v, kind
        self.compilations += 1

    def time_once(self, v: Variant) -> float:
        p, s = jax.tree.map(jnp.copy, (self.params, self.states[self.kinds[v.key]]))
        inputs = self.inputs(v)
        jax.block_until_ready((p, s, inputs))
        start = time.perf_counter()
        for b in inputs:
            p, s = v.compiled(p, s, b)
        jax.block_until_ready((p, s))
        return time.perf_counter() - start

    def time_all(self, keys: list[tuple], rounds: int) -> dict[tuple, list[float]]:
        for key in keys:  # warm up
            self.time_once(self.variants[key])
        times: dict[tuple, list[float]] = {key: [] for key in keys}
        for r in range(rounds):
            start = time.perf_counter()
            for key in keys:
                times[key].append(self.time_once(self.variants[key]))
            self.log(f"round {r + 1}/{rounds}: {time.perf_counter() - start:.1f} s")
        return times


def _ratio(times: dict, key: tuple, anchor: tuple) -> float:
    """Median over rounds of time(key) / time(anchor), both from one round."""
    return statistics.median(
        t / a for t, a in zip(times[key], times[anchor], strict=True)
    )


def _planner(
    step: Callable[..., Any],
    params: Any,
    state: Any,
    example: Any,
    target: int,
    budget: int | None,
    max_size: int,
) -> dict:
    """`optax_accum.plan_microbatch` as a dict, or ``{"error": ...}`` if even
    the smallest size does not fit."""
    try:
        plan = optax_accum.plan_microbatch(
            step,
            params,
            state,
            example,
            target,
            memory_budget=budget,
            max_microbatch_size=max_size,
        )
    except ValueError as e:  # even one sequence does not fit
        return {"error": str(e)}
    return plan._asdict()


def _plan_size(plan: dict) -> int:
    return plan["microbatch_size"]


def _plan(bench: Bench, remat: str, dtype: str, budget: int | None) -> dict:
    """The largest micro-batch of an `accumulate` step under the budget."""
    v = Variant("accumulate", remat, dtype, 1, 1)
    fn, kind = _step_fn(v, bench.cfg)
    return _planner(
        jax.jit(fn, donate_argnums=(0, 1)),
        bench.params,
        bench.state(kind),
        gpt.example(bench.cfg),
        bench.sizes["plan_target"],
        budget,
        bench.sizes["plan_max"],
    )


def measure(
    quick: bool = False,
    rounds: int | None = None,
    log: Callable[[str], None] | None = None,
    sizes: dict[str, Any] | None = None,
) -> dict:
    """Runs the benchmark; returns every number as a JSON-able dict.

    ``sizes`` replaces the backend's entry of `SIZES` (the tests use it).
    """
    sizes = dict(sizes) if sizes is not None else sizes_for(quick)
    rounds = rounds or sizes["rounds"]
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    bench = Bench(sizes, log)
    micro = sizes["micro"]
    start = time.perf_counter()

    # The anchors: the f32, no-remat step on the whole batch, by batch size.
    full: dict[int, tuple] = {}
    grid, timed = [], []
    for remat, dtype in sizes["combos"]:
        anchor = (remat, dtype) == ANCHOR
        for mode, ks_ in (
            ("microbatch", sizes["ks"] if anchor else sizes["ks_other"]),
            ("accumulate", sizes["acc_ks"] if anchor else sizes["acc_ks_other"]),
        ):
            for k in ks_:
                if k * micro not in full:
                    full[k * micro] = bench.add("full", *ANCHOR, 1, k * micro).key
                key = bench.add(mode, remat, dtype, k, micro).key
                grid.append(key)
                timed.append(key)
    for k in sizes["target_ks"]:
        for mode in ("scan", "multisteps"):
            timed.append(bench.add(mode, *ANCHOR, k, micro).key)
    timed += list(full.values())
    # The small-micro-batch sweep: a fixed effective batch E in micro-batches of m.
    e = sizes["sweep_batch"]
    full[e] = bench.add("full", "none", "f32", 1, e).key
    sweep = []
    for m in sizes["sweep_micros"]:
        for mode in ("microbatch", "accumulate"):
            sweep.append(bench.add(mode, "none", "f32", e // m, m).key)
    timed = list(dict.fromkeys([*timed, full[e], *sweep]))
    # On a GPU or TPU, a full batch of k micro-batches may not fit: measured
    # (compiled), never run.
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        limit = 0.9 * stats["bytes_limit"]
        too_big = [key for key in timed if bench.variants[key].memory["peak"] > limit]
        for key in too_big:
            log(f"not timed (peak over 90% of the device's memory): {key}")
        timed = [key for key in timed if key not in too_big]
    compile_s = time.perf_counter() - start

    times = bench.time_all(timed, rounds)
    time_s = time.perf_counter() - start - compile_s

    def row(key: tuple) -> dict:
        v = bench.variants[key]
        anchor = full[v.k * v.micro]
        return {
            "mode": v.mode,
            "remat": v.remat,
            "dtype": v.dtype,
            "k": v.k,
            "micro_batch": v.micro,
            "effective_batch": v.k * v.micro,
            "tokens_per_update": v.k * v.micro * bench.cfg.seq_len,
            "memory": v.memory,
            "seconds_median": statistics.median(times[key]) if key in times else None,
            "time_per_token_vs_full_f32": (
                _ratio(times, key, anchor) if key in times and anchor in times else None
            ),
        }

    rows = [row(key) for key in grid]
    anchor_rows = [
        row(key) for key in timed if key[0] in ("full", "scan", "multisteps")
    ]
    sweep_rows = [row(key) for key in sweep]

    mv = bench.variants
    targets = []
    for k in sizes["target_ks"]:
        fused, acc, scan, ms = (
            (mode, *ANCHOR, k, micro)
            for mode in ("microbatch", "accumulate", "scan", "multisteps")
        )
        targets.append(
            {
                "k": k,
                "fused_vs_scan_time": _ratio(times, fused, scan),
                "fused_vs_scan_peak": mv[fused].memory["peak"]
                / mv[scan].memory["peak"],
                "accumulate_vs_multisteps_time": _ratio(times, acc, ms),
                # The floor of accumulation: k gradients and one AdamW step.
                "scan_vs_multisteps_time": _ratio(times, scan, ms),
                "accumulate_vs_multisteps_temp": (
                    mv[acc].memory["temp"] / mv[ms].memory["temp"]
                ),
                "accumulate_vs_multisteps_peak": (
                    mv[acc].memory["peak"] / mv[ms].memory["peak"]
                ),
            }
        )
    flat = []
    for remat, dtype in sizes["combos"]:
        for mode in ("microbatch", "accumulate"):
            peaks = {
                v.k: v.memory["peak"]
                for v in mv.values()
                if (v.mode, v.remat, v.dtype, v.micro) == (mode, remat, dtype, micro)
            }
            lo, hi = min(peaks), max(peaks)
            if lo < hi:
                looped = [peaks[k] for k in peaks if k > 1]
                flat.append(
                    {
                        "mode": mode,
                        "remat": remat,
                        "dtype": dtype,
                        "k_low": lo,
                        "k_high": hi,
                        "peaks": {str(k): v for k, v in sorted(peaks.items())},
                        "peak_ratio": peaks[hi] / peaks[lo],
                        # From k = 2 on, the loop's accumulator is there.
                        "peak_ratio_from_k2": max(looped) / min(looped),
                    }
                )

    budget = sizes["budget"]
    plans = []
    for remat, dtype in sizes["combos"] if sizes.get("plans", True) else ():
        plan = _plan(bench, remat, dtype, budget)
        plans.append({"remat": remat, "dtype": dtype, "plan": plan})
        log(f"plan {remat} {dtype}: {plan}")
    full_plan = _plan_full(bench, budget) if sizes.get("plans", True) else {}

    device = jax.devices()[0]
    return {
        "benchmark": "bench_transformer",
        "quick": quick,
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "jax": jax.__version__,
        "model": {
            "preset": sizes["preset"],
            "config": {
                f: getattr(bench.cfg, f)
                for f in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len")
            },
            "params": gpt.num_params(bench.params),
            "param_bytes": _nbytes(bench.params),
        },
        "optimizer": "adamw(3e-4, weight_decay=0.1)",
        "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()},
        "rounds": rounds,
        "budget": budget,
        "seconds": {"compile": compile_s, "timing": time_s},
        "full_batch_f32_seconds": {
            str(b): statistics.median(times[key]) for b, key in sorted(full.items())
        },
        "grid": rows,
        "anchors": anchor_rows,
        "targets": targets,
        "peak_flat_in_k": flat,
        "plans": plans,
        "plan_full_batch_f32": full_plan,
        "sweep": {"effective_batch": e, "rows": sweep_rows},
    }


def _plan_full(bench: Bench, budget: int | None) -> dict:
    """The largest plain full batch (no accumulation, f32, no remat) that fits."""
    v = Variant("full", "none", "f32", 1, 1)
    fn, kind = _step_fn(v, bench.cfg)
    return _planner(
        jax.jit(fn, donate_argnums=(0, 1)),
        bench.params,
        bench.state(kind),
        gpt.example(bench.cfg),
        bench.sizes["plan_target"],
        budget,
        bench.sizes["plan_max"],
    )


def _mib(x: float) -> str:
    return f"{x / MiB:,.1f}"


def markdown(data: dict) -> str:
    """The Markdown report of `measure`'s result."""
    m = data["model"]
    cfg = m["config"]
    micro = data["sizes"]["micro"]
    lines = [
        f"GPT {m['preset']} ({m['params'] / 1e6:.1f}M params, {cfg['n_layers']} "
        f"layers, d_model {cfg['d_model']}, sequence {cfg['seq_len']}, vocabulary "
        f"{cfg['vocab_size']}), {data['optimizer']}, micro-batch {micro} "
        f"sequences; {data['device']} ({data['backend']}), median of "
        f"{data['rounds']} interleaved rounds. Peak = compiled argument + output "
        f"- alias + temp of one call (the whole update for `microbatch`, one "
        f"micro-batch for `accumulate`). Time per token is relative to the f32, "
        f"no-remat, full-batch step on the same tokens (lower is faster).",
        "",
        "| remat | compute | step | k="
        + " | k=".join(str(k) for k in data["sizes"]["ks"])
        + " | state (MiB) |",
        "|---|---|---|" + "---:|" * (len(data["sizes"]["ks"]) + 1),
    ]
    by: dict[tuple, dict[int, dict]] = {}
    for r in data["grid"]:
        by.setdefault((r["remat"], r["dtype"], r["mode"]), {})[r["k"]] = r

    def cell(r: dict | None) -> str:
        if r is None:
            return "-"
        t = r["time_per_token_vs_full_f32"]
        return f"{_mib(r['memory']['peak'])} MiB, " + (f"{t:.2f}x" if t else "-")

    for (remat, dtype, mode), rs in by.items():
        cells = [cell(rs.get(k)) for k in data["sizes"]["ks"]]
        state = _mib(next(iter(rs.values()))["memory"]["state"])
        lines.append(
            f"| {remat} | {dtype} | `{mode}` | " + " | ".join(cells) + f" | {state} |"
        )
    pb = m["param_bytes"]
    acc_state = next(r for r in data["grid"] if r["mode"] == "accumulate")["memory"]
    lines += [
        "",
        f"Cells: peak memory, time per token vs the f32 full batch. State: the "
        f"params and optimizer state a step carries ({_mib(pb)} MiB of float32 "
        f"params; AdamW adds 2x, `accumulate` one float32 accumulator more: "
        f"{acc_state['state'] / pb:.2f}x params, whatever the compute dtype).",
        "",
        "Anchors (f32, no remat): full batch, a hand-written `lax.scan` of the "
        "same step, `optax.MultiSteps` (k calls).",
        "",
        "| k | full batch peak (MiB) | hand scan peak (MiB) | MultiSteps peak "
        "(MiB) | MultiSteps temp (MiB) | `accumulate` temp (MiB) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    an = {(r["mode"], r["effective_batch"]): r for r in data["anchors"]}
    acc_rows = {
        r["k"]: r
        for r in data["grid"]
        if (r["mode"], r["remat"], r["dtype"]) == ("accumulate", "none", "f32")
    }
    for k in data["sizes"]["ks"]:
        full = an[("full", k * micro)]
        scan = an.get(("scan", k * micro))
        ms = an.get(("multisteps", k * micro))
        lines.append(
            f"| {k} | {_mib(full['memory']['peak'])} | "
            + (_mib(scan["memory"]["peak"]) if scan else "-")
            + " | "
            + (_mib(ms["memory"]["peak"]) if ms else "-")
            + " | "
            + (_mib(ms["memory"]["temp"]) if ms else "-")
            + " | "
            + (_mib(acc_rows[k]["memory"]["temp"]) if k in acc_rows else "-")
            + " |"
        )
    lines += [
        "",
        "Targets (f32, no remat):",
        "",
        "| k | fused / hand scan, time (<= 1.05) | `accumulate` / `optax.MultiSteps`, "
        "time per update (<= 0.7) | floor: hand scan / MultiSteps, time | "
        "`accumulate` / MultiSteps, temp (<= 1.0) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for t in data["targets"]:
        lines.append(
            f"| {t['k']} | {t['fused_vs_scan_time']:.3f} | "
            f"{t['accumulate_vs_multisteps_time']:.3f} | "
            + (
                f"{t['scan_vs_multisteps_time']:.3f}"
                if "scan_vs_multisteps_time" in t
                else "-"
            )
            + f" | {t['accumulate_vs_multisteps_temp']:.3f} |"
        )
    flat = ", ".join(
        f"{f['mode']} {f['remat']}/{f['dtype']} {f['peak_ratio']:.3f}"
        + (
            f" ({f['peak_ratio_from_k2']:.3f} from k = 2)"
            if "peak_ratio_from_k2" in f
            else ""
        )
        for f in data["peak_flat_in_k"]
    )
    lines += [
        "",
        f"Peak memory at the largest k over the smallest (<= 1.1): {flat}. "
        "From k = 2 on, the fused loop carries one float32 accumulator the size "
        "of the parameters.",
    ]

    budget = data["budget"] or next(
        (
            p["plan"]["memory_budget"]
            for p in data["plans"]
            if "memory_budget" in p["plan"]
        ),
        None,
    )
    lines += [
        "",
        f"Largest micro-batch under a budget of "
        f"{_mib(budget) if budget else '?'} MiB (the planner on the "
        f"`accumulate` step, candidates dividing {data['sizes']['plan_target']}):",
        "",
        "| remat | compute | micro-batch (sequences) | its peak (MiB) | effective "
        "batch at k = 16 |",
        "|---|---|---:|---:|---:|",
    ]
    for p in data["plans"]:
        plan = p["plan"]
        if "error" in plan:
            lines.append(f"| {p['remat']} | {p['dtype']} | none fits | - | - |")
            continue
        lines.append(
            f"| {p['remat']} | {p['dtype']} | {_plan_size(plan)} | "
            f"{_mib(plan['memory_bytes'])} | {16 * _plan_size(plan)} |"
        )
    fp = data["plan_full_batch_f32"]
    if fp and "error" not in fp:
        lines += [
            "",
            f"Without accumulation (f32, no remat) the largest batch that fits is "
            f"{_plan_size(fp)} sequences ({_mib(fp['memory_bytes'])} MiB).",
        ]
    sw = data["sweep"]
    lines += [
        "",
        f"Small micro-batches: effective batch {sw['effective_batch']} sequences "
        f"(f32, no remat), time per token vs the full batch in one step:",
        "",
        "| micro-batch | k | `microbatch` | `accumulate` |",
        "|---:|---:|---:|---:|",
    ]
    pairs: dict[int, dict] = {}
    for r in sw["rows"]:
        pairs.setdefault(r["micro_batch"], {})[r["mode"]] = r
    for mb, pr in pairs.items():
        cells = [
            pr[m]["time_per_token_vs_full_f32"] for m in ("microbatch", "accumulate")
        ]
        lines.append(
            f"| {mb} | {pr['microbatch']['k']} | "
            + " | ".join(f"{c:.2f}x" if c is not None else "-" for c in cells)
            + " |"
        )
    return "\n".join(lines)


def plot(data: dict, path: Path) -> Path:
    """Peak memory vs effective batch, one line per combination."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = {"none": "C0", "dots": "C1", "full": "C2"}
    styles = {"f32": "-", "bf16": "--"}
    widths = {"none": 4.0, "dots": 2.5, "full": 1.2}
    markers = {"none": "o", "dots": "s", "full": "D"}
    full = sorted(
        (r for r in data["anchors"] if r["mode"] == "full"),
        key=lambda r: r["effective_batch"],
    )
    for ax, mode in zip(axes, ("microbatch", "accumulate"), strict=True):
        lines: dict[tuple, list] = {}
        for r in data["grid"]:
            if r["mode"] == mode:
                lines.setdefault((r["remat"], r["dtype"]), []).append(r)
        for (remat, dtype), rs in lines.items():
            ax.plot(
                [r["effective_batch"] for r in rs],
                [r["memory"]["peak"] / MiB for r in rs],
                styles[dtype],
                color=colors[remat],
                # Wider lines under narrower ones: equal peaks stay visible.
                linewidth=widths[remat],
                marker=markers[remat],
                markersize=2 + 2 * widths[remat],
                alpha=0.8,
                label=f"remat {remat}, {dtype}",
            )
        ax.plot(
            [r["effective_batch"] for r in full],
            [r["memory"]["peak"] / MiB for r in full],
            ":",
            color="k",
            marker="^",
            label="full batch, no remat, f32",
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("effective batch (sequences)")
        ax.set_title(f"`{mode}`, micro-batch {data['sizes']['micro']}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("compiled peak memory per device (MiB)")
    axes[1].legend(fontsize=8)
    m = data["model"]
    fig.suptitle(
        f"GPT {m['preset']} ({m['params'] / 1e6:.1f}M params) on {data['device']}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(data: dict, out_dir: Path) -> list[Path]:
    """Writes ``transformer_<backend>.{md,json,png}`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "transformer_quick" if data["quick"] else f"transformer_{data['backend']}"
    md, js = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    png = out_dir / f"{stem}.png"
    js.write_text(json.dumps(data, indent=1))  # first: the numbers are safe
    md.write_text(markdown(data) + f"\n\n![peak memory]({png.name})\n")
    plot(data, png)
    return [md, js, png]


def write_full(data: dict, out_dir: Path) -> list[Path]:
    """For ``benchmarks/run.py --full``: `write` into ``out_dir``."""
    return write(data, Path(out_dir))


def targets_only(sizes: dict[str, Any]) -> dict[str, Any]:
    """``sizes`` cut to the targets' variants at the largest target k."""
    k = max(sizes["target_ks"])
    return dict(
        sizes,
        combos=(ANCHOR,),
        ks=(k,),
        ks_other=(),
        acc_ks=(k,),
        target_ks=(k,),
        sweep_micros=(),
        plans=False,
    )


def run_full(
    quick: bool = False, out_dir: Path | None = None, rounds: int | None = None
) -> tuple[str, dict]:
    """``(markdown, data)``; also writes them and the plot if ``out_dir``."""
    data = measure(quick, rounds, log=lambda s: print(s, file=sys.stderr, flush=True))
    if out_dir is not None:
        write(data, Path(out_dir))
    return markdown(data), data


def run(quick: bool = False, rounds: int | None = None, out_dir=None) -> str:
    """Runs the benchmark and returns the Markdown (``bench`` CLI contract)."""
    return run_full(quick, out_dir, rounds)[0]


# ------------------------------------------------- sections of run.py --device
#
# `benchmarks/run.py --device` calls these with device-sized arguments (and
# `--smoke` with tiny ones, on the CPU). Each returns JSON-able data with its
# rows; the `markdown_*` functions render them.


def memory_stats(device: Any = None) -> dict[str, int]:
    """``device.memory_stats()``, or ``{}`` where the backend reports none."""
    device = device if device is not None else jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return {}
    return dict(stats or {})


def use_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache in ``path``, for every compilation.

    The memory map compiles each variant here and again in a fresh process
    that measures its peak; with the cache, that process loads the compiled
    program instead of compiling it again.
    """
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def peak_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant's measured peak, in a process that runs nothing else.

    The allocator's peak cannot be reset, so each variant gets a fresh
    process: it makes the parameters, the optimizer state of the step's kind
    and the batch, runs one update (k calls for `accumulate`) with donated
    state, and reads ``peak_bytes_in_use`` from ``memory_stats()`` (None where
    the backend reports none, e.g. the CPU). ``spec``: ``preset``, ``changes``,
    ``key`` (`Variant` arguments), and optionally ``platform`` and
    ``cache_dir``.
    """
    start = time.perf_counter()
    if spec.get("platform"):
        jax.config.update("jax_platforms", spec["platform"])
    if spec.get("cache_dir"):
        use_compilation_cache(spec["cache_dir"])
    sizes = {"preset": spec["preset"], "changes": spec.get("changes", {})}
    bench = Bench(sizes, log=lambda _: None)
    v = bench.add(*spec["key"])
    p, s = bench.params, bench.states[bench.kinds[v.key]]
    inputs = bench.inputs(v)
    jax.block_until_ready((p, s, inputs))
    before = memory_stats()
    for b in inputs:
        p, s = v.compiled(p, s, b)
    jax.block_until_ready((p, s))
    after = memory_stats()
    return {
        "key": list(v.key),
        "compiled_peak_bytes": v.memory["peak"],
        "measured_peak_bytes": after.get("peak_bytes_in_use"),
        "peak_before_step_bytes": before.get("peak_bytes_in_use"),
        "in_use_before_step_bytes": before.get("bytes_in_use"),
        "bytes_limit": after.get("bytes_limit"),
        "compile_s": v.compile_seconds,
        "seconds": time.perf_counter() - start,
    }


def measure_peaks(
    jobs: list[tuple[tuple, dict[str, Any], int]],
    *,
    pool_bytes: int | None,
    max_workers: int,
    timeout_s: float,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
) -> dict[tuple, dict[str, Any]]:
    """Runs `peak_worker` for each ``(key, spec, need_bytes)``, in parallel.

    Workers run at most ``max_workers`` at a time and, with ``pool_bytes``,
    only while the ``need_bytes`` of the running ones fit in it (a job that
    fits nowhere runs alone). None starts after ``deadline``. Every worker
    gets ``XLA_PYTHON_CLIENT_PREALLOCATE=false``, so it takes only what it
    uses. Returns key -> the worker's result, or ``{"status": ...}``.
    """
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    queue = list(jobs)
    running: list[tuple] = []  # (key, need, process, stdout, stderr, start time)
    results: dict[tuple, dict[str, Any]] = {}
    launched = 0
    with tempfile.TemporaryDirectory() as tmp:
        while queue or running:
            for job in list(running):
                key, _, proc, out, err, t0 = job
                if proc.poll() is None and time.monotonic() - t0 < timeout_s:
                    continue
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                    results[key] = {"status": f"error: timed out after {timeout_s} s"}
                else:
                    results[key] = _worker_result(proc.returncode, out, err)
                running.remove(job)
                log(f"peak of {key}: {_describe_peak(results[key])}")
            if deadline is not None and time.monotonic() > deadline:
                for key, _, _ in queue:
                    results[key] = {"status": "skipped: time budget"}
                queue = []
            admit = _admissible(
                [job[2] for job in queue],
                [job[1] for job in running],
                max_workers,
                pool_bytes,
            )
            for job in [queue[i] for i in admit]:
                key, spec, need = job
                out, err = (
                    os.path.join(tmp, f"{launched}.{e}") for e in ("out", "err")
                )
                launched += 1
                with open(out, "w") as fo, open(err, "w") as fe:
                    proc = subprocess.Popen(
                        [sys.executable, __file__, "--peak-worker", json.dumps(spec)],
                        stdout=fo,
                        stderr=fe,
                        env=env,
                    )
                running.append((key, need, proc, out, err, time.monotonic()))
                queue.remove(job)
            time.sleep(0.05)
    return results


def _admissible(
    queued: list[int], running: list[int], max_workers: int, pool: int | None
) -> list[int]:
    """Which queued jobs (by their bytes) start now, first fit in queue order.

    At most ``max_workers`` run; with a ``pool``, the running jobs' bytes stay
    within it, except that a job starts alone whatever its size.
    """
    chosen, used, n = [], sum(running), len(running)
    for i, need in enumerate(queued):
        if n >= max_workers:
            break
        if n and pool is not None and used + need > pool:
            continue
        chosen.append(i)
        used, n = used + need, n + 1
    return chosen


def _worker_result(returncode: int, out: str, err: str) -> dict[str, Any]:
    with open(out) as f:
        lines = [line for line in f.read().splitlines() if line.startswith("{")]
    if returncode == 0 and lines:
        return {"status": "ok", **json.loads(lines[-1])}
    with open(err) as f:
        tail = [line for line in f.read().splitlines() if line.strip()][-3:]
    return {"status": f"error: exit status {returncode}: {' / '.join(tail)}"}


def _describe_peak(result: dict[str, Any]) -> str:
    if result.get("status") != "ok":
        return result.get("status", "?")
    peak = result.get("measured_peak_bytes")
    measured = "not reported" if peak is None else f"{peak / MiB:,.1f} MiB"
    return (
        f"measured {measured}, compiled {result['compiled_peak_bytes'] / MiB:,.1f} "
        f"MiB ({result['seconds']:.1f} s)"
    )


def _variant_row(bench: Bench, key: tuple) -> dict[str, Any]:
    mode, remat, dtype, k, micro = key
    return {
        "step": mode,
        "remat": remat,
        "dtype": dtype,
        "k": k,
        "micro_batch": micro,
        "batch": k * micro,
        "tokens_per_update": k * micro * bench.cfg.seq_len,
    }


def memory_map(
    bench: Bench,
    *,
    remats: tuple[str, ...],
    dtypes: tuple[str, ...],
    ks: tuple[int, ...],
    micro: int,
    threads: int,
    workers: int,
    worker_timeout_s: float,
    cache_dir: str | None,
    pool_bytes: int | None = None,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The fused `microbatch` step's memory: compiled estimate and measured peak.

    For remat x compute dtype x k at a fixed micro-batch: the compiled
    estimate here (`optax_accum.compiled_memory_bytes`), the measured peak in a
    fresh process per variant (`peak_worker`; the persistent compilation
    cache in ``cache_dir`` spares it the compilation). The processes share
    ``pool_bytes`` of device memory (default: 90% of what the device's limit
    leaves beside this process; unbounded where the backend reports none).
    """
    keys = [("microbatch", r, d, k, micro) for r in remats for d in dtypes for k in ks]
    start = time.perf_counter()
    n0 = bench.compilations
    bench.add_many(keys, threads, deadline)
    compile_s = time.perf_counter() - start
    stats = memory_stats()
    pool = pool_bytes
    if pool is None and "bytes_limit" in stats:  # not what this process holds
        held = stats.get("pool_bytes", stats.get("bytes_in_use", 0))
        pool = int(0.9 * (stats["bytes_limit"] - held))
    platform = "cpu" if jax.default_backend() == "cpu" else None
    jobs = []
    for key in keys:
        if key in bench.variants:
            spec = {
                "preset": bench.sizes["preset"],
                "changes": bench.sizes.get("changes", {}),
                "key": list(key),
                "platform": platform,
                "cache_dir": cache_dir,
            }
            # The CUDA context and the init's buffers come on top of the step.
            need = int(1.15 * bench.variants[key].memory["peak"]) + 2**30
            jobs.append((key, spec, need))
    peaks = measure_peaks(
        jobs,
        pool_bytes=pool,
        max_workers=workers,
        timeout_s=worker_timeout_s,
        deadline=deadline,
        log=log,
    )
    rows = []
    for key in keys:
        row = _variant_row(bench, key)
        if key not in bench.variants:
            rows.append({**row, "status": "skipped: time budget"})
            continue
        mem = bench.variants[key].memory
        peak = peaks.get(key, {"status": "skipped: time budget"})
        measured = peak.get("measured_peak_bytes")
        rows.append(
            {
                **row,
                "status": peak["status"],
                "compiled_peak_bytes": mem["peak"],
                "compiled_temp_bytes": mem["temp"],
                "state_bytes": mem["state"],
                "measured_peak_bytes": measured,
                "measured_vs_compiled": (
                    measured / mem["peak"] if measured is not None else None
                ),
                "peak_before_step_bytes": peak.get("peak_before_step_bytes"),
                "worker_seconds": peak.get("seconds"),
                # Near 0 where the compilation cache served the worker.
                "worker_compile_seconds": peak.get("compile_s"),
            }
        )
    return {
        "model": _model_info(bench),
        "optimizer": "adamw(3e-4, weight_decay=0.1)",
        "micro_batch": micro,
        "memory_stats_available": "peak_bytes_in_use" in stats,
        "worker_pool_bytes": pool,
        "compilations": bench.compilations - n0,
        "compile_seconds": compile_s,
        "rows": rows,
    }


def _model_info(bench: Bench) -> dict[str, Any]:
    return {
        "preset": bench.sizes["preset"],
        "config": {
            f: getattr(bench.cfg, f)
            for f in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len")
        },
        "params": gpt.num_params(bench.params),
    }


def _fits(bench: Bench, key: tuple, log: Callable[[str], None]) -> bool:
    limit = memory_stats().get("bytes_limit")
    if limit is not None and bench.variants[key].memory["peak"] > 0.9 * limit:
        log(f"not timed (peak over 90% of the device's memory): {key}")
        return False
    return True


def _timing_rows(
    bench: Bench, keys: list[tuple], times: dict, anchor: tuple | None
) -> list[dict[str, Any]]:
    rows = []
    for key in keys:
        row = _variant_row(bench, key)
        if key not in times:
            rows.append({**row, "status": "not timed"})
            continue
        seconds = statistics.median(times[key])
        ratio = _ratio(times, key, anchor) if anchor in times else None
        rows.append(
            {
                **row,
                "status": "ok",
                "seconds_per_update": seconds,
                "us_per_token": 1e6 * seconds / row["tokens_per_update"],
                "tokens_per_s": row["tokens_per_update"] / seconds,
                "time_vs_plain": ratio,
                "compiled_peak_bytes": bench.variants[key].memory["peak"],
            }
        )
    return rows


def time_per_token(
    bench: Bench,
    *,
    remats: tuple[str, ...],
    dtype: str,
    k: int,
    micro: int,
    rounds: int,
    threads: int,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Time per token of the fused step per remat, of `accumulate` (k calls),
    and of the plain step on the same ``k * micro`` sequences; ratios to the
    plain step are medians of interleaved rounds."""
    plain = ("full", "none", dtype, 1, k * micro)
    keys = [("microbatch", r, dtype, k, micro) for r in remats]
    keys += [("accumulate", "none", dtype, k, micro), plain]
    n0 = bench.compilations
    bench.add_many(keys, threads, deadline)
    timed = [key for key in keys if key in bench.variants and _fits(bench, key, log)]
    times = bench.time_all(timed, rounds)
    return {
        "model": _model_info(bench),
        "dtype": dtype,
        "k": k,
        "micro_batch": micro,
        "rounds": rounds,
        "compilations": bench.compilations - n0,
        "rows": _timing_rows(bench, keys, times, plain),
    }


def largest_batch(
    points: list[tuple[int, int]], budget: int, multiple: int, max_batch: int
) -> int:
    """The largest multiple of ``multiple`` (<= ``max_batch``) under ``budget``.

    ``points``: ``(batch, compiled peak bytes)``; the peak is taken as linear in
    the batch through the two largest batches. Returns 0 if none fits.
    """
    (b1, m1), (b2, m2) = sorted(points)[-2:]
    slope = (m2 - m1) / (b2 - b1)
    if slope <= 0:
        raise ValueError(f"memory does not grow with the batch: {points}")
    batch = int((budget - (m2 - slope * b2)) // slope) // multiple * multiple
    return max(0, min(batch, max_batch // multiple * multiple))


def overhead(
    bench: Bench,
    *,
    dtype: str,
    remat: str,
    k: int,
    fit_batches: tuple[int, int],
    multiple: int,
    max_batch: int,
    budget: int,
    rounds: int,
    threads: int,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Accumulation's cost over the plain step at the largest batch that fits.

    The batch comes ahead of time from compiled estimates: the plain step at
    ``fit_batches``, a line through them, the largest multiple of
    ``lcm(multiple, k)`` under ``budget``, checked by compiling it and the
    next multiple. Then the plain step, `microbatch` (one call) and
    `accumulate` (k calls) on that batch in micro-batches of ``batch / k`` are
    timed in interleaved rounds; the ratios are the medians of the per-round
    ratios to the plain step.
    """
    n0 = bench.compilations
    step = math.lcm(multiple, k)
    fit = [("full", remat, dtype, 1, b) for b in fit_batches]
    bench.add_many(fit, threads, deadline)
    points = [(key[4], bench.variants[key].memory["peak"]) for key in fit]
    batch = largest_batch(points, budget, step, max_batch)
    log(f"largest batch by the fit of {points}: {batch}")
    checked = False
    for _ in range(2):
        if batch < step:
            raise ValueError(f"no batch fits the budget of {budget:,} bytes: {points}")
        plain = ("full", remat, dtype, 1, batch)
        keys = [plain]
        keys += [("microbatch", remat, dtype, k, batch // k)]
        keys += [("accumulate", remat, dtype, k, batch // k)]
        above = ("full", remat, dtype, 1, batch + step)
        bench.add_many([*keys, above] if batch + step <= max_batch else keys, threads)
        peak = bench.variants[plain].memory["peak"]
        points += [(batch, peak)]
        if peak <= budget:
            nxt = bench.variants.get(above)
            checked = nxt is None or nxt.memory["peak"] > budget
            break
        log(f"batch {batch}: compiled peak {peak:,} over the budget; refitting")
        batch = largest_batch(points, budget, step, batch - step)
    else:
        raise ValueError(f"no batch under the budget of {budget:,} bytes: {points}")
    timed = [key for key in keys if _fits(bench, key, log)]
    times = bench.time_all(timed, rounds)
    above_v = bench.variants.get(above)
    return {
        "model": _model_info(bench),
        "dtype": dtype,
        "remat": remat,
        "k": k,
        "batch": batch,
        "budget_bytes": budget,
        "fit_points": [list(p) for p in points],
        "next_batch": above[4] if above_v else None,
        "next_batch_peak_bytes": above_v.memory["peak"] if above_v else None,
        "largest_checked": checked,
        "rounds": rounds,
        "compilations": bench.compilations - n0,
        "rows": _timing_rows(bench, keys, times, plain),
    }


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:,.2f}"


def _model_line(model: dict[str, Any]) -> str:
    c = model["config"]
    return (
        f"GPT {model['preset']} ({model['params'] / 1e6:.1f}M params, "
        f"{c['n_layers']} layers, d_model {c['d_model']}, sequence {c['seq_len']}, "
        f"vocabulary {c['vocab_size']})"
    )


def markdown_memory_map(data: dict[str, Any]) -> str:
    """The Markdown table of `memory_map`'s result."""
    lines = [
        f"{_model_line(data['model'])}, {data['optimizer']}, fused `microbatch` "
        f"step, micro-batch {data['micro_batch']} sequences. Compiled: argument "
        "+ output - alias + temp of one call, from `compiled.memory_analysis()`. "
        "Measured: `peak_bytes_in_use` of `device.memory_stats()` in a fresh "
        "process that runs one update (the allocator's peak cannot be reset).",
        "",
        "| remat | compute | k | tokens / update | compiled peak (GiB) "
        "| measured peak (GiB) | measured / compiled | state (GiB) | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in data["rows"]:
        ratio = r.get("measured_vs_compiled")
        lines.append(
            f"| {r['remat']} | {r['dtype']} | {r['k']} | {r['tokens_per_update']:,} "
            f"| {_gib(r.get('compiled_peak_bytes'))} "
            f"| {_gib(r.get('measured_peak_bytes'))} "
            f"| {'-' if ratio is None else f'{ratio:.3f}'} "
            f"| {_gib(r.get('state_bytes'))} | {r['status']} |"
        )
    if not data["memory_stats_available"]:
        lines += [
            "",
            "This backend reports no `memory_stats()`: no measured peaks.",
        ]
    return "\n".join(lines)


def _timing_table(rows: list[dict[str, Any]], plain_name: str) -> list[str]:
    lines = [
        "| step | remat | k | micro-batch | tokens / update | time / update (ms) "
        f"| µs / token | tokens / s | time vs {plain_name} | compiled peak (GiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = {
        "full": "plain step",
        "microbatch": "`microbatch` (1 call)",
        "accumulate": "`accumulate` (k calls)",
    }
    for r in rows:
        head = (
            f"| {names.get(r['step'], r['step'])} | {r['remat']} | {r['k']} "
            f"| {r['micro_batch']} "
            f"| {r['tokens_per_update']:,} "
        )
        if r["status"] != "ok":
            lines.append(head + f"| {r['status']} ||||| ")
            continue
        ratio = r["time_vs_plain"]
        lines.append(
            head + f"| {r['seconds_per_update'] * 1e3:,.1f} | {r['us_per_token']:.3f} "
            f"| {r['tokens_per_s']:,.0f} "
            f"| {'-' if ratio is None else f'{ratio:.3f}x'} "
            f"| {_gib(r['compiled_peak_bytes'])} |"
        )
    return lines


def markdown_time_per_token(data: dict[str, Any]) -> str:
    """The Markdown table of `time_per_token`'s result."""
    lines = [
        f"{_model_line(data['model'])}, AdamW, compute {data['dtype']}, k = "
        f"{data['k']} micro-batches of {data['micro_batch']} sequences; median "
        f"of {data['rounds']} interleaved rounds. Time vs the plain step (no "
        "accumulation, no remat) on the same sequences.",
        "",
        *_timing_table(data["rows"], "plain"),
    ]
    return "\n".join(lines)


def markdown_overhead(data: dict[str, Any]) -> str:
    """The Markdown table of `overhead`'s result."""
    nxt = data["next_batch"]
    check = (
        f"batch {nxt} estimates {_gib(data['next_batch_peak_bytes'])} GiB"
        if nxt
        else "no larger batch was tried"
    )
    lines = [
        f"{_model_line(data['model'])}, AdamW, compute {data['dtype']}, remat "
        f"{data['remat']}. Largest plain batch under a budget of "
        f"{_gib(data['budget_bytes'])} GiB, from compiled estimates: "
        f"{data['batch']} sequences ({check}"
        + ("" if data["largest_checked"] else ", also under it: the fit is cautious")
        + f"). Then k = {data['k']}; median of {data['rounds']} interleaved rounds.",
        "",
        *_timing_table(data["rows"], "plain"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, seconds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=RESULTS_DIR,
        help=f"where the .md, .json and .png go (default {RESULTS_DIR})",
    )
    parser.add_argument(
        "--targets-only",
        action="store_true",
        help="only the performance targets (no remat, f32, the largest target "
        "k): more rounds in little time; writes transformer_<backend>_targets.*",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="only re-render the .md and .png of an earlier run's JSON",
    )
    parser.add_argument(
        "--peak-worker",
        default=None,
        metavar="JSON",
        help="(for run.py --device) measure one variant's peak; prints JSON",
    )
    args = parser.parse_args(argv)
    if args.peak_worker is not None:
        print(json.dumps(peak_worker(json.loads(args.peak_worker))))
        return 0
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.from_json is not None:
        data = json.loads(args.from_json.read_text())
        write(data, args.out_dir)
        print(markdown(data))
        return 0
    if args.targets_only:
        data = measure(
            args.quick,
            args.rounds,
            log=lambda s: print(s, file=sys.stderr, flush=True),
            sizes=targets_only(sizes_for(args.quick)),
        )
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / f"transformer_{data['backend']}_targets.json"
        path.write_text(json.dumps(data, indent=1))
        print(json.dumps(data["targets"], indent=1))
        return 0
    md, _ = run_full(args.quick, args.out_dir, args.rounds)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
