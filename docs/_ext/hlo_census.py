# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Where a compiled step's all-reduces are, for the guides to print and assert.

A guide calls `all_reduces` on ``compiled.as_text()`` instead of parsing HLO
in its own cells. The parsing is the tests' (``tests/helpers/hlo.py``), so a
page and the tests read HLO one way. Pages run in a temporary folder: they put
this folder on ``sys.path`` from ``optax_accum.__file__`` (a source checkout).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from tests.helpers import hlo as _hlo  # noqa: E402


def all_reduces(hlo_text: str) -> tuple[int, int]:
    """All-reduces in a compiled program: ``(in_branches, elsewhere)``.

    ``in_branches`` counts those in the computations that a ``conditional``'s
    branches reach (for `accumulate`, the boundary branch), ``elsewhere`` the
    rest: what every call runs.
    """
    comps, _ = _hlo.computations(hlo_text)
    branches = _hlo.reachable(comps, _hlo.branch_roots(comps))
    return _hlo.count(comps, branches), _hlo.count(comps, set(comps) - branches)
