# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""examples/fsdp.py: each layout trains to the single-device full batch."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "fsdp.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize(
    "args",
    [
        ("--layout", "dp"),
        ("--layout", "fsdp"),
        ("--layout", "tp"),
        ("--layout", "hsdp"),
        ("--layout", "hsdp", "--defer"),
        ("--layout", "tp", "--face", "microbatch"),
        ("--layout", "fsdp", "--face", "microbatch"),
    ],
    ids=" ".join,
)
def test_example_matches_one_device_with_buffers_sharded_like_params(args):
    out = _run(*args)
    assert out.returncode == 0, out.stdout + out.stderr
    diff = float(re.search(r"max abs difference.*: (\S+)", out.stdout).group(1))
    assert diff < 1e-6
    rows = re.findall(r"^(w1|b1|w2)\s+(P\(.*?\))\s+(P\(.*?\))\s+(\d+) / (\d+)$",
                      out.stdout, re.M)  # fmt: skip
    assert len(rows) == 3, out.stdout
    for _, p_spec, b_spec, p_bytes, b_bytes in rows:
        assert p_bytes == b_bytes  # per device: never replicated
        # The same partitions (deferred accumulators add unreduced={'data'}).
        assert b_spec.split(", unreduced")[0].rstrip("),") == p_spec.rstrip("),")
        if "--defer" in args:
            assert "unreduced={'data'}" in b_spec


def test_defer_without_a_pure_data_axis_is_refused():
    out = _run("--layout", "fsdp", "--defer")
    assert out.returncode == 2
    assert "--defer" in out.stderr


def test_a_wrong_result_exits_non_zero(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("fsdp_example", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    right = example.reference

    def off_by_a_little(params, xs, ys):  # 1e-4 relative: above the 1e-5 limit
        return {n: np.asarray(v) * (1 + 1e-4) for n, v in right(params, xs, ys).items()}

    # conftest already gives 8 CPU devices: --devices 0 keeps them.
    argv = ["--devices", "0", "--layout", "dp", "--updates", "1"]
    assert example.main(argv) == 0
    monkeypatch.setattr(example, "reference", off_by_a_little)
    assert example.main(argv) == 1
    assert "limit 1e-5" in capsys.readouterr().out
