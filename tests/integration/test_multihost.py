# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Real multi-process runs: 2 JAX processes x 2 CPU devices on 127.0.0.1, gloo.

The processes are started, reaped and, past their time limits, killed by
`optax_accum.distributed.launch_local`; their output is shown when a test fails. One
launch of `_multihost_worker.py` covers `accumulate` in shard_map,
`microbatch` under jit and the Flax nnx step. `examples/multihost.py` runs in
its `--local-processes` mode three times: uninterrupted, with one process
killed mid-window, and restarted from the last (mid-window) Orbax checkpoint.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import optax_accum
import optax_accum.distributed

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(__file__).with_name("_multihost_worker.py")
EXAMPLE = ROOT / "examples" / "multihost.py"
FAILURE_TIMEOUT_S = 5  # --failure-timeout of the crash run


def _launch(argv, **kwargs) -> optax_accum.distributed.LocalRun:
    kwargs.setdefault("timeout_s", 120)
    kwargs.setdefault("grace_s", 30)
    return optax_accum.distributed.launch_local(
        [sys.executable, *map(str, argv)], 2, echo=False, **kwargs
    )


def _check(run: optax_accum.distributed.LocalRun) -> None:
    if not run.ok:
        pytest.fail(f"a worker failed:\n{run.report()}", pytrace=False)


def test_two_processes_reach_the_full_batch_result(tmp_path):
    run = _launch([WORKER, tmp_path])
    _check(run)
    counts = next(
        json.loads(line.split(" ", 1)[1])
        for line in run.outputs[0].splitlines()
        if line.startswith("ALL_REDUCES ")
    )
    print("all-reduces per compiled call:", counts)
    for pid in range(2):
        out = np.load(tmp_path / f"process_{pid}.npz")
        for name in (
            "accumulate",
            "microbatch",
            "nnx",
            "hsdp_microbatch",
            "hsdp_accumulate",
        ):
            for key in ("w1", "b1", "w2", "b2"):
                np.testing.assert_allclose(
                    out[f"{name}/{key}"],
                    out[f"reference/{key}"],
                    rtol=1e-5,
                    atol=1e-6,
                    err_msg=f"process {pid}, {name}, {key}",
                )
    first, second = (np.load(tmp_path / f"process_{i}.npz") for i in range(2))
    for key in first.files:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    # accumulate: one all-reduce, in the boundary branch only; MultiSteps with a
    # pmean: one on every micro-step; microbatch: one per update, after the loop.
    acc, ms = counts["accumulate"], counts["multisteps_pmean"]
    assert (acc["every_call"], acc["in_cond"], acc["in_loop"]) == (0, 1, 0)
    assert ms["every_call"] >= 1 and ms["in_cond"] == 0
    assert counts["microbatch"]["in_loop"] == 0
    assert counts["microbatch"]["every_call"] >= 1
    # HSDP (data across the processes, FSDP within): microbatch crosses the
    # data axis once per update, after the loop; accumulate's global-view
    # jax.grad crosses it on every micro-step (docs/guides/many_processes.md).
    hsdp_mb, hsdp_acc = counts["hsdp_microbatch"], counts["hsdp_accumulate"]
    assert hsdp_mb["in_loop"] == 0 and hsdp_mb["every_call"] >= 1, hsdp_mb
    assert hsdp_acc["every_call"] >= 1, hsdp_acc


def _example(*args) -> str:
    """Runs the example in its own ``--local-processes 2`` mode; its output."""
    argv = [sys.executable, EXAMPLE, "--local-processes", 2, "--launch-timeout", 90]
    proc = subprocess.run(
        [*map(str, argv), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=150,  # backstop: the launcher kills its processes at 90 s
    )
    if proc.returncode:
        pytest.fail(f"the example failed:\n{proc.stdout}\n{proc.stderr}", pytrace=False)
    return proc.stdout


def test_example_survives_a_killed_worker_and_resumes_bit_for_bit(tmp_path):
    common = ["--steps", "small", "--k", 4, "--save-every", 3]
    out = _example(*common, "--ckpt-dir", tmp_path / "a", "--out", tmp_path / "a.npz")
    assert "[0] update 4:" in out and "[1] " in out

    # Process 1 dies right after micro-step 7; the last checkpoint is micro-step
    # 6, in the middle of the second window. Process 0 must fail on its own.
    ckpt = tmp_path / "b"
    fault = ["--crash-at", 7, "--failure-timeout", FAILURE_TIMEOUT_S]
    argv = [EXAMPLE, *common, "--ckpt-dir", ckpt, *fault]
    crash = optax_accum.distributed.launch_local(
        [sys.executable, *map(str, argv)],
        2,
        cpu_devices_per_process=2,
        timeout_s=90,
        grace_s=30,
        echo=False,
    )
    report = crash.report()
    assert crash.returncodes[1] == -9, report
    assert crash.returncodes[0] != 0, report
    assert 0 not in crash.killed, f"process 0 hung until killed:\n{report}"
    waited = crash.exit_times[0] - crash.exit_times[1]
    assert waited < FAILURE_TIMEOUT_S + 15, f"process 0 took {waited:.1f} s:\n{report}"
    assert (
        "Another process has probably died" in crash.outputs[0]
        or "JAX distributed service detected fatal errors" in crash.outputs[0]
    ), report
    print(f"process 0 failed {waited:.1f} s after process 1 was killed")

    out = _example(*common, "--ckpt-dir", ckpt, "--out", tmp_path / "b.npz")
    assert "resumed from micro-step 6 (window position 2)" in out, out
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
