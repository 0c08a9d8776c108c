# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""``benchmarks/bench_transformer.py``.

A smoke run of the transformer benchmark on a tiny model: it checks what the
benchmark reports (memory relations that hold at any size, the plans, the
files), never how fast anything was. No test needs an accelerator. The runner
(``benchmarks/run.py``) is tested in ``tests/integration/``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("flax")

ROOT = Path(__file__).resolve().parents[2]


BENCHMARKS = ROOT / "benchmarks"


def _load_bench():
    if str(BENCHMARKS) not in sys.path:  # its harness and transformer/
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(
        "_bench_transformer", BENCHMARKS / "bench_transformer.py"
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
    assert md.count("\n|---") >= 4  # the grid, anchors, targets, plans
    stored = json.loads((tmp_path / "transformer_cpu.json").read_text())
    assert {k: stored[k] for k in data} == json.loads(json.dumps(data))
    assert stored["command"].startswith("python ")
    assert stored["environment"]["jax"] == data["jax"]


def test_largest_batch_from_two_compiled_estimates():
    _load_bench()
    from transformer import largest_batch as bt

    # 100 bytes fixed, 10 per sequence: 995 bytes fit 89 sequences, 88 in 8s.
    points = [(8, 180), (2, 120), (4, 140)]
    assert bt.largest_batch(points, 995, multiple=8, max_batch=512) == 88
    assert bt.largest_batch(points, 995, multiple=1, max_batch=512) == 89
    assert bt.largest_batch(points, 995, multiple=8, max_batch=50) == 48
    assert bt.largest_batch(points, 150, multiple=8, max_batch=512) == 0
    with pytest.raises(ValueError, match="does not grow"):
        bt.largest_batch([(2, 100), (4, 100)], 995, multiple=1, max_batch=8)


def test_planner_returns_the_plan_or_the_error():
    import jax
    import jax.numpy as jnp

    _load_bench()
    from transformer.largest_batch import planner

    def step(w, x):
        return jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)

    w = jnp.zeros((16, 32))
    plan = planner(step, w, None, jnp.zeros(16), 64, 40_000, 64)
    assert plan["microbatch_size"] >= 1
    assert plan["memory_bytes"] <= 40_000
    assert "error" in planner(step, w, None, jnp.zeros(16), 64, 10, 64)


def test_peak_workers_start_first_fit_within_the_pool():
    _load_bench()
    from harness.peaks import admissible

    assert admissible([50, 30, 20], [60], 4, 100) == [1]
    assert admissible([50, 30, 20], [], 4, 100) == [0, 1, 2]
    assert admissible([50, 30, 20], [], 2, 100) == [0, 1]
    assert admissible([150, 10], [], 4, 100) == [0]  # alone, whatever its size
    assert admissible([150, 10], [], 4, None) == [0, 1]
    assert admissible([10], [1, 1], 2, None) == []
