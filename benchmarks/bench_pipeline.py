# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Pipeline parallelism: bubbles, collectives, memory slopes, compile time.

Config: the tests' tiny staged model (``tests/pipeline/models.py``: a tanh
embedding, residual tanh stages, a linear head with a masked squared error)
on a ``(data, stage=4)`` mesh of CPU devices.

- **Bubbles**: the idle fraction of each schedule's table, as slots and as
  time under lock-step SPMD with equal op costs (``costs=(1, 1, 1)``: a
  tick lasts as long as its busiest device's op), for S in {2, 4, 8} and
  M in {S, 4S, 16S}, against the formulas ``(S-1)/(M+S-1)`` (GPipe) and
  ``(S-1)/(r·M+S-1)`` (circular, and interleaved 1F1B's time bubble). Read
  from the tables: no compile.
- **Collectives**: per loop body and outside the loops, read from the
  compiled HLO on a (data 2, stage 4) mesh.
- **Memory**: the compiled temp bytes for M = 8 ... 64 and their slope per
  micro-batch, next to the bytes of one stage input (1F1B and interleaved
  1F1B: about 0; GPipe, rematerialised per tick: about one stage input).
- **Program size and compile time** for M = 4 and M = 64 (the fastest of
  ``rounds`` fresh compiles).
- **Time per token** of one pipelined value-and-grad against the
  unpipelined ``jax.value_and_grad`` (on 8 CPU "devices" sharing one host
  this measures overhead, not speed-up; on a device it means more).

Run: ``python benchmarks/bench_pipeline.py [--quick] [--json FILE]``.
`measure` returns the data, `markdown` renders it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import harness

SCHEDULES = (
    ("gpipe", 1),
    ("circular", 2),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("zb_h1", 1),
)
STAGES = 4
UNIT_COSTS = (1, 1, 1)  # forward, input gradient, weight gradient


def label(name: str, repeats: int) -> str:
    return name + (f"_r{repeats}" if repeats > 1 else "")


def bubbles() -> list[dict]:
    """Slot and time bubbles of every schedule, from the tables alone."""
    from optax_accum import pipeline as pl

    rows = []
    for s in (2, 4, 8):
        for m in (s, 4 * s, 16 * s):
            row = {"S": s, "M": m, "gpipe_formula": (s - 1) / (m + s - 1)}
            for name, r in SCHEDULES:
                row[label(name, r)] = pl.idle_slots(name, s, m, r)
                row[label(name, r) + "_time"] = pl.bubble_fraction(
                    name, s, m, r, costs=UNIT_COSTS
                )
            row["circular_r2_formula"] = (s - 1) / (2 * m + s - 1)
            rows.append(row)
    return rows


def lowered(schedule: str, repeats: int, m: int, data: int = 1, rows=2, width=8):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from optax_accum import pipeline as pl
    from tests.pipeline import models as md

    devices = jax.devices()[: STAGES * data]
    mesh = jax.make_mesh((data, STAGES), ("data", "stage"), devices=devices)
    params, batch = md.make(STAGES * repeats, rows=rows * m * data, width=width)
    with jax.set_mesh(mesh):
        # The stages placed where they run (their gradients then stay there).
        fp, sp, lp = params
        params = (fp, jax.device_put(sp, NamedSharding(mesh, P("stage"))), lp)
        kw = {}
        if data > 1:
            batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
            kw["data_axes"] = "data"
        vg = pl.value_and_grad(
            md.first_fn,
            md.stage_fn,
            md.loss_fn,
            m,
            schedule=schedule,
            repeats=repeats,
            **kw,
        )
        return jax.jit(vg).lower(params, batch), mesh, (params, batch)


def collectives(schedule: str, repeats: int) -> dict:
    from tests.helpers import hlo

    low, mesh, _ = lowered(schedule, repeats, 8, data=2)
    comps, _ = hlo.computations(low.compile().as_text())
    inside = set()
    for body in hlo.while_bodies(comps):
        inside |= hlo.reachable(comps, [body])
    out: dict[str, int] = {}
    for where, names in (("loop", inside), ("outside", set(comps) - inside)):
        for op, groups, _ in hlo.collectives(comps, names, 8):
            axes = [a for a in ("stage", "data") if hlo.crosses(groups, mesh, a)]
            key = f"{where}: {op} over {'+'.join(axes) or 'none'}"
            out[key] = out.get(key, 0) + 1
    out["loops"] = len(hlo.while_bodies(comps))
    return out


def memory(schedule: str, repeats: int, ms=(8, 16, 32, 64)) -> dict:
    import numpy as np

    rows, width = 4, 64
    temps = [
        lowered(schedule, repeats, m, rows=rows, width=width)[0]
        .compile()
        .memory_analysis()
        .temp_size_in_bytes
        for m in ms
    ]
    slope = float(np.polyfit(np.asarray(ms, float), np.asarray(temps, float), 1)[0])
    return {
        "M": list(ms),
        "temp_bytes": temps,
        "slope_bytes_per_microbatch": slope,
        "stage_input_bytes": rows * width * 4,
    }


def program(schedule: str, repeats: int, rounds: int) -> dict:
    import jax

    from tests.helpers import hlo

    out = {}
    old = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        for m in (4, 64):
            best = float("inf")
            for _ in range(rounds):
                low = lowered(schedule, repeats, m)[0]  # a fresh program
                start = time.perf_counter()
                text = low.compile().as_text()
                best = min(best, time.perf_counter() - start)
            comps, _ = hlo.computations(text)
            out[f"M={m}"] = {
                "instructions": sum(len(v) for v in comps.values()),
                "compile_s": best,
            }
    finally:
        jax.config.update("jax_enable_compilation_cache", old)
    return out


def time_per_token(schedule: str, repeats: int, rounds: int, m: int = 16) -> dict:
    import jax

    from tests.pipeline import models as md

    low, mesh, (params, batch) = lowered(schedule, repeats, m, rows=32, width=256)
    piped = low.compile()
    plain = jax.jit(jax.value_and_grad(md.sequential))
    tokens = jax.tree.leaves(batch)[0].shape[0]
    host = jax.device_get((params, batch))

    def best(fn):
        jax.block_until_ready(fn(params, batch))
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            jax.block_until_ready(fn(params, batch))
            times.append(time.perf_counter() - start)
        return min(times) / tokens * 1e6

    with jax.set_mesh(mesh):
        ours = best(piped)
    return {
        "pipelined_us_per_token": ours,
        # On one device: the placed stages' copy on the host.
        "sequential_us_per_token": best(lambda p, b: plain(*host)),
        "backend": jax.default_backend(),
    }


def measure(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    """Every measurement, as data. Needs 8 CPU devices: in a process with
    fewer (`benchmarks/run.py`'s), it runs this script in a subprocess."""
    rounds = rounds or (1 if quick else 3)
    if harness.needs_cpu_devices(8):
        argv = ["--rounds", str(rounds), *["--quick"] * quick]
        return harness.json_of_script(__file__, argv)
    data: dict[str, Any] = {"bubbles": bubbles(), "schedules": {}}
    for name, r in SCHEDULES:
        key = name + (f" (repeats {r})" if r > 1 else "")
        entry = {
            "collectives": collectives(name, r),
            "program": program(name, r, rounds),
        }
        if name != "circular":
            entry["memory"] = memory(name, r, (8, 64) if quick else (8, 16, 32, 64))
        entry["time"] = time_per_token(name, r, rounds)
        data["schedules"][key] = entry
    return data


def markdown(data: dict[str, Any]) -> str:
    """The measurements as Markdown tables, after the line that made them."""
    lines = []
    if "run" in data:
        lines += [
            f"Made by `{data['run']}`: {data['devices']} on a "
            f"{data['cores']}-core machine (the µs/token column times devices "
            "sharing those cores: overhead, not speed-up).",
            "",
        ]
    lines += bubble_markdown(data["bubbles"])
    lines += [
        "",
        "## Per schedule (S = 4)",
        "",
        "| schedule | collectives (data 2 x stage 4, M = 8; loop: in all loop bodies) "
        "| HLO instructions "
        "M=4 / M=64 | compile s M=4 / M=64 | temp slope B/micro-batch "
        "(one stage input) | µs/token pipelined / sequential |",
        "|---|---|---|---|---|---|",
    ]
    for name, e in data["schedules"].items():
        coll = "; ".join(f"{k}: {v}" for k, v in e["collectives"].items())
        p4, p64 = e["program"]["M=4"], e["program"]["M=64"]
        mem = e.get("memory")
        slope = (
            f"{mem['slope_bytes_per_microbatch']:.0f} ({mem['stage_input_bytes']})"
            if mem
            else "n/a"
        )
        t = e["time"]
        lines.append(
            f"| {name} | {coll} | {p4['instructions']} / {p64['instructions']} | "
            f"{p4['compile_s']:.2f} / {p64['compile_s']:.2f} | {slope} | "
            f"{t['pipelined_us_per_token']:.2f} / {t['sequential_us_per_token']:.2f} "
            f"({t['backend']}) |"
        )
    return "\n".join(lines) + "\n"


def bubble_markdown(rows: list[dict]) -> list[str]:
    """The bubble table: slots / time (equal costs) per schedule."""
    names = [label(n, r) for n, r in SCHEDULES]
    lines = [
        "## Bubble fraction: idle slots / idle time (lock-step, costs 1, 1, 1)",
        "",
        "| S | M | GPipe formula | circular r=2 formula | " + " | ".join(names) + " |",
        "|---|---|---|---|" + "---|" * len(names),
    ]
    for b in rows:
        cells = [f"{b[n]:.3f} / {b[n + '_time']:.3f}" for n in names]
        lines.append(
            f"| {b['S']} | {b['M']} | {b['gpipe_formula']:.3f} "
            f"| {b['circular_r2_formula']:.3f} | " + " | ".join(cells) + " |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the data here")
    args = parser.parse_args(argv)
    import jax

    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        jax.config.update("jax_num_cpu_devices", 8)
    data = measure(args.quick, args.rounds)
    flags = " --quick" * args.quick + (f" --json {args.json}" if args.json else "")
    data["run"] = f"python benchmarks/bench_pipeline.py{flags}"
    data["devices"] = f"{jax.device_count()} {jax.default_backend().upper()} devices"
    data["cores"] = os.cpu_count()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    print(markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
