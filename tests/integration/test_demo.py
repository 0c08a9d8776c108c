# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""``python -m optax_accum demo`` end to end, in a subprocess."""

import re
import subprocess
import sys

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
    # Columns: train loss, test acc, max |Δparam|, ms / update, temp memory.
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
    # The table and the plot say "train loss", each with what it averages.
    assert "train loss: the mean over the whole training set" in text


HINT = (  # by name, and from a source checkout (optax_accum._extras)
    'pip install "optax_accum[examples]", or from a source checkout, in its '
    'root folder: pip install -e ".[examples]"'
)
# Blocks one module as a fresh interpreter starts: `sys.modules[name] = None`
# makes `import name` raise ImportError and `find_spec(name)` return None.
RUN_WITHOUT = """
import runpy, sys
sys.modules[sys.argv.pop(1)] = None
sys.argv[0] = "optax_accum"
runpy.run_module("optax_accum", run_name="__main__", alter_sys=True)
"""


def test_exit_status_of_a_real_run_without_sklearn(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT, "sklearn", "demo", "--out", "plots"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "scikit-learn" in lines[0] and lines[0].endswith(HINT), lines[0]
    assert list(tmp_path.iterdir()) == []  # no plot folder: nothing ran
