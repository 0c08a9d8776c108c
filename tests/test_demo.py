# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""End-to-end tests of ``python -m optax_accum demo``."""

import re
import subprocess
import sys

import pytest

from optax_accum.__main__ import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "plots"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "optax_accum",
            "demo",
            "-k",
            "3",
            "-b",
            "8",
            "--steps",
            "25",
            "--seed",
            "1",
            "--out",
            str(out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,  # four short training runs, on 2 busy cores
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    rows = {}
    for name in ("small batch 8", "accumulate 3x8", "microbatch 3x8", "large batch 24"):
        match = re.search(rf"^{re.escape(name)}\s+(.*)$", text, re.MULTILINE)
        assert match, text
        rows[name] = match.group(1).split()
    # Columns: final loss, test acc, max |Δparam|, ms / update, temp memory.
    for name in ("accumulate 3x8", "microbatch 3x8"):
        assert float(rows[name][2]) <= 1e-4
        # Same parameters as the large batch, so the same loss to 4 decimals.
        assert rows[name][0] == rows["large batch 24"][0]
    assert rows["small batch 8"][2] == rows["large batch 24"][2] == "-"
    # The accumulate run's noise scale, early and at the end.
    noise = re.search(
        r"^Gradient noise scale B_simple \(accumulate 3x8, EMA 0.9\): (\d+) "
        r"examples after update \d+, (\d+) after update 25;",
        text,
        re.MULTILINE,
    )
    assert noise and int(noise.group(1)) > 0 and int(noise.group(2)) > 0, text
    for cells in rows.values():
        loss, acc = float(cells[0]), float(cells[1].rstrip("%"))
        assert 0 < loss < 2.4  # below chance level, ln(10) = 2.30...
        assert 10 < acc <= 100
        assert float(cells[3]) > 0
        assert cells[-1] == "KiB"
    png = out / "optax_accum_demo.png"
    assert f"Wrote the loss curves to {png}" in text
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "OK: the accumulated runs match the large batch 24 run" in text


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
        [],
        ["bench", "--quick"],  # the benchmarks moved to benchmarks/run.py
    ],
)
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage: python -m optax_accum" in capsys.readouterr().err
