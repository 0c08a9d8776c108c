# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""``python -m optax_accum demo`` without the `examples` extra.

Each package the demo needs beyond jax and optax is made unimportable in turn;
the demo must then print one line naming the install command and exit with
status 2 before it trains anything (no table, no plot). A real run in a fresh
interpreter is in ``tests/integration/test_demo.py``.
"""

import importlib.util

import pytest

from optax_accum import _demo
from optax_accum.__main__ import main

HINT = (
    'pip install "optax_accum[examples]", or from a source checkout, in its '
    'root folder: pip install -e ".[examples]"'
)


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
