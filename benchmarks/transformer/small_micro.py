# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The small-micro-batch slowdown: time per token against the micro-batch size.

A fixed effective batch of ``sweep_batch`` sequences (f32, no remat) in
micro-batches of each of ``sweep_micros``, by `microbatch` and by
`accumulate`, against the full batch in one step.
"""

from __future__ import annotations

from typing import Any

import harness

from .setup import Key


def sweep_keys(sizes: dict[str, Any]) -> tuple[list[Key], Key]:
    """The sweep's steps, and its anchor (the full batch in one step)."""
    e = sizes["sweep_batch"]
    keys = [
        Key(mode, "none", "f32", e // m, m)
        for m in sizes["sweep_micros"]
        for mode in ("microbatch", "accumulate")
    ]
    return keys, Key("full", "none", "f32", 1, e)


def markdown(data: dict[str, Any]) -> list[str]:
    """The sweep's table, from the CPU grid's data."""
    sw = data["sweep"]
    pairs: dict[int, dict] = {}
    for r in sw["rows"]:
        pairs.setdefault(r["micro_batch"], {})[r["mode"]] = r
    lines = [
        f"Small micro-batches: effective batch {sw['effective_batch']} sequences "
        f"(f32, no remat), time per token vs the full batch in one step:",
        "",
    ]
    rows = []
    for mb, pr in pairs.items():
        cells = [
            pr[m]["time_per_token_vs_full_f32"] for m in ("microbatch", "accumulate")
        ]
        rows.append(
            [
                mb,
                pr["microbatch"]["k"],
                *(f"{c:.2f}x" if c is not None else "-" for c in cells),
            ]
        )
    header = ["micro-batch", "k", "`microbatch`", "`accumulate`"]
    return lines + harness.table(header, rows, "rrrr")
