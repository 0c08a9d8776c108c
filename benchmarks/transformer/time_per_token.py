# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Time per token: the fused step and `accumulate` against their anchors.

On the CPU grid (`target_keys`, `targets`, `markdown_targets`): the fused
step over a hand-written ``lax.scan`` of it, and `accumulate` over
``optax.MultiSteps``, in time and memory. On a device (`measure`,
`markdown`): the fused step per remat, `accumulate` (k calls) and the plain
step on the same sequences. Ratios are medians of interleaved rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import harness

from .setup import ANCHOR, Bench, Key, model_info, model_line, variant_row

MODES = ("microbatch", "accumulate", "scan", "multisteps")


def target_keys(sizes: dict[str, Any]) -> list[Key]:
    """The anchors of the targets: the hand scan and ``optax.MultiSteps``."""
    return [
        Key(mode, *ANCHOR, k, sizes["micro"])
        for k in sizes["target_ks"]
        for mode in ("scan", "multisteps")
    ]


def targets(bench: Bench, sizes: dict[str, Any], times: dict) -> list[dict]:
    """Per target k: the ratios the targets are held to."""
    out, mv = [], bench.variants
    for k in sizes["target_ks"]:
        fused, acc, scan, ms = (Key(m, *ANCHOR, k, sizes["micro"]) for m in MODES)
        out.append(
            {
                "k": k,
                "fused_vs_scan_time": harness.ratio(times, fused, scan).median,
                "fused_vs_scan_peak": mv[fused].memory["peak"]
                / mv[scan].memory["peak"],
                "accumulate_vs_multisteps_time": harness.ratio(times, acc, ms).median,
                # The floor of accumulation: k gradients and one AdamW step.
                "scan_vs_multisteps_time": harness.ratio(times, scan, ms).median,
                "accumulate_vs_multisteps_temp": (
                    mv[acc].memory["temp"] / mv[ms].memory["temp"]
                ),
                "accumulate_vs_multisteps_peak": (
                    mv[acc].memory["peak"] / mv[ms].memory["peak"]
                ),
            }
        )
    return out


def markdown_targets(data: dict) -> list[str]:
    header = ["k", "fused / hand scan, time (<= 1.05)"]
    header += ["`accumulate` / `optax.MultiSteps`, time per update (<= 0.7)"]
    header += ["floor: hand scan / MultiSteps, time"]
    header += ["`accumulate` / MultiSteps, temp (<= 1.0)"]
    rows = [
        [
            t["k"],
            f"{t['fused_vs_scan_time']:.3f}",
            f"{t['accumulate_vs_multisteps_time']:.3f}",
            f"{t['scan_vs_multisteps_time']:.3f}"
            if "scan_vs_multisteps_time" in t
            else "-",
            f"{t['accumulate_vs_multisteps_temp']:.3f}",
        ]
        for t in data["targets"]
    ]
    return ["Targets (f32, no remat):", "", *harness.table(header, rows, "rrrrr")]


# ----------------------------------------- the device run's sections (shared)


def timing_rows(bench: Bench, keys: list[Key], times: dict, anchor: Key) -> list[dict]:
    """A row per step: time per update and per token, and against ``anchor``."""
    rows = []
    for key in keys:
        row = variant_row(bench, key)
        if key not in times:
            rows.append({**row, "status": "not timed"})
            continue
        seconds = harness.median(times[key])
        ratio = harness.ratio(times, key, anchor) if anchor in times else None
        rows.append(
            {
                **row,
                "status": "ok",
                "seconds_per_update": seconds,
                "us_per_token": 1e6 * seconds / row["tokens_per_update"],
                "tokens_per_s": row["tokens_per_update"] / seconds,
                "time_vs_plain": ratio.median if ratio else None,
                "time_vs_plain_iqr": [ratio.q25, ratio.q75] if ratio else None,
                "compiled_peak_bytes": bench.variants[key].memory["peak"],
            }
        )
    return rows


NAMES = {
    "full": "plain step",
    "microbatch": "`microbatch` (1 call)",
    "accumulate": "`accumulate` (k calls)",
}


def timing_table(rows: list[dict[str, Any]], plain_name: str) -> list[str]:
    """The table of `timing_rows`."""
    header = ["step", "remat", "k", "micro-batch", "tokens / update"]
    header += ["time / update (ms)", "µs / token", "tokens / s"]
    header += [f"time vs {plain_name}", "compiled peak (GiB)"]
    lines = []
    for r in rows:
        head = [NAMES.get(r["step"], r["step"]), r["remat"], r["k"], r["micro_batch"]]
        head.append(f"{r['tokens_per_update']:,}")
        if r["status"] != "ok":
            lines.append("| " + " | ".join(map(str, head)) + f" | {r['status']} ||||| ")
            continue
        ratio = r["time_vs_plain"]
        lines.append(
            [
                *head,
                f"{r['seconds_per_update'] * 1e3:,.1f}",
                f"{r['us_per_token']:.3f}",
                f"{r['tokens_per_s']:,.0f}",
                "-" if ratio is None else f"{ratio:.3f}x",
                harness.gib(r["compiled_peak_bytes"]),
            ]
        )
    return harness.table(header, lines, "llrrrrrrrr")


def measure(
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
    and of the plain step on the same ``k * micro`` sequences."""
    plain = Key("full", "none", dtype, 1, k * micro)
    keys = [Key("microbatch", r, dtype, k, micro) for r in remats]
    keys += [Key("accumulate", "none", dtype, k, micro), plain]
    n0 = bench.compilations
    bench.add_many(keys, threads, deadline)
    timed = [key for key in keys if key in bench.variants and bench.fits(key)]
    times = bench.time_all(timed, rounds)
    return {
        "model": model_info(bench),
        "dtype": dtype,
        "k": k,
        "micro_batch": micro,
        "rounds": rounds,
        "compilations": bench.compilations - n0,
        "rows": timing_rows(bench, keys, times, plain),
    }


def markdown(data: dict[str, Any]) -> str:
    """The Markdown table of `measure`'s result."""
    lines = [
        f"{model_line(data['model'])}, AdamW, compute {data['dtype']}, k = "
        f"{data['k']} micro-batches of {data['micro_batch']} sequences; median "
        f"of {data['rounds']} interleaved rounds. Time vs the plain step (no "
        "accumulation, no remat) on the same sequences.",
        "",
        *timing_table(data["rows"], "plain"),
    ]
    return "\n".join(lines)
