# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""``python -m optax_accum``: bad arguments exit with usage; the demo's verdict."""

import subprocess
import sys

import pytest

from optax_accum.__main__ import main


@pytest.mark.parametrize(
    ("diffs", "failing"),
    [
        ((3e-7, 1e-4), None),
        ((3e-7, 1.1e-4), "microbatch 4x8"),
        ((float("nan"), 0.0), "accumulate 4x8"),
    ],
)
def test_demo_verdict(diffs, failing, capsys):
    from optax_accum._demo import RunResult, _verdict

    runs = [
        RunResult(name, None, max_param_diff=d)
        for name, d in zip(("accumulate 4x8", "microbatch 4x8"), diffs, strict=True)
    ]
    status = _verdict(runs, "large batch 32", tolerance=1e-4)
    out = capsys.readouterr().out
    if failing is None:
        assert status == 0
        assert out.startswith("OK: the accumulated runs match the large batch 32")
    else:
        assert status == 1
        assert out.startswith(f"FAIL: {failing} (")
        assert out.count(" 4x8 (") == 1
        assert "than 0.0001" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "-k", "0"],
        ["demo", "-b", "x"],
        ["demo", "--steps", "-3"],
        ["demo", "--seed", "-1"],
        ["demo", "--lr", "-1"],
        ["demo", "--lr", "nan"],
        ["demo", "--lr", "0"],
        ["demo", "--lr", "inf"],
        ["demo", "--lr", "fast"],
        ["demo", "--tolerance", "-1"],
        ["demo", "--tolerance", "nan"],
        [],
        ["bench", "--quick"],  # the benchmarks moved to benchmarks/run.py
    ],
)
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage: python -m optax_accum" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lr", "-1"], "argument --lr: expected a finite number > 0, got '-1'"),
        (["--lr", "nan"], "argument --lr: expected a finite number > 0, got 'nan'"),
        (
            ["--tolerance", "-1"],
            "argument --tolerance: expected a finite number >= 0, got '-1'",
        ),
    ],
)
def test_bad_values_end_in_one_line(argv, message, capsys):
    # Issue 23: --lr -1 and nan ended in a traceback with exit 1 (the code for
    # "the runs differ"), and --tolerance -1 was accepted and always failed.
    with pytest.raises(SystemExit) as info:
        main(["demo", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"python -m optax_accum demo: error: {message}"
    assert not any("Traceback" in line for line in err)


@pytest.mark.slow
def test_bad_value_in_a_subprocess_exits_2_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "optax_accum", "demo", "--lr", "nan"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("got 'nan'")


def test_edge_values_parse(monkeypatch):
    import optax_accum._demo as demo

    seen = {}
    monkeypatch.setattr(demo, "missing_requirements", lambda: [])
    monkeypatch.setattr(demo, "run_demo", lambda **kw: seen.update(kw) or 0)
    argv = ["demo", "-k", "1", "--steps", "1", "--lr", "1e-9", "--tolerance", "0"]
    assert main(argv) == 0
    assert (seen["k"], seen["steps"], seen["learning_rate"]) == (1, 1, 1e-9)
    assert seen["tolerance"] == 0.0


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5, 6, 10, 200])
def test_noise_scale_is_read_at_most_twice_within_the_run(steps):
    from optax_accum._demo import _noise_reads

    reads = _noise_reads(steps)
    assert reads[-1] == steps - 1 and reads[0] >= 0
    assert len(reads) == (1 if steps <= 5 else 2)


def test_noise_line_for_zero_one_and_two_readings():
    from optax_accum._demo import RunResult, _noise_line

    # Issue 23: --steps 1..5 gave one reading and crashed in unpacking it.
    one = _noise_line(RunResult("accumulate 4x8", None, noise=[(2, 41.6)]), 32)
    assert one.startswith(
        "Gradient noise scale B_simple (accumulate 4x8, EMA 0.9): 42 examples "
        "after update 3; the batch is 32."
    )
    two = _noise_line(RunResult("a", None, noise=[(4, 10.0), (9, 30.0)]), 8)
    assert ": 10 examples after update 5, 30 after update 10; the batch" in two
    # -k 1 printed "B_simple nan examples": a window of one measures nothing.
    none = _noise_line(RunResult("accumulate 1x8", None), 8)
    assert "not measured" in none and "nan" not in none


@pytest.mark.slow
@pytest.mark.parametrize(("k", "steps"), [(1, 1), (2, 5)])
def test_small_runs_finish(k, steps, tmp_path, capsys):
    argv = ["demo", "-k", str(k), "-b", "4", "--steps", str(steps)]
    status = main([*argv, "--no-progress", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "nan" not in out.lower()
    assert ("not measured" in out) == (k == 1)
