# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The device run of ``benchmarks/run.py --device``: named sections, one budget.

The run is data: `sections` lists each part as a `Section` (its name, title,
estimated time, the function that measures it and the one that renders it).
`run_sections` is the budget loop: a section starts only if its estimate
fits in what is left, and the Markdown and JSON are written after each one.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import harness


class Section(NamedTuple):
    """One part of the device run: what it measures, how long, how shown."""

    name: str
    title: str
    estimate_s: float
    run: Callable[[float], dict]  # deadline (time.monotonic) -> data
    render: Callable[[dict], str]


@dataclass
class Outcome:
    """What became of a section."""

    section: Section
    status: str = "not started"
    seconds: float = 0.0
    data: dict | None = None
    error: str | None = None

    def record(self) -> dict[str, Any]:
        s = self.section
        return {
            "name": s.name, "title": s.title, "status": self.status,
            "estimate_s": s.estimate_s, "seconds": self.seconds,
            "error": self.error, "data": self.data,
        }  # fmt: skip

    def markdown(self) -> str:
        text = f"### {self.section.title}\n\n"
        if self.status == "ok":
            return text + self.section.render(self.data).strip() + "\n"
        if self.status == "error":
            return text + f"Failed after {self.seconds:.0f} s: `{self.error}`\n"
        return text + self.status[:1].upper() + self.status[1:] + ".\n"


@dataclass
class Context:
    """What the sections share: the config, the log, the GPT made once."""

    cfg: dict[str, Any]
    cache_dir: str
    log: Callable[[str], None]
    _bench: Any = field(default=None, repr=False)

    def bench(self) -> Any:
        if self._bench is None:
            from transformer.setup import Bench

            self._bench = Bench(self.cfg["transformer"], log=self.log)
        return self._bench

    def common(self, name: str) -> dict[str, Any]:
        return {
            **self.cfg[name]["args"],
            "threads": self.cfg["threads"],
            "log": self.log,
        }


