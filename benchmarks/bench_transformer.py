# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The transformer workload: remat x precision x accumulation, memory and time.

The reference GPT of ``examples/gpt.py`` (``cpu_small``, 10.3M parameters and
sequence 128 on the CPU; ``gpt2_small``, 124M and 1024 on a GPU or TPU) trained
with AdamW, for remat in {none, dots, full} x compute in {f32, bf16} x k
micro-batches of a fixed size, two ways: the fused `optax_accum.microbatch`
step (one call) and k calls of a step with `optax_accum.accumulate`. One
module of ``transformer/`` per question, on one compiled set of steps timed
in one set of interleaved rounds:

- the memory map (``transformer/memory_map.py``): XLA's compiled peak per
  device, ``argument + output - alias + temp``, of one call (the whole update
  for the fused step, one micro-batch for `accumulate`);
- time per token (``transformer/time_per_token.py``), as a ratio to the f32,
  no-remat, full-batch step on the same tokens, with the targets against a
  hand-written ``lax.scan`` and ``optax.MultiSteps``;
- the largest batch that fits a memory budget (``transformer/largest_batch.py``),
  from `optax_accum.plan_microbatch`;
- the small-micro-batch slowdown (``transformer/small_micro.py``).

Run ``python benchmarks/bench_transformer.py`` (writes the table, a JSON file
and a plot to ``benchmarks/results/``, or ``--out DIR``) or ``--quick`` (a tiny
model, seconds; written only with ``--out``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import jax
from transformer import largest_batch, memory_map, small_micro, time_per_token
from transformer.plot import plot
from transformer.setup import ANCHOR, COMBOS, Bench, MiB, grid_row, model_info

RESULTS_DIR = Path(__file__).resolve().parent / "results"

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


def targets_only(sizes: dict[str, Any]) -> dict[str, Any]:
    """``sizes`` cut to the targets' variants at the largest target k."""
    k = max(sizes["target_ks"])
    return dict(
        sizes, combos=(ANCHOR,), ks=(k,), ks_other=(), acc_ks=(k,),
        target_ks=(k,), sweep_micros=(), plans=False,
    )  # fmt: skip


def _timed(bench: Bench, sizes: dict[str, Any]) -> tuple[list, dict, list, list]:
    """Compiles every question's steps; which of them are timed."""
    grid, full = memory_map.grid_keys(sizes)
    sweep, sweep_anchor = small_micro.sweep_keys(sizes)
    full[sizes["sweep_batch"]] = sweep_anchor
    anchors = time_per_token.target_keys(sizes)
    timed = list(dict.fromkeys([*grid, *anchors, *full.values(), *sweep]))
    bench.add_many(timed)
    # On a GPU or TPU, a full batch of k micro-batches may not fit: measured
    # (compiled), never run.
    return grid, full, sweep, [key for key in timed if bench.fits(key)]


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
    bench, start = Bench(sizes, log), time.perf_counter()
    grid, full, sweep, timed = _timed(bench, sizes)
    compile_s = time.perf_counter() - start
    times = bench.time_all(timed, rounds)
    time_s = time.perf_counter() - start - compile_s

    def rows(keys: list) -> list[dict]:
        return [grid_row(bench, key, times, full[key.k * key.micro]) for key in keys]

    plans, full_plan = largest_batch.plans(bench, sizes)
    device = jax.devices()[0]
    return {
        "benchmark": "bench_transformer",
        "quick": quick,
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "jax": jax.__version__,
        "model": model_info(bench),
        "optimizer": "adamw(3e-4, weight_decay=0.1)",
        "sizes": harness.jsonable(sizes),
        "rounds": rounds,
        "budget": sizes["budget"],
        "seconds": {"compile": compile_s, "timing": time_s},
        "full_batch_f32_seconds": {
            str(b): harness.median(times[key]) for b, key in sorted(full.items())
        },
        "grid": rows(grid),
        "anchors": rows([k for k in timed if k.mode in ("full", "scan", "multisteps")]),
        "targets": time_per_token.targets(bench, sizes, times),
        "peak_flat_in_k": memory_map.flat_in_k(bench, sizes),
        "plans": plans,
        "plan_full_batch_f32": full_plan,
        "sweep": {"effective_batch": sizes["sweep_batch"], "rows": rows(sweep)},
    }


def markdown(data: dict) -> str:
    """The Markdown report of `measure`'s result."""
    m, cfg = data["model"], data["model"]["config"]
    head = (
        f"GPT {m['preset']} ({m['params'] / 1e6:.1f}M params, {cfg['n_layers']} "
        f"layers, d_model {cfg['d_model']}, sequence {cfg['seq_len']}, vocabulary "
        f"{cfg['vocab_size']}), {data['optimizer']}, micro-batch "
        f"{data['sizes']['micro']} sequences; {data['device']} ({data['backend']}), "
        f"median of {data['rounds']} interleaved rounds. Peak = compiled argument "
        "+ output - alias + temp of one call (the whole update for `microbatch`, "
        "one micro-batch for `accumulate`). Time per token is relative to the "
        "f32, no-remat, full-batch step on the same tokens (lower is faster)."
    )
    parts = [
        [head],
        memory_map.markdown_grid(data),
        time_per_token.markdown_targets(data),
        memory_map.markdown_flat(data),
        largest_batch.markdown_plans(data),
        small_micro.markdown(data),
    ]
    return "\n\n".join("\n".join(p) for p in parts)


def write(data: dict, out_dir: Path) -> list[Path]:
    """Writes ``transformer_<backend>.{md,json,png}`` into ``out_dir``."""
    stem = "transformer_quick" if data["quick"] else f"transformer_{data['backend']}"
    md, png = Path(out_dir) / f"{stem}.md", Path(out_dir) / f"{stem}.png"
    text = markdown(data) + f"\n\n![peak memory]({png.name})"
    md, js = harness.write_results(md, text, data)
    return [md, js, plot(data, png)]


def write_full(data: dict, out_dir: Path) -> list[Path]:
    """For ``benchmarks/run.py --full``: `write` into ``out_dir``."""
    return write(data, Path(out_dir))


def _arguments(p) -> None:
    p.add_argument(
        "--targets-only",
        action="store_true",
        help="only the performance targets (no remat, f32, the largest target "
        "k): more rounds in little time; writes transformer_<backend>_targets.json",
    )
    p.add_argument(
        "--from-json", type=Path, help="only re-render the .md and .png of a JSON"
    )
    p.add_argument(
        "--peak-worker",
        metavar="JSON",
        help="(for run.py --device) measure one variant's peak; prints JSON",
    )


def main(argv: list[str] | None = None) -> int:
    p = harness.cli.parser(__doc__)
    _arguments(p)
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else RESULTS_DIR
    if args.peak_worker is not None:
        print(json.dumps(memory_map.peak_worker(json.loads(args.peak_worker))))
        return 0
    if args.from_json is not None:
        data = json.loads(args.from_json.read_text())
    elif args.targets_only:
        data = measure(
            args.quick, args.rounds, sizes=targets_only(sizes_for(args.quick))
        )
        path = out / f"transformer_{data['backend']}_targets.json"
        record = {**data, "command": harness.report.command_line()}
        path.write_text(json.dumps(harness.jsonable(record), indent=1))
        print(json.dumps(data["targets"], indent=1))
        return 0
    else:
        data = measure(args.quick, args.rounds)
    if args.out or not args.quick:  # --quick alone writes nothing
        write(data, out)
    print(markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
