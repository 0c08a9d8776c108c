# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""``python -m optax_accum demo`` without the `examples` extra.

Each package the demo needs beyond jax and optax is made unimportable in turn;
the demo must then print one line naming the install command and exit with
status 2 before it trains anything (no table, no plot).
"""

import importlib.util
import subprocess
import sys

import pytest

from optax_accum import _demo
from optax_accum.__main__ import main

HINT = 'pip install "optax_accum[examples]"'
# Blocks one module as a fresh interpreter starts: `sys.modules[name] = None`
# makes `import name` raise ImportError and `find_spec(name)` return None.
RUN_WITHOUT = """
import runpy, sys
sys.modules[sys.argv.pop(1)] = None
sys.argv[0] = "optax_accum"
runpy.run_module("optax_accum", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(("module", "package"), list(_demo.REQUIREMENTS.items()))
def test_missing_package_is_one_line_and_status_2(
    module, package, monkeypatch, capsys, tmp_path
):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == module or name.startswith(f"{module}."):
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(_demo, "run_demo", _no_training)
    status = main(["demo", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert status == 2
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert package in err and err.rstrip().endswith(HINT), err
    assert list(tmp_path.iterdir()) == []


def _no_training(**kwargs):
    raise AssertionError("the demo started training without its requirements")


def test_nothing_missing_here():
    # The suite runs with the `dev` extra, which includes `examples`.
    assert _demo.missing_requirements() == []


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