def _overhead_budget(c: dict[str, Any]) -> int:
    """The overhead section's memory budget: given, or a fraction of what is free."""
    if c["budget_bytes"] is not None:
        return c["budget_bytes"]
    stats = harness.memory_stats()
    if "bytes_limit" not in stats:
        raise RuntimeError("the device reports no memory limit")
    return int(
        c["budget_fraction"] * (stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    )


def _titles(cfg: dict[str, Any]) -> dict[str, str]:
    a, m = cfg["accumulate"]["config"], cfg["microbatch"]["config"]
    mm, tt = cfg["memory_map"]["args"], cfg["time_per_token"]["args"]
    oh, preset = cfg["overhead"]["args"], cfg["transformer"]["preset"]
    of, pp = cfg["offload"]["args"], cfg["pipeline"]["config"]
    return {
        "accumulate": f"`accumulate` vs `optax.MultiSteps`: {a['depth']}x"
        f"{a['width']} MLP, micro-batch {a['micro']}, k={a['k']}, Adam, 1 device",
        "microbatch": "`microbatch` vs a hand-written `lax.scan` vs "
        f"`optax.microbatching.microbatch`: {m['layers']}x{m['width']} MLP, "
        f"micro-batch {m['micro']}, k={m['k']}, Adam, 1 device",
        "memory_map": f"Memory map: {preset}, remat {'/'.join(mm['remats'])} x "
        f"{'/'.join(mm['dtypes'])} x k={'/'.join(map(str, mm['ks']))}, "
        f"micro-batch {mm['micro']}, measured vs compiled peak",
        "time_per_token": f"Time per token: {preset}, {tt['dtype']}, micro-batch "
        f"{tt['micro']}, k={tt['k']}",
        "overhead": "Accumulation overhead at the largest plain batch that fits: "
        f"{preset}, {oh['dtype']}, remat {oh['remat']}, k={oh['k']}",
        "offload": f"Offload: AdamW's state in host memory, {preset}, "
        f"{of['dtype']}, fused step and `accumulate` at "
        f"k={'/'.join(map(str, of['ks']))}, with and without",
        "pipeline": "Pipeline machinery at S = 1: every schedule against plain "
        f"`jax.value_and_grad` over the same micro-batches, width {pp['width']}, "
        f"M={pp['m']}",
    }


def sections(ctx: Context) -> list[Section]:
    """The device run, in order."""
    import bench_accumulate as ba
    import bench_microbatch as bm
    import pipeline_device as pd
    from transformer import largest_batch, memory_map, offload, time_per_token

    cfg, title = ctx.cfg, _titles(ctx.cfg)
    runs: dict[str, tuple[Callable[[float], dict], Callable[[dict], str]]] = {
        "accumulate": (
            lambda _: ba.measure(config=cfg["accumulate"]["config"], log=ctx.log),
            ba.markdown,
        ),
        "microbatch": (
            lambda _: bm.measure(config=cfg["microbatch"]["config"], log=ctx.log),
            bm.markdown,
        ),
        "memory_map": (
            lambda deadline: memory_map.measure(
                ctx.bench(), **ctx.common("memory_map"), workers=cfg["workers"],
                worker_timeout_s=cfg["worker_timeout_s"], cache_dir=ctx.cache_dir,
                deadline=deadline,
            ),
            memory_map.markdown,
        ),
        "time_per_token": (
            lambda deadline: time_per_token.measure(
                ctx.bench(), **ctx.common("time_per_token"), deadline=deadline
            ),
            time_per_token.markdown,
        ),
        "overhead": (
            lambda deadline: largest_batch.measure(
                ctx.bench(), **ctx.common("overhead"), deadline=deadline,
                budget=_overhead_budget(cfg["overhead"]),
            ),
            largest_batch.markdown,
        ),
        "offload": (
            lambda deadline: offload.measure(
                ctx.bench(), **ctx.common("offload"), deadline=deadline
            ),
            offload.markdown,
        ),
        "pipeline": (
            lambda _: pd.measure(cfg["pipeline"]["config"], log=ctx.log),
            pd.markdown,
        ),
    }  # fmt: skip
    return [
        Section(name, title[name], cfg[name]["estimate_s"], run, render)
        for name, (run, render) in runs.items()
    ]


def _run_one(outcome: Outcome, deadline: float, log: Callable[[str], None]) -> None:
    section = outcome.section
    log(f"{section.name}: start ({section.title})")
    t0 = time.monotonic()
    try:
        outcome.data = section.run(deadline)
        outcome.status = "ok"
    except Exception as e:  # keep the other sections' results
        outcome.status = "error"
        outcome.error = (
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        )
        traceback.print_exc()
    outcome.seconds = time.monotonic() - t0
    log(f"{section.name}: {outcome.status} in {outcome.seconds:.1f} s")
    if outcome.status == "ok":
        print(section.render(outcome.data), flush=True)


def run_sections(
    todo: list[Section],
    start: float,
    budget_s: float,
    write: Callable[[list[Outcome]], None],
    log: Callable[[str], None],
) -> list[Outcome]:
    """The budget loop: each section that fits in the time left, then `write`.

    A section must stop starting work at the budget's end less the estimates
    of the sections after it (its deadline).
    """
    end, outcomes = start + budget_s, [Outcome(s) for s in todo]
    for i, outcome in enumerate(outcomes):
        left, need = end - time.monotonic(), outcome.section.estimate_s
        if need > left:
            outcome.status = f"not run: the time budget of {budget_s:g} s " + (
                f"has {left:.0f} s left, this section needs ~{need:.0f} s"
                if left > 0
                else f"was spent ({time.monotonic() - start:.0f} s used)"
            )
            log(f"{outcome.section.name}: {outcome.status}")
        else:
            _run_one(outcome, end - sum(s.estimate_s for s in todo[i + 1 :]), log)
        write(outcomes)
    return outcomes


def _head(
    info: dict, command: str, budget_s: float, elapsed: float, spent: list
) -> str:
    limit = info["bytes_limit"]
    return (
        f"## Benchmarks on {info['device']} ({info['backend']}, "
        f"{info['device_count']} device(s))\n\n"
        f"jax {info['jax']} (jaxlib {info['jaxlib']}), optax {info['optax']}, "
        f"{info['platform_version'] or info['platform']}, memory limit "
        + (f"{limit / 2**30:.1f} GiB" if limit else "not reported")
        + f", {info['date']}. Command: `{command}`. Time budget "
        f"{budget_s:g} s, {elapsed:.0f} s used"
        + ("; not started for lack of time: " + ", ".join(spent) if spent else "")
        + f". Matmul precision: {info['default_matmul_precision'] or 'default'}"
        ". Every ratio is the median of interleaved rounds in one process.\n"
    )


def report(
    outcomes: list[Outcome], info: dict, command: str, budget_s: float, elapsed: float
) -> str:
    """The Markdown of the device run so far: a header, each section, a summary."""
    spent = [o.section.name for o in outcomes if o.status.startswith("not run")]
    rows = [
        [o.section.name, o.status, f"{o.seconds:.1f}", f"{o.section.estimate_s:.0f}",
         (o.data or {}).get("compilations", "-")]
        for o in outcomes
    ]  # fmt: skip
    header = ["section", "status", "seconds", "estimate (s)", "compilations"]
    summary = ["### Sections", "", *harness.table(header, rows, "llrrr")]
    parts = [_head(info, command, budget_s, elapsed, spent)]
    parts += [o.markdown() for o in outcomes] + ["\n".join(summary)]
    return "\n".join(parts) + "\n"


def writer(
    md: Path, info: dict, command: str, smoke: bool, budget_s: float, start: float
):
    """``write(outcomes)``: the Markdown and the JSON of the run so far."""

    def write(outcomes: list[Outcome]) -> None:
        elapsed = time.monotonic() - start
        record = {"smoke": smoke, "budget_s": budget_s, "elapsed_s": elapsed}
        record["sections"] = [o.record() for o in outcomes]
        text = report(outcomes, info, command, budget_s, elapsed)
        harness.write_results(md, text, {**info, **record}, command)

    return write
