# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The measured peak of a step, each in a fresh process.

The allocator's peak (``peak_bytes_in_use`` of ``memory_stats()``) cannot be
reset, so each step to measure gets a process that runs nothing else. The
parent starts those processes (`measure_peaks`), at most ``max_workers`` at
once and only while their estimated bytes fit in a pool; each worker calls
`measured_peak` around its one update and prints its result as a JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax

from .memory import memory_stats

MiB = 2**20


def measured_peak(run: Callable[[], Any]) -> dict[str, Any]:
    """Runs ``run()`` (one update, its inputs ready) and reads the peaks.

    None where the backend reports no memory statistics (the CPU).
    """
    before = memory_stats()
    jax.block_until_ready(run())
    after = memory_stats()
    return {
        "measured_peak_bytes": after.get("peak_bytes_in_use"),
        "peak_before_step_bytes": before.get("peak_bytes_in_use"),
        "in_use_before_step_bytes": before.get("bytes_in_use"),
        "bytes_limit": after.get("bytes_limit"),
    }


def admissible(
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


def describe(result: dict[str, Any]) -> str:
    """One line on a worker's result, for the log."""
    if result.get("status") != "ok":
        return result.get("status", "?")
    peak = result.get("measured_peak_bytes")
    measured = "not reported" if peak is None else f"{peak / MiB:,.1f} MiB"
    return (
        f"measured {measured}, compiled {result['compiled_peak_bytes'] / MiB:,.1f} "
        f"MiB ({result['seconds']:.1f} s)"
    )


class _Pool:
    """The running workers: start, poll, kill after a timeout."""

    def __init__(self, command: list[str], tmp: str, timeout_s: float):
        self.command, self.tmp, self.timeout_s = command, tmp, timeout_s
        self.env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        self.env["PYTHONDONTWRITEBYTECODE"] = "1"
        self.running: list[tuple] = []  # (key, need, process, out, err, start)
        self.launched = 0

    def start(self, key: Any, spec: dict[str, Any], need: int) -> None:
        out, err = (os.path.join(self.tmp, f"{self.launched}.{e}") for e in "oe")
        self.launched += 1
        with open(out, "w") as fo, open(err, "w") as fe:
            proc = subprocess.Popen(
                [*self.command, json.dumps(spec)], stdout=fo, stderr=fe, env=self.env
            )
        self.running.append((key, need, proc, out, err, time.monotonic()))

    def finished(self) -> list[tuple[Any, dict[str, Any]]]:
        done = []
        for job in list(self.running):
            key, _, proc, out, err, t0 = job
            if proc.poll() is None and time.monotonic() - t0 < self.timeout_s:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                result = {"status": f"error: timed out after {self.timeout_s} s"}
            else:
                result = _worker_result(proc.returncode, out, err)
            self.running.remove(job)
            done.append((key, result))
        return done


def measure_peaks(
    jobs: list[tuple[Any, dict[str, Any], int]],
    command: list[str],
    *,
    pool_bytes: int | None,
    max_workers: int,
    timeout_s: float,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
) -> dict[Any, dict[str, Any]]:
    """Runs ``command + [json(spec)]`` for each ``(key, spec, need_bytes)``.

    Workers run at most ``max_workers`` at a time and, with ``pool_bytes``,
    only while the ``need_bytes`` of the running ones fit in it (a job that
    fits nowhere runs alone). None starts after ``deadline`` (a
    `time.monotonic` value). Every worker gets
    ``XLA_PYTHON_CLIENT_PREALLOCATE=false``, so it takes only what it uses.
    Returns key -> the worker's JSON line, or ``{"status": ...}``.
    """
    queue, results = list(jobs), {}
    with tempfile.TemporaryDirectory() as tmp:
        pool = _Pool(command, tmp, timeout_s)
        while queue or pool.running:
            for key, result in pool.finished():
                results[key] = result
                log(f"peak of {key}: {describe(result)}")
            if deadline is not None and time.monotonic() > deadline:
                results.update(
                    {key: {"status": "skipped: time budget"} for key, *_ in queue}
                )
                queue = []
            needs = [job[1] for job in pool.running]
            for job in [
                queue[i]
                for i in admissible(
                    [j[2] for j in queue], needs, max_workers, pool_bytes
                )
            ]:
                pool.start(*job)
                queue.remove(job)
            time.sleep(0.05)
    return results


def worker_command(script: str) -> list[str]:
    """``python script --peak-worker``: the worker's command, spec to follow."""
    return [sys.executable, script, "--peak-worker"]
