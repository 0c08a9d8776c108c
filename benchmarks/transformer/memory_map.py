# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The memory map: remat x compute dtype x k, compiled and measured peaks.

On the CPU grid (`grid_keys`, `flat_in_k`, `markdown_grid`, `plot`): the
compiled peak of the fused `microbatch` step and of `accumulate` per
combination and k, next to the full batch's. On a device (`measure`,
`markdown`): the fused step's compiled estimate next to its measured peak,
each in a fresh process (`peak_worker`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import jax
from harness import peaks

from .setup import ANCHOR, Bench, Key, model_info, model_line, variant_row

HERE = Path(__file__).resolve().parent


def grid_keys(sizes: dict[str, Any]) -> tuple[list[Key], dict[int, Key]]:
    """The grid's steps, and the f32 full-batch anchor of each batch size."""
    micro, grid, full = sizes["micro"], [], {}
    for remat, dtype in sizes["combos"]:
        anchor = (remat, dtype) == ANCHOR
        for mode, ks in (
            ("microbatch", sizes["ks"] if anchor else sizes["ks_other"]),
            ("accumulate", sizes["acc_ks"] if anchor else sizes["acc_ks_other"]),
        ):
            for k in ks:
                full.setdefault(k * micro, Key("full", *ANCHOR, 1, k * micro))
                grid.append(Key(mode, remat, dtype, k, micro))
    return grid, full


def flat_in_k(bench: Bench, sizes: dict[str, Any]) -> list[dict[str, Any]]:
    """Per combination: the peak at the largest k over the smallest."""
    flat = []
    for remat, dtype in sizes["combos"]:
        for mode in ("microbatch", "accumulate"):
            peaks_ = {
                v.k: v.memory["peak"]
                for v in bench.variants.values()
                if (v.mode, v.remat, v.dtype, v.micro)
                == (mode, remat, dtype, sizes["micro"])
            }
            lo, hi = min(peaks_), max(peaks_)
            if lo < hi:
                looped = [peaks_[k] for k in peaks_ if k > 1]
                flat.append(
                    {
                        "mode": mode,
                        "remat": remat,
                        "dtype": dtype,
                        "k_low": lo,
                        "k_high": hi,
                        "peaks": {str(k): v for k, v in sorted(peaks_.items())},
                        "peak_ratio": peaks_[hi] / peaks_[lo],
                        # From k = 2 on, the loop's accumulator is there.
                        "peak_ratio_from_k2": max(looped) / min(looped),
                    }
                )
    return flat


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    t = r["time_per_token_vs_full_f32"]
    return f"{harness.mib(r['memory']['peak'])} MiB, " + (f"{t:.2f}x" if t else "-")


def _anchor_rows(data: dict) -> list[list[str]]:
    micro, mib = data["sizes"]["micro"], harness.mib
    an = {(r["mode"], r["effective_batch"]): r for r in data["anchors"]}
    acc = {
        r["k"]: r
        for r in data["grid"]
        if (r["mode"], r["remat"], r["dtype"]) == ("accumulate", "none", "f32")
    }
    rows = []
    for k in data["sizes"]["ks"]:
        scan, ms = an.get(("scan", k * micro)), an.get(("multisteps", k * micro))
        rows.append(
            [
                k,
                mib(an[("full", k * micro)]["memory"]["peak"]),
                mib(scan["memory"]["peak"]) if scan else "-",
                mib(ms["memory"]["peak"]) if ms else "-",
                mib(ms["memory"]["temp"]) if ms else "-",
                mib(acc[k]["memory"]["temp"]) if k in acc else "-",
            ]
        )
    return rows


def markdown_grid(data: dict) -> list[str]:
    """The grid's table and the anchors' table of the CPU grid's data."""
    ks, mib = data["sizes"]["ks"], harness.mib
    by: dict[tuple, dict[int, dict]] = {}
    for r in data["grid"]:
        by.setdefault((r["remat"], r["dtype"], r["mode"]), {})[r["k"]] = r
    rows = [
        [
            remat,
            dtype,
            f"`{mode}`",
            *(_cell(rs.get(k)) for k in ks),
            mib(next(iter(rs.values()))["memory"]["state"]),
        ]
        for (remat, dtype, mode), rs in by.items()
    ]
    header = ["remat", "compute", "step", *(f"k={k}" for k in ks), "state (MiB)"]
    pb = data["model"]["param_bytes"]
    acc_state = next(r for r in data["grid"] if r["mode"] == "accumulate")["memory"]
    anchors = ["k", "full batch peak (MiB)", "hand scan peak (MiB)"]
    anchors += ["MultiSteps peak (MiB)", "MultiSteps temp (MiB)"]
    anchors += ["`accumulate` temp (MiB)"]
    return [
        *harness.table(header, rows, "lll" + "r" * (len(ks) + 1)),
        "",
        f"Cells: peak memory, time per token vs the f32 full batch. State: the "
        f"params and optimizer state a step carries ({mib(pb)} MiB of float32 "
        f"params; AdamW adds 2x, `accumulate` one float32 accumulator more: "
        f"{acc_state['state'] / pb:.2f}x params, whatever the compute dtype).",
        "",
        "Anchors (f32, no remat): full batch, a hand-written `lax.scan` of the "
        "same step, `optax.MultiSteps` (k calls).",
        "",
        *harness.table(anchors, _anchor_rows(data), "rrrrrr"),
    ]


def markdown_flat(data: dict) -> list[str]:
    flat = ", ".join(
        f"{f['mode']} {f['remat']}/{f['dtype']} {f['peak_ratio']:.3f}"
        + (
            f" ({f['peak_ratio_from_k2']:.3f} from k = 2)"
            if "peak_ratio_from_k2" in f
            else ""
        )
        for f in data["peak_flat_in_k"]
    )
    return [
        f"Peak memory at the largest k over the smallest (<= 1.1): {flat}. "
        "From k = 2 on, the fused loop carries one float32 accumulator the size "
        "of the parameters."
    ]


# ------------------------------------------------- the device run's section


def peak_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant's measured peak, in a process that runs nothing else.

    It makes the parameters, the optimizer state of the step's kind and the
    batch, and runs one update (k calls for `accumulate`) with donated state.
    ``spec``: ``preset``, ``changes``, ``key``, and optionally ``platform``
    and ``cache_dir``.
    """
    start = time.perf_counter()
    if spec.get("platform"):
        jax.config.update("jax_platforms", spec["platform"])
    if spec.get("cache_dir"):
        harness.use_compilation_cache(spec["cache_dir"])
    sizes = {"preset": spec["preset"], "changes": spec.get("changes", {})}
    bench = Bench(sizes, log=lambda _: None)
    v = bench.add(*spec["key"])
    # The step's own state, not a copy: a copy would count in the peak.
    args = ((bench.params, bench.states[bench.kinds[v.key]]), bench.inputs(v.key))
    jax.block_until_ready(args)
    result = peaks.measured_peak(lambda: bench.update(v.key).run(args))
    return {
        "key": list(v.key),
        "compiled_peak_bytes": v.memory["peak"],
        **result,
        "compile_s": v.compile_seconds,
        "seconds": time.perf_counter() - start,
    }


def _pool_bytes(pool_bytes: int | None) -> int | None:
    """What the workers may share: 90% of what the limit leaves beside this
    process, where the backend reports one."""
    stats = harness.memory_stats()
    if pool_bytes is None and "bytes_limit" in stats:  # not what this process holds
        held = stats.get("pool_bytes", stats.get("bytes_in_use", 0))
        return int(0.9 * (stats["bytes_limit"] - held))
    return pool_bytes


def _row(bench: Bench, key: Key, peak: dict[str, Any] | None) -> dict[str, Any]:
    row = variant_row(bench, key)
    if key not in bench.variants:
        return {**row, "status": "skipped: time budget"}
    mem = bench.variants[key].memory
    peak = peak or {"status": "skipped: time budget"}
    measured = peak.get("measured_peak_bytes")
    return {
        **row,
        "status": peak["status"],
        "compiled_peak_bytes": mem["peak"],
        "compiled_temp_bytes": mem["temp"],
        "state_bytes": mem["state"],
        "measured_peak_bytes": measured,
        "measured_vs_compiled": measured / mem["peak"]
        if measured is not None
        else None,
        "peak_before_step_bytes": peak.get("peak_before_step_bytes"),
        "worker_seconds": peak.get("seconds"),
        # Near 0 where the compilation cache served the worker.
        "worker_compile_seconds": peak.get("compile_s"),
    }


def measure(
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
    """The fused step's compiled estimate here, its measured peak in a fresh
    process per variant (the compilation cache in ``cache_dir`` spares that
    process the compilation), the processes sharing ``pool_bytes``."""
    keys = [
        Key("microbatch", r, d, k, micro) for r in remats for d in dtypes for k in ks
    ]
    start, n0 = time.perf_counter(), bench.compilations
    bench.add_many(keys, threads, deadline)
    compile_s = time.perf_counter() - start
    pool = _pool_bytes(pool_bytes)
    platform = "cpu" if jax.default_backend() == "cpu" else None
    spec = {"preset": bench.sizes["preset"], "changes": bench.sizes.get("changes", {})}
    spec.update(platform=platform, cache_dir=cache_dir)
    # The CUDA context and the init's buffers come on top of the step.
    jobs = [
        (
            key,
            {**spec, "key": list(key)},
            int(1.15 * bench.variants[key].memory["peak"]) + 2**30,
        )
        for key in keys
        if key in bench.variants
    ]
    command = peaks.worker_command(str(HERE.parent / "bench_transformer.py"))
    results = peaks.measure_peaks(
        jobs,
        command,
        pool_bytes=pool,
        max_workers=workers,
        timeout_s=worker_timeout_s,
        deadline=deadline,
        log=log,
    )
    return {
        "model": model_info(bench),
        "optimizer": "adamw(3e-4, weight_decay=0.1)",
        "micro_batch": micro,
        "memory_stats_available": "peak_bytes_in_use" in harness.memory_stats(),
        "worker_pool_bytes": pool,
        "compilations": bench.compilations - n0,
        "compile_seconds": compile_s,
        "rows": [_row(bench, key, results.get(key)) for key in keys],
    }


def markdown(data: dict[str, Any]) -> str:
    """The Markdown table of `measure`'s result."""
    gib = harness.gib
    rows = []
    for r in data["rows"]:
        ratio = r.get("measured_vs_compiled")
        rows.append(
            [
                r["remat"],
                r["dtype"],
                r["k"],
                f"{r['tokens_per_update']:,}",
                gib(r.get("compiled_peak_bytes")),
                gib(r.get("measured_peak_bytes")),
                "-" if ratio is None else f"{ratio:.3f}",
                gib(r.get("state_bytes")),
                r["status"],
            ]
        )
    header = ["remat", "compute", "k", "tokens / update", "compiled peak (GiB)"]
    header += ["measured peak (GiB)", "measured / compiled", "state (GiB)", "status"]
    lines = [
        f"{model_line(data['model'])}, {data['optimizer']}, fused `microbatch` "
        f"step, micro-batch {data['micro_batch']} sequences. Compiled: argument "
        "+ output - alias + temp of one call, from `compiled.memory_analysis()`. "
        "Measured: `peak_bytes_in_use` of `device.memory_stats()` in a fresh "
        "process that runs one update (the allocator's peak cannot be reset).",
        "",
        *harness.table(header, rows, "llrrrrrrl"),
    ]
    if not data["memory_stats_available"]:
        lines += ["", "This backend reports no `memory_stats()`: no measured peaks."]
    return "\n".join(lines)
