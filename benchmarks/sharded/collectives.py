# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Collectives per update, read from a compiled program's HLO.

Those that cross the ``"data"`` mesh axis and those that do not, per call /
in the loop and at the boundary / after the loop (``tests/helpers/hlo.py``
reads the HLO).
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.helpers import hlo as _hlo


def normalized_hlo(hlo: str) -> list[str]:
    """The instructions of a compiled program, without names and metadata:
    equal lists mean the same program."""
    lines = []
    for line in hlo.splitlines():
        line = re.sub(r"metadata=\{[^}]*\}|channel_id=\d+|stack_frame_id=\d+", "", line)
        line = re.sub(r"%[\w.\-]+", "%v", line).strip()
        if line.startswith(("%v", "ROOT %v")):
            lines.append(line)
    return sorted(lines)


_COUNTS = ("data", "data_bytes", "other", "other_bytes")


def _split(mesh, found: list) -> dict:
    """Counts and bytes of collectives that cross ``"data"`` and that do not."""
    cross = [c for c in found if _hlo.crosses(c[1], mesh, "data")]
    local = [c for c in found if not _hlo.crosses(c[1], mesh, "data")]
    return {
        "data": len(cross),
        "data_bytes": sum(c[2] for c in cross),
        "other": len(local),
        "other_bytes": sum(c[2] for c in local),
        "data_ops": sorted(c[0] for c in cross),
        "other_ops": sorted(c[0] for c in local),
    }


def step_collectives(hlo: str, mesh, k: int) -> dict:
    """A k-call step: collectives per call (outside any cond) and in the
    boundary branch (the branch with the most collectives; the others run on
    hold calls)."""
    comps, _ = _hlo.computations(hlo)
    roots = _hlo.branch_roots(comps)
    in_branches = _hlo.reachable(comps, roots)
    per_call = _split(mesh, _hlo.collectives(comps, set(comps) - in_branches, 8))
    branches = sorted(
        (
            _split(mesh, _hlo.collectives(comps, _hlo.reachable(comps, [r]), 8))
            for r in roots
        ),
        key=lambda s: s["data"] + s["other"],
    )
    zero = {**dict.fromkeys(_COUNTS, 0), "data_ops": [], "other_ops": []}
    boundary = branches[-1] if branches else zero
    hold = branches[0] if len(branches) > 1 else zero
    total = {
        key: per_call[key] * k + boundary[key] + hold[key] * (k - 1) for key in _COUNTS
    }
    return {"where": "per call", "inner": per_call, "outer": boundary, "total": total}


def loop_collectives(hlo: str, mesh, k: int) -> dict:
    """A one-call step with a loop: collectives in the loop and outside it."""
    comps, _ = _hlo.computations(hlo)
    body = _hlo.reachable(comps, _hlo.while_bodies(comps))
    inner = _split(mesh, _hlo.collectives(comps, body, 8))
    outer = _split(mesh, _hlo.collectives(comps, set(comps) - body, 8))
    total = {key: inner[key] * k + outer[key] for key in _COUNTS}
    return {"where": "in loop", "inner": inner, "outer": outer, "total": total}
