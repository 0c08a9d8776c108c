# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""``benchmarks/harness``: timing, statistics, tables and files of every script."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
sys.dont_write_bytecode = True  # no __pycache__ in benchmarks/

import harness  # noqa: E402


def test_ratio_is_the_median_of_per_round_ratios_with_numpys_quartiles():
    times = {"a": [1.0, 2.0, 3.0, 4.0, 10.0], "b": [2.0, 2.0, 2.0, 2.0, 2.0]}
    per_round = np.array(times["a"]) / np.array(times["b"])
    r = harness.ratio(times, "a", "b")
    assert r.median == pytest.approx(np.median(per_round))
    assert (r.q25, r.q75) == pytest.approx(tuple(np.percentile(per_round, [25, 75])))
    assert harness.ratios(times, "b")["b"] == (1.0, 1.0, 1.0)
    assert harness.ratio({"a": [3.0], "b": [2.0]}, "a", "b") == (1.5, 1.5, 1.5)


def test_interleaved_runs_each_variant_once_per_round_after_the_warmup():
    calls = []
    variants = {n: (lambda n=n: calls.append(n)) for n in ("x", "y")}
    times = harness.interleaved(variants, rounds=3, warmup=1)
    assert calls == ["x", "y"] * 4
    assert {n: len(t) for n, t in times.items()} == {"x": 3, "y": 3}


def test_timed_setup_is_not_timed():
    slow_setup = harness.Timed(run=lambda x: x + 1, setup=lambda: time.sleep(0.2) or 1)
    (t,) = harness.interleaved({"v": slow_setup}, rounds=1, warmup=0)["v"]
    assert t < 0.1


def test_table_renders_rows_and_checks_the_alignment():
    lines = harness.table(["a", "b"], [[1, "x"], "| whole line |"], "lr")
    assert lines == ["| a | b |", "|---|---:|", "| 1 | x |", "| whole line |"]
    with pytest.raises(ValueError, match="`align` 'l'"):
        harness.table(["a", "b"], [], "l")


def test_script_main_writes_markdown_and_json_with_command_and_versions(
    tmp_path, capsys
):
    def measure(quick, rounds, extra):
        return {"rows": [{"quick": quick, "rounds": rounds, "extra": extra}]}

    def markdown(data):
        return "\n".join(harness.table(["quick"], [[data["rows"][0]["quick"]]], "l"))

    argv = ["--quick", "--rounds", "2", "--extra", "7", "--out", str(tmp_path)]
    add = lambda p: p.add_argument("--extra", type=int)
    assert harness.script_main("demo", "demo", measure, markdown, argv, add) == 0
    assert "| True |" in capsys.readouterr().out
    assert (tmp_path / "demo.md").read_text() == "| quick |\n|---|\n| True |\n"
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["rows"] == [{"quick": True, "rounds": 2, "extra": 7}]
    assert data["command"].startswith("python ")
    assert {"jax", "optax", "device", "backend", "date"} <= set(data["environment"])
    with pytest.raises(SystemExit):
        harness.script_main("demo", "demo", measure, markdown, ["--rounds", "0"])
