# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The test set-up: `tests.helpers.lanes.sweep` keeps the cases it names in the
fast lane, and the conftest's fast-compile flags stay in this process."""

from __future__ import annotations

import doctest
import subprocess
import sys

import pytest

from tests.helpers import lanes
from tests.helpers.lanes import sweep


def test_cases_outside_fast_are_marked_slow():
    params = sweep([(1, "a"), (2, "b"), (3, "c")], fast=[(2, "b")])
    assert [p.values for p in params] == [(1, "a"), (2, "b"), (3, "c")]
    assert [[m.name for m in p.marks] for p in params] == [["slow"], [], ["slow"]]


def test_a_param_case_keeps_its_marks_and_id():
    xfail = pytest.mark.xfail(strict=True)
    params = sweep([pytest.param("a", marks=xfail, id="A"), "b"], fast=["b"])
    assert [p.id for p in params] == ["A", None]
    assert [[m.name for m in p.marks] for p in params] == [["xfail", "slow"], []]
    kept = sweep([pytest.param("a", marks=xfail), "b"], fast=["a"])
    assert [m.name for m in kept[0].marks] == ["xfail"]


def test_a_fast_case_outside_the_sweep_is_refused():
    with pytest.raises(ValueError, match=r"fast=\[5\] are not cases"):
        sweep([1, 2], fast=[5])


def test_docstring_example():
    result = doctest.testmod(lanes)
    assert result.attempted and not result.failed


def test_subprocesses_compile_with_xla_defaults():
    # Notebooks, examples and benchmarks run in subprocesses: their outputs
    # (the docs show some) must not depend on the suite's compile flags.
    code = "import os; print(os.environ.get('XLA_FLAGS', ''))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "xla_backend_optimization_level" not in out
    assert "xla_cpu_use_fusion_emitters" not in out
