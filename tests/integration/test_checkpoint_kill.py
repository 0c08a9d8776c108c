# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Checkpoints survive a SIGKILL anywhere, even inside the deletion of a step.

A child process trains with `accumulate` (saves fall mid-window) and Orbax's
``max_to_keep=2``, and is SIGKILLed: inside Orbax's deletion of an old step
(`_kill_points` pauses it there and prints a line; the test then sends a real
SIGKILL), or at random moments. A fresh process then resumes and must end bit
for bit where an uninterrupted run ends, and every step Orbax lists must
restore. The recipe tested is the code cell of ``docs/guides/checkpointing.md``
as the page shows it (``todelete_subdir``); the plain recipe is kept as a case
that shows what the same kill breaks. ``examples/multihost.py`` gets the same kill.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.slow

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "_checkpoint_worker.py"
KILL_POINTS = HERE / "_kill_points.py"
EXAMPLE = ROOT / "examples" / "multihost.py"
TIMEOUT_S = 240
COMPOSITE_ERROR = "Must provide `args` of type `Composite`"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the child sets up its own devices
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(*argv) -> str:
    """Runs ``python argv...`` to the end; its stdout, or a test failure."""
    proc = subprocess.run(
        [sys.executable, *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=_env(),
    )
    if proc.returncode:
        pytest.fail(
            f"{argv} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}",
            pytrace=False,
        )
    return proc.stdout


def _kill(argv, on_line: str, delay_s: float = 0.0) -> tuple[bool, str]:
    """Starts ``python argv...``; SIGKILLs it ``delay_s`` after it prints a
    line starting with ``on_line``, unless it has exited by then.

    Returns:
      ``(killed, output)``: whether it died of the SIGKILL, what it printed.
    """
    proc = subprocess.Popen(
        [sys.executable, *map(str, argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    )
    watchdog = threading.Timer(TIMEOUT_S, proc.kill)
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(on_line):
                time.sleep(delay_s)  # it runs on meanwhile
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
                break
        proc.wait()
    finally:
        watchdog.cancel()
        proc.stdout.close()
    return proc.returncode == -signal.SIGKILL, "".join(lines)


def _check(directory, cpu_devices: int = 1) -> dict:
    out = _run(WORKER, "check", directory, "--cpu-devices", cpu_devices)
    return json.loads(next(x for x in out.splitlines() if x.startswith("CHECK "))[6:])


def _assert_equal_npz(a, b) -> None:
    a, b = np.load(a), np.load(b)
    assert a.files == b.files
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> pathlib.Path:
    """The uninterrupted run's final state."""
    d = tmp_path_factory.mktemp("reference")
    out = _run(WORKER, "train", d / "ckpt", d / "final.npz", "--recipe", "new")
    assert "RESUMED_FROM 0 " in out and "DONE" in out
    return d / "final.npz"


@pytest.mark.parametrize(
    "recipe, when",
    [("new", "before:last"), ("new", "after:last"), ("old", "before:last")],
    ids=["todelete_subdir-before_rename", "todelete_subdir-after_rename", "plain"],
)
def test_kill_inside_the_deletion_of_an_old_step(tmp_path, reference, recipe, when):
    ckpt = tmp_path / "ckpt"
    train = [WORKER, "train", ckpt, tmp_path / "final.npz", "--recipe", recipe]
    # The first deletion: of step 1, in the save of step 6 (steps 1, 3, 6).
    killed, out = _kill([KILL_POINTS, "--pause", when, *train], "PAUSED")
    assert killed, out
    paused = next(x for x in out.splitlines() if x.startswith("PAUSED"))
    assert f"{ckpt / '1'}" in paused, paused
    state = _check(ckpt)
    if recipe == "new":
        # Step 1 is complete where it was, or renamed out of the listing.
        listed = [1, 3, 6] if when.startswith("before") else [3, 6]
        assert state["steps"] == listed, state
        assert set(state["each"].values()) == {"ok"}, state
        assert set(state["in_turn"].values()) == {"ok"}, state
    else:
        # The failure mode: step 1 is listed but has lost its item, and a
        # manager that tried it cannot restore the valid steps either.
        assert state["steps"] == [1, 3, 6], state
        assert COMPOSITE_ERROR in state["each"]["1"], state
        assert state["each"]["3"] == state["each"]["6"] == "ok", state
        assert all(COMPOSITE_ERROR in v for v in state["in_turn"].values()), state
    # Both recipes resume from the latest step, which the kill did not touch,
    # mid-window (micro-step 2 of 4), bit for bit.
    out = _run(*train)
    assert "RESUMED_FROM 6 window position 2" in out, out
    _assert_equal_npz(tmp_path / "final.npz", reference)
    after = _check(ckpt)
    assert set(after["each"].values()) == {"ok"}, after
    assert after["trash"] == [], after


def test_random_kills_resume_bit_for_bit(tmp_path, reference):
    # Killed at a random moment, twice: a random time (up to a few steps)
    # after a random micro-step, so in a step, a save, a deletion or the trash
    # clean-up; then in the resumed run; then resumed to the end.
    rng = random.Random(0)
    report = []
    for trial in range(3):
        ckpt = tmp_path / f"ckpt{trial}"
        train = [WORKER, "train", ckpt, tmp_path / f"final{trial}.npz"]
        train += ["--recipe", "new"]
        latest = 0
        for _ in range(2):
            if latest >= 20:  # a late kill let the run save its last steps
                break
            at, delay_s = rng.randint(latest + 1, 20), rng.uniform(0.0, 0.15)
            killed, _ = _kill(train, on_line=f"STEP {at}", delay_s=delay_s)
            state = _check(ckpt)
            report.append((at, round(delay_s, 3), killed, state["steps"]))
            assert set(state["each"].values()) <= {"ok"}, (report, state)
            assert set(state["in_turn"].values()) <= {"ok"}, (report, state)
            latest = max(state["steps"], default=0)
        _run(*train)
        _assert_equal_npz(tmp_path / f"final{trial}.npz", reference)
    print("random kills (after step, delay s, killed, steps left):", report)
    assert sum(killed for *_, killed, _ in report) >= 5, report


def test_example_resumes_after_a_kill_inside_a_deletion(tmp_path):
    common = ["--steps", "small", "--k", 4, "--save-every", 3, "--cpu-devices", 2]
    a = [EXAMPLE, *common, "--ckpt-dir", tmp_path / "a", "--out", tmp_path / "a.npz"]
    _run(*a)
    b = [EXAMPLE, *common, "--ckpt-dir", tmp_path / "b", "--out", tmp_path / "b.npz"]
    # Killed just before step 1 leaves the listing: a plain deletion has
    # emptied its directory by then, a rename has not touched it.
    killed, out = _kill([KILL_POINTS, "--pause", "before:last", *b], "PAUSED")
    assert killed and "PAUSED_IN_DELETE" in out, out
    state = _check(tmp_path / "b", cpu_devices=2)
    assert state["steps"] == [1, 3, 6], state
    assert set(state["each"].values()) == {"ok"}, state
    start = time.perf_counter()
    out = _run(*b)
    assert "resumed from micro-step 6 (window position 2)" in out, out
    print(f"resumed run: {time.perf_counter() - start:.1f} s")
    _assert_equal_npz(tmp_path / "a.npz", tmp_path / "b.npz")
    assert _check(tmp_path / "b", cpu_devices=2)["trash"] == []
