# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""A script's `measure` in a process of its own, for the data it writes.

Multi-device benchmarks need 8 CPU devices, which a process can only ask
for before JAX starts; `benchmarks/run.py` loads every script into one
process. Such a script reruns itself here with ``--json PATH`` and reads the
data back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any


def needs_cpu_devices(count: int) -> bool:
    """Whether this process is on the CPU with fewer than ``count`` devices."""
    import jax

    return jax.default_backend() == "cpu" and jax.device_count() < count


def json_of_script(script: str, argv: list[str]) -> Any:
    """Runs ``python script *argv --json PATH`` and returns PATH's JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "data.json")
        proc = subprocess.run(
            [sys.executable, script, *argv, "--json", path],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            raise RuntimeError(
                f"{os.path.basename(script)} failed in a subprocess "
                f"(status {proc.returncode}):\n{proc.stderr[-4000:]}"
            )
        with open(path) as f:
            return json.load(f)
