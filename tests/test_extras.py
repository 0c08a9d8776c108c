# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""A missing extra is named with a command that installs it both ways: by
name from an index, and from a source checkout (issue 41)."""

from __future__ import annotations

import subprocess
import sys

import pytest

BY_NAME = 'pip install "optax_accum[{}]"'
FROM_CHECKOUT = 'pip install -e ".[{}]"'


def _both(message: str, extra: str) -> None:
    assert BY_NAME.format(extra) in message, message
    assert FROM_CHECKOUT.format(extra) in message, message


def test_privacy_accounting_without_dp_accounting(monkeypatch):
    from optax_accum.privacy import _accounting

    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # import fails
    with pytest.raises(ImportError, match="`privacy` extra") as info:
        _accounting._dp_accounting()
    _both(str(info.value), "privacy")


def test_flax_submodule_without_flax():
    code = (
        "import sys; sys.modules['flax'] = None\n"
        "try:\n"
        "    import optax_accum.flax\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "optax_accum.flax needs Flax, in the `flax` extra" in out
    _both(out, "flax")


def test_demo_hint():
    from optax_accum import _demo

    _both(_demo.INSTALL_HINT, "examples")
