# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The privacy wing is part of the package and needs only jax and optax:
``import optax_accum`` (and ``optax_accum.privacy``) imports neither
``dp_accounting`` nor ``jax_privacy``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_import_pulls_in_no_privacy_library():
    code = (
        "import sys, optax_accum, optax_accum.privacy\n"
        "from optax_accum import privacy\n"
        "assert optax_accum.privacy is privacy\n"
        "print(sorted(m for m in ('dp_accounting', 'jax_privacy') "
        "if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": ""},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
