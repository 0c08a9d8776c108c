# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Offload: AdamW's state in host memory between updates, against keeping it.

Both forms, at each k: the fused step (`microbatch` then ``tx.update``, the
state moves once per step) and `accumulate` (k calls, the state moves in the
boundary branch only), each with and without `optax_accum.offload`. Per
step: device bytes from ``memory_analysis()`` (which splits host from device
memory on a GPU; on the CPU, which reports no split, the state's own bytes
are taken out), and the time per update as a ratio against the same form
without offload. Expected on a GPU: about 8 bytes per parameter saved, and a
time overhead that falls with k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import harness
import jax

from .setup import Bench, Key, model_info, model_line
from .steps import OFFLOAD

FORMS = ("microbatch", "accumulate")
NAMES = {"microbatch": "fused step", "accumulate": "`accumulate` (k calls)"}


def _keys(forms, ks, remat, dtype, micro) -> list[tuple[Key, Key]]:
    """(without, with offload) per form and k."""
    return [
        (Key(form, remat, dtype, k, micro), Key(form + OFFLOAD, remat, dtype, k, micro))
        for form in forms
        for k in ks
    ]


def _row(bench: Bench, plain: Key, offl: Key, times: dict, n: int) -> dict[str, Any]:
    row: dict[str, Any] = {"form": plain.mode, "k": plain.k, "micro_batch": plain.micro}
    if plain not in bench.variants or offl not in bench.variants:
        return {**row, "status": "not compiled"}
    mp, mo = bench.variants[plain].memory, bench.variants[offl].memory
    ratio = harness.ratio(times, offl, plain) if {plain, offl} <= set(times) else None
    return {
        **row,
        "status": "ok" if ratio else "not timed",
        "device_bytes": mp["peak"],
        "device_bytes_offload": mo["peak"],
        "host_bytes_offload": mo["host"],
        "saved_bytes_per_param": (mp["peak"] - mo["peak"]) / n,
        "seconds_per_update": harness.median(times[plain]) if ratio else None,
        "time_vs_no_offload": ratio.median if ratio else None,
        "time_vs_no_offload_iqr": [ratio.q25, ratio.q75] if ratio else None,
    }


def measure(
    bench: Bench,
    *,
    ks: tuple[int, ...],
    remat: str,
    dtype: str,
    micro: int,
    rounds: int,
    threads: int,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Device bytes and time per update of both forms with and without
    offload, at each k of ``ks``."""
    pairs = _keys(FORMS, ks, remat, dtype, micro)
    keys = [key for pair in pairs for key in pair]
    n0 = bench.compilations
    bench.add_many(keys, threads, deadline)
    timed = [key for key in keys if key in bench.variants and bench.fits(key)]
    times = bench.time_all(timed, rounds)
    split = any(bench.variants[k].memory["host"] for k in timed if OFFLOAD in k.mode)
    model = model_info(bench)
    return {
        "model": model,
        "dtype": dtype,
        "remat": remat,
        "micro_batch": micro,
        "rounds": rounds,
        "backend": jax.default_backend(),
        "host_split": split,
        "compilations": bench.compilations - n0,
        "rows": [_row(bench, p, o, times, model["params"]) for p, o in pairs],
    }


def _note(data: dict[str, Any]) -> str:
    if data["host_split"]:
        return "Device bytes are memory_analysis()'s own device sizes."
    return (
        f"On {data['backend']}, memory_analysis() reports no host split: host "
        "and device share memory there, so the device bytes with offload leave "
        "out the state's own bytes, and the times show the copies' cost only. "
        "The offloaded steps donate the parameters only (the state's pairing "
        "on one device is left to XLA), so the fused step's figure also counts "
        "the temp memory XLA then stops reporting: read the accumulate rows "
        "for the state's 8 bytes per parameter."
    )


def markdown(data: dict[str, Any]) -> str:
    """The Markdown table of `measure`'s result."""
    header = ["form", "k", "device bytes (MiB)", "with offload (MiB)"]
    header += ["saved bytes / param", "time / update (ms)", "time with offload"]
    lines = []
    for r in data["rows"]:
        head = [NAMES[r["form"]], r["k"]]
        if r["status"] == "not compiled":
            lines.append(head + ["not compiled"] + [""] * 4)
            continue
        seconds, ratio = r["seconds_per_update"], r["time_vs_no_offload"]
        lines.append(
            [
                *head,
                f"{r['device_bytes'] / 2**20:,.1f}",
                f"{r['device_bytes_offload'] / 2**20:,.1f}",
                f"{r['saved_bytes_per_param']:.2f}",
                "-" if seconds is None else f"{seconds * 1e3:,.1f}",
                "-" if ratio is None else f"{ratio:.3f}x",
            ]
        )
    text = [
        f"{model_line(data['model'])}, AdamW, compute {data['dtype']}, remat "
        f"{data['remat']}, micro-batches of {data['micro_batch']} sequences; "
        f"median of {data['rounds']} interleaved rounds. {_note(data)}",
        "",
        *harness.table(header, lines, "lrrrrrr"),
    ]
    return "\n".join(text)
