# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""``benchmarks/bench_transformer.py`` and ``python -m optax_accum bench --full``.

A smoke run of the transformer benchmark on a tiny model: it checks what the
benchmark reports (memory relations that hold at any size, the plans, the
files), never how fast anything was. No test needs an accelerator.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

from optax_accum.__main__ import main, parse_tables

pytest.importorskip("flax")

ROOT = Path(__file__).resolve().parents[2]


def _load_bench():
    spec = importlib.util.spec_from_file_location(
        "_bench_transformer", ROOT / "benchmarks" / "bench_transformer.py"
    )
    module = importlib.util.module_from_spec(spec)
    write_bytecode = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # no __pycache__ in benchmarks/
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = write_bytecode
    return module


def test_sizes_follow_the_backend():
    bt = _load_bench()
    assert bt.sizes_for(False, "cpu")["preset"] == "cpu_small"
    assert bt.sizes_for(False, "gpu")["preset"] == "gpt2_small"
    assert bt.sizes_for(False, "tpu")["preset"] == "gpt2_small"
    assert bt.sizes_for(True, "gpu")["preset"] == "tiny"
    for sizes in bt.SIZES.values():  # every timed k has its full-batch anchor
        assert set(sizes["target_ks"]) <= set(sizes["ks"]) & set(sizes["acc_ks"])
        assert all(sizes["sweep_batch"] % m == 0 for m in sizes["sweep_micros"])


def test_tiny_run_reports_and_writes(tmp_path):
    bt = _load_bench()
    sizes = dict(
        bt.SIZES["quick"],
        combos=(bt.ANCHOR,),
        ks=(2, 4),
        ks_other=(2, 4),
        acc_ks=(2,),
        target_ks=(2,),
        rounds=1,
        plan_target=8,
        plan_max=8,
        budget=3 * bt.MiB,
        sweep_micros=(),
    )
    data = bt.measure(sizes=sizes, log=lambda _: None)
    grid = {(r["mode"], r["k"]): r for r in data["grid"]}
    # The fused step's peak does not grow with k at a fixed micro-batch; the
    # full batch's does.
    assert grid["microbatch", 4]["memory"]["peak"] <= (
        1.1 * grid["microbatch", 2]["memory"]["peak"]
    )
    full = {r["effective_batch"]: r for r in data["anchors"] if r["mode"] == "full"}
    assert full[8]["memory"]["peak"] > full[4]["memory"]["peak"]
    # accumulate's state: params, AdamW's two moments, one float32 accumulator.
    acc = grid["accumulate", 2]["memory"]
    assert acc["state"] == pytest.approx(4 * data["model"]["param_bytes"], rel=1e-3)
    (target,) = data["targets"]
    assert target["accumulate_vs_multisteps_temp"] <= 1.0
    assert target["fused_vs_scan_time"] > 0
    # The plan fits the budget, and its next size up does not.
    (plan,) = (p["plan"] for p in data["plans"])
    assert plan["memory_bytes"] <= data["budget"]
    assert (
        plan["next_memory_bytes"] is None
        or plan["next_memory_bytes"] > (data["budget"])
    )
    json.dumps(data)  # JSON-able

    paths = bt.write(data, tmp_path)
    assert sorted(p.name for p in paths) == sorted(
        ["transformer_cpu.md", "transformer_cpu.json", "transformer_cpu.png"]
    )
    assert all(p.stat().st_size > 0 for p in paths)
    md = (tmp_path / "transformer_cpu.md").read_text()
    assert "| none | f32 | `microbatch` |" in md
    assert len(parse_tables(md)) >= 4
    stored = json.loads((tmp_path / "transformer_cpu.json").read_text())
    assert stored == json.loads(json.dumps(data))


def test_parse_tables():
    text = "intro\n\n| a | b |\n|---|--:|\n| 1 | 2 |\n| 3 | 4 |\ntext\n| x |\n"
    assert parse_tables(text) == [[{"a": "1", "b": "2"}, {"a": "3", "b": "4"}]]


def test_bench_full_writes_one_markdown_and_one_json(tmp_path, capsys):
    bench_dir = tmp_path / "benchmarks"
    bench_dir.mkdir()
    (bench_dir / "bench_a_table.py").write_text(
        "def run(quick):\n    return f'| q |\\n|---|\\n| {quick} |'\n"
    )
    (bench_dir / "bench_b_data.py").write_text(
        textwrap.dedent("""
        def run(quick):
            raise AssertionError("bench --full calls run_full")

        def run_full(quick, out_dir):
            (out_dir / "b_plot.png").write_bytes(b"png")
            return "| n |\\n|---|\\n| 7 |", {"n": 7, "quick": quick}
        """)
    )
    status = main(["bench", "--full", "--benchmarks-dir", str(bench_dir)])
    assert status == 0
    results = bench_dir / "results"
    (md_path,) = results.glob("bench_*.md")
    assert md_path.name == "bench_cpu.md"  # the device's name
    assert (results / "b_plot.png").is_file()
    md = md_path.read_text()
    assert md.startswith("## Benchmarks on cpu (cpu, 8 device(s))")
    assert "### bench_a_table\n\n| q |\n|---|\n| False |" in md
    data = json.loads(md_path.with_suffix(".json").read_text())
    assert data["backend"] == "cpu" and data["device"] == "cpu"
    assert data["benchmarks"]["bench_a_table"]["tables"] == [[{"q": "False"}]]
    assert data["benchmarks"]["bench_b_data"] == {"n": 7, "quick": False}
    assert "Wrote" in capsys.readouterr().out

    out = tmp_path / "elsewhere" / "report.md"
    argv = ["bench", "--full", "--quick", "--benchmarks-dir", str(bench_dir)]
    assert main([*argv, "--out", str(out)]) == 0
    assert "| True |" in out.read_text()
    assert json.loads(out.with_suffix(".json").read_text())["benchmarks"]
