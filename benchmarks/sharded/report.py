# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The Markdown report of ``bench_sharded``: targets and tables a, b, c."""

from __future__ import annotations

from typing import Any

import harness

DEFER, DATA_AXES = "accumulate + defer_reduction", 'microbatch data_axes="data"'


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ratio(x: float | None, iqr: tuple | None = None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.2f}x" + (f" ({iqr[0]:.2f}-{iqr[1]:.2f})" if iqr else "")


def _target_rows(results: list) -> list[tuple[str, str, bool]]:
    """``(target, measured, met)`` for each threshold the layouts are held to."""
    rows = []
    by = {r["layout"]: r for r in results}
    for name in ("fsdp", "tp", "hsdp"):
        e = by.get(name, {}).get("k_calls", {}).get("accumulate")
        if not e or "time_vs_optax" not in e:
            continue
        (lo, hi), t, m = e["time_vs_optax_iqr"], e["time_vs_optax"], e["temp_vs_optax"]
        what = f"{name}: `accumulate` %s <= 1.0x optax.MultiSteps"
        rows.append((what % "time", f"{t:.2f}x (IQR {lo:.2f}-{hi:.2f})", t <= 1.0))
        rows.append((what % "temp", f"{m:.2f}x", m <= 1))
    e = by.get("hsdp", {}).get("one_call", {}).get(DATA_AXES)
    if e and "time_vs_scan" in e:
        (lo, hi), same = e["time_vs_scan_iqr"], e["same_program_as_scan"]
        note = " (the same compiled program)" if same else ""
        what = 'hsdp: `microbatch(data_axes="data")` %s <= 1.05x hand-written scan'
        t = e["time_vs_scan"]
        measured = f"{t:.2f}x (IQR {lo:.2f}-{hi:.2f}){note}"
        rows.append((what % "time", measured, t <= 1.05 or same))
        m = e["temp_vs_scan"]
        rows.append((what % "temp", f"{m:.2f}x{note}", m <= 1.05))
    for res in results:
        for name in (DEFER, DATA_AXES):
            group = res["k_calls"] if name == DEFER else res["one_call"]
            e = group.get(name)
            if not e or "collectives" not in e:
                continue
            n = e["collectives"]["inner"]["data"]
            where = "per call" if name == DEFER else "in the loop"
            what = f"{res['layout']}: `{name}`, collectives {where} crossing data = 0"
            rows.append((what, str(n), n == 0))
    return rows


def targets(results: list, cfg: dict) -> list[str]:
    """The thresholds the sharded layouts are held to, with the measured values."""
    rows = [(w, v, "yes" if ok else "**no**") for w, v, ok in _target_rows(results)]
    return [
        f"#### Targets: {cfg['depth']}x{cfg['width']} MLP, k={cfg['k']}, Adam, "
        "8 devices",
        "",
        *harness.table(["target", "measured", "met"], rows, "lll"),
    ]


def _timing_rows(results: list, group: str, vs: str, extra: bool) -> list:
    rows = []
    for res in results:
        for name, e in res[group].items():
            if "error" in e:
                span = "|" * (4 + extra)
                rows.append(f"| {res['layout']} | {name} | fails: {e['error']} {span}")
                continue
            row = [
                res["layout"],
                name,
                f"{e['time_s'] * 1e3:.1f} ms",
                _ratio(e.get(f"time_vs_{vs}"), e.get(f"time_vs_{vs}_iqr")),
                _fmt_bytes(e["temp"]),
                _ratio(e.get(f"temp_vs_{vs}")),
            ]
            if extra:
                row.append("yes" if e.get("same_program_as_scan") else "no")
            rows.append(row)
    return rows


def _collective_rows(results: list) -> list:
    rows = []
    for res in results:
        params = _fmt_bytes(res["param_bytes_per_device"])
        for name, e in {**res["k_calls"], **res["one_call"]}.items():
            if "error" in e:
                continue
            c = e["collectives"]
            i, o, t = c["inner"], c["outer"], c["total"]
            acc = e.get("acc_bytes_per_device")
            rows.append(
                [
                    res["layout"],
                    name,
                    f"{i['data']} / {o['data']}",
                    f"{t['data']} ({_fmt_bytes(t['data_bytes'])})",
                    f"{i['other']} / {o['other']}",
                    f"{t['other']} ({_fmt_bytes(t['other_bytes'])})",
                    f"{'carry' if acc is None else _fmt_bytes(acc)} / {params}",
                ]
            )
    return rows


COLLECTIVES_NOTE = [
    "Counts are of the compiled program, after XLA combines collectives "
    "(one tuple all-reduce counts once); bytes are each result's size. The "
    "CPU backend emits no reduce-scatter: an FSDP gradient's reduction is "
    "an all-reduce of the full gradient then a slice (GPU/TPU pipelines "
    "rewrite that pair to a reduce-scatter), so FSDP byte counts here are "
    "the fsdp-axis size times what a reduce-scatter moves.",
    "",
    "k-call faces: *inner* = per call (x k), *outer* = in the boundary "
    "branch (once). One-call faces: *inner* = in the loop (x k), *outer* = "
    "outside it. *data* = groups that cross the `data` axis (HSDP/FSDP: "
    "also those over data x fsdp), *other* = groups within one data index "
    "(fsdp, model).",
]


def markdown(data: dict[str, Any]) -> str:
    """The Markdown report of `measure`'s result."""
    results, cfg, rounds = data["layouts"], data["config"], data["rounds"]
    width, depth = cfg["width"], cfg["depth"]
    n_params = depth * (width * width + width)
    table = harness.table
    head = (
        f"Config: MLP {depth}x{width}x{width} ({n_params / 1e6:.2f}M params, "
        f"float32), micro-batch {cfg['micro']} rows, k = {cfg['k']}, Adam, 8 CPU "
        f"devices, Explicit meshes, donated jit steps; median of {rounds} "
        "interleaved rounds (IQR: 25th-75th percentile of the per-round ratios); "
        "temp = compiled `temp_size_in_bytes` per device."
    )
    a_header = ["layout", "variant", "time / update"]
    a_header += ["time vs optax.MultiSteps (IQR)", "temp", "temp vs optax.MultiSteps"]
    b_header = ["layout", "variant", "time / update", "time vs scan (IQR)", "temp"]
    b_header += ["temp vs scan", "same compiled program as the scan"]
    c_header = ["layout", "variant", "data: inner / outer", "data per update (bytes)"]
    c_header += ["other: inner / outer", "other per update (bytes)"]
    c_header += ["accumulator / params bytes per device"]
    lines = [
        head,
        "",
        *targets(results, cfg),
        "",
        "#### a. `accumulate` vs `optax.MultiSteps` (k jit calls per update)",
        "",
        "FSDP has no `defer_reduction` row: its only batch axis shards every "
        "parameter, so there is no pure data-parallel reduction to defer.",
        "",
        *table(a_header, _timing_rows(results, "k_calls", "optax", False), "llrrrr"),
        "",
        "#### b. `microbatch` vs a hand-written `lax.scan` (one jit call per update)",
        "",
        *table(b_header, _timing_rows(results, "one_call", "scan", True), "llrrrrl"),
        "",
        "#### c. Collectives per update (compiled HLO)",
        "",
        *COLLECTIVES_NOTE,
        "",
        *table(c_header, _collective_rows(results), "llrrrrr"),
    ]
    return "\n".join(lines)
