# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The largest batch that fits, and accumulation's cost there.

On the CPU grid (`plans`, `markdown_plans`): the largest micro-batch of an
`accumulate` step under a memory budget per combination, and the largest
plain batch, from `optax_accum.plan_microbatch`. On a device (`measure`,
`markdown`): the largest plain batch from compiled estimates, and the plain
step, `microbatch` and `accumulate` timed on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import harness
import jax

import optax_accum

from .setup import Bench, Key, model_info, model_line
from .steps import gpt, step_fn
from .time_per_token import timing_rows, timing_table


def planner(
    step: Callable,
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


def plan(bench: Bench, mode: str, remat: str, dtype: str, budget: int | None) -> dict:
    """The largest micro-batch of a ``mode`` step under the budget."""
    fn, kind = step_fn(Key(mode, remat, dtype, 1, 1), bench.cfg)
    return planner(
        jax.jit(fn, donate_argnums=(0, 1)),
        bench.params,
        bench.state(kind),
        gpt.example(bench.cfg),
        bench.sizes["plan_target"],
        budget,
        bench.sizes["plan_max"],
    )


def plans(bench: Bench, sizes: dict[str, Any]) -> tuple[list[dict], dict]:
    """Per combination, `accumulate`'s plan; and the plain f32 step's."""
    if not sizes.get("plans", True):
        return [], {}
    out = []
    for remat, dtype in sizes["combos"]:
        p = plan(bench, "accumulate", remat, dtype, sizes["budget"])
        out.append({"remat": remat, "dtype": dtype, "plan": p})
        bench.log(f"plan {remat} {dtype}: {p}")
    return out, plan(bench, "full", "none", "f32", sizes["budget"])


def markdown_plans(data: dict) -> list[str]:
    mib = harness.mib
    budget = data["budget"] or next(
        (
            p["plan"]["memory_budget"]
            for p in data["plans"]
            if "memory_budget" in p["plan"]
        ),
        None,
    )
    rows = []
    for p in data["plans"]:
        size = p["plan"].get("microbatch_size")
        if "error" in p["plan"]:
            rows.append([p["remat"], p["dtype"], "none fits", "-", "-"])
        else:
            rows.append(
                [
                    p["remat"],
                    p["dtype"],
                    size,
                    mib(p["plan"]["memory_bytes"]),
                    16 * size,
                ]
            )
    header = ["remat", "compute", "micro-batch (sequences)", "its peak (MiB)"]
    header += ["effective batch at k = 16"]
    lines = [
        f"Largest micro-batch under a budget of {mib(budget) if budget else '?'} "
        f"MiB (the planner on the `accumulate` step, candidates dividing "
        f"{data['sizes']['plan_target']}):",
        "",
        *harness.table(header, rows, "llrrr"),
    ]
    fp = data["plan_full_batch_f32"]
    if fp and "error" not in fp:
        lines += [
            "",
            f"Without accumulation (f32, no remat) the largest batch that fits is "
            f"{fp['microbatch_size']} sequences ({mib(fp['memory_bytes'])} MiB).",
        ]
    return lines


# ------------------------------------------------- the device run's section


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


def _checked_batch(bench, remat, dtype, k, points, budget, step, max_batch, threads):
    """The batch of the fit, compiled with the next one up; refitted once if
    its compiled peak is over the budget. Returns the keys and the check."""
    batch = largest_batch(points, budget, step, max_batch)
    bench.log(f"largest batch by the fit of {points}: {batch}")
    for _ in range(2):
        if batch < step:
            raise ValueError(f"no batch fits the budget of {budget:,} bytes: {points}")
        keys = [Key("full", remat, dtype, 1, batch)]
        keys += [
            Key(mode, remat, dtype, k, batch // k)
            for mode in ("microbatch", "accumulate")
        ]
        above = Key("full", remat, dtype, 1, batch + step)
        bench.add_many([*keys, above] if batch + step <= max_batch else keys, threads)
        peak = bench.variants[keys[0]].memory["peak"]
        points += [(batch, peak)]
        if peak <= budget:
            nxt = bench.variants.get(above)
            return keys, above, nxt is None or nxt.memory["peak"] > budget
        bench.log(f"batch {batch}: compiled peak {peak:,} over the budget; refitting")
        batch = largest_batch(points, budget, step, batch - step)
    raise ValueError(f"no batch under the budget of {budget:,} bytes: {points}")


def measure(
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
    timed in interleaved rounds, as ratios to the plain step.
    """
    n0, step = bench.compilations, math.lcm(multiple, k)
    fit = [Key("full", remat, dtype, 1, b) for b in fit_batches]
    bench.add_many(fit, threads, deadline)
    points = [(key.micro, bench.variants[key].memory["peak"]) for key in fit]
    keys, above, checked = _checked_batch(
        bench, remat, dtype, k, points, budget, step, max_batch, threads
    )
    times = bench.time_all([key for key in keys if bench.fits(key)], rounds)
    above_v = bench.variants.get(above)
    return {
        "model": model_info(bench),
        "dtype": dtype,
        "remat": remat,
        "k": k,
        "batch": keys[0].micro,
        "budget_bytes": budget,
        "fit_points": [list(p) for p in points],
        "next_batch": above.micro if above_v else None,
        "next_batch_peak_bytes": above_v.memory["peak"] if above_v else None,
        "largest_checked": checked,
        "rounds": rounds,
        "compilations": bench.compilations - n0,
        "rows": timing_rows(bench, keys, times, keys[0]),
    }


def markdown(data: dict[str, Any]) -> str:
    """The Markdown table of `measure`'s result."""
    gib, nxt = harness.gib, data["next_batch"]
    check = (
        f"batch {nxt} estimates {gib(data['next_batch_peak_bytes'])} GiB"
        if nxt
        else "no larger batch was tried"
    )
    lines = [
        f"{model_line(data['model'])}, AdamW, compute {data['dtype']}, remat "
        f"{data['remat']}. Largest plain batch under a budget of "
        f"{gib(data['budget_bytes'])} GiB, from compiled estimates: "
        f"{data['batch']} sequences ({check}"
        + ("" if data["largest_checked"] else ", also under it: the fit is cautious")
        + f"). Then k = {data['k']}; median of {data['rounds']} interleaved rounds.",
        "",
        *timing_table(data["rows"], "plain"),
    ]
    return "\n".join(lines)
