# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""``python benchmarks/run.py --device --smoke``: the device run's code, on the CPU.

The device run is meant for one accelerator run; the smoke run takes the
same code paths on a tiny config, so that the command keeps working: every
section runs, writes its rows to the Markdown and the JSON, and every number
is finite.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RUN_PY = ROOT / "benchmarks" / "run.py"
SECTIONS = [
    "accumulate",
    "microbatch",
    "memory_map",
    "time_per_token",
    "overhead",
    "offload",
    "pipeline",
]
# Per section: what every row must have, not None.
REQUIRED = {
    "accumulate": ["time_per_update_s", "time_vs_optax_multisteps"],
    "microbatch": ["time_per_update_s", "time_vs_fused", "temp_bytes", "peak_bytes"],
    "memory_map": ["compiled_peak_bytes", "compiled_temp_bytes", "state_bytes"],
    "time_per_token": [
        "seconds_per_update",
        "us_per_token",
        "tokens_per_s",
        "time_vs_plain",
        "compiled_peak_bytes",
    ],
    "overhead": ["seconds_per_update", "us_per_token", "time_vs_plain"],
    "offload": [
        "device_bytes",
        "device_bytes_offload",
        "saved_bytes_per_param",
        "time_vs_no_offload",
    ],
    "pipeline": ["time_vs_plain", "temp_bytes", "plain_temp_bytes", "peak_bytes"],
}


def _smoke_config() -> dict:
    spec = importlib.util.spec_from_file_location("_bench_run", RUN_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SMOKE


def _numbers(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _numbers(v)
    elif isinstance(x, list):
        for v in x:
            yield from _numbers(v)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield x


def _run(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run(
        [sys.executable, str(RUN_PY), "--device", "--smoke", *extra],
        capture_output=True,
        text=True,
        timeout=600,  # about a minute alone; the machine is shared
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "out" / "cpu_smoke.json").read_text())
    return proc, data


def test_device_smoke_writes_every_row(tmp_path):
    proc, data = _run(tmp_path, "--out", str(tmp_path / "out"))
    md = (tmp_path / "out" / "cpu_smoke.md").read_text()
    assert md.startswith("## Benchmarks on cpu (cpu, 1 device(s))")
    assert data["smoke"] is True and data["backend"] == "cpu"
    assert [s["name"] for s in data["sections"]] == SECTIONS
    cfg = _smoke_config()
    for section in data["sections"]:
        name, rows = section["name"], section["data"]["rows"]
        assert section["status"] == "ok", section
        assert f"### {section['title']}\n" in md
        assert f"| {name} | ok |" in md  # the summary table
        for row in rows:
            assert row.get("status", "ok") == "ok", (name, row)
            for key in REQUIRED[name]:
                assert row[key] is not None, (name, key, row)
        numbers = list(_numbers(section["data"]))
        assert numbers and all(math.isfinite(n) for n in numbers), name
        assert section["data"]["compilations"] >= 1

    by = {s["name"]: s["data"] for s in data["sections"]}
    assert len(by["accumulate"]["rows"]) == 5  # 4 steps and the floor
    assert len(by["microbatch"]["rows"]) == 6
    mm = cfg["memory_map"]["args"]
    assert len(by["memory_map"]["rows"]) == (
        len(mm["remats"]) * len(mm["dtypes"]) * len(mm["ks"])
    )
    for row in by["memory_map"]["rows"]:  # the CPU reports no memory_stats
        assert by["memory_map"]["memory_stats_available"] is False
        assert row["measured_peak_bytes"] is None and row["worker_seconds"] > 0
    tt = cfg["time_per_token"]["args"]
    assert len(by["time_per_token"]["rows"]) == len(tt["remats"]) + 2
    oh = by["overhead"]
    assert [r["step"] for r in oh["rows"]] == ["full", "microbatch", "accumulate"]
    assert oh["batch"] >= cfg["overhead"]["args"]["multiple"]
    assert oh["rows"][0]["compiled_peak_bytes"] <= oh["budget_bytes"]
    assert oh["largest_checked"] is True
    assert oh["next_batch_peak_bytes"] > oh["budget_bytes"]
    assert {r["tokens_per_update"] for r in oh["rows"]} == {
        oh["batch"] * oh["model"]["config"]["seq_len"]
    }
    assert "] memory_map: ok in" in proc.stdout  # timestamped progress
    _check_offload(by["offload"], cfg["offload"]["args"], md)


def _check_offload(data: dict, args: dict, md: str) -> None:
    """Both forms at each k; on the CPU the note says memory is shared."""
    rows = data["rows"]
    assert [(r["form"], r["k"]) for r in rows] == [
        (form, k) for form in ("microbatch", "accumulate") for k in args["ks"]
    ]
    assert data["host_split"] is False
    assert "host and device share memory there" in md
    for r in rows:  # AdamW's mu and nu (8 bytes per parameter) leave the device
        assert r["device_bytes_offload"] < r["device_bytes"]
        assert r["saved_bytes_per_param"] >= 8 - 0.5, r


def test_device_run_stops_when_the_budget_is_spent(tmp_path):
    _, data = _run(tmp_path, "--budget-s", "0.5", "--out", str(tmp_path / "out"))
    md = (tmp_path / "out" / "cpu_smoke.md").read_text()
    for section in data["sections"]:
        assert section["status"].startswith("not run: the time budget of 0.5 s")
        assert section["data"] is None
    assert md.count("Not run: the time budget") == len(SECTIONS)
    assert "not started for lack of time: " + ", ".join(SECTIONS) in md
