# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Cells that today's code gets wrong: one registry, predicate -> defect.

Each entry marks the cells it matches ``xfail(strict=True)``: when the fix
lands, the cell passes, the strict xfail turns into a failure, and the entry
is deleted. Labels ``"issue 20 defect N"`` are the defects of issue 20
(section 2; ``0`` is section 1, a value-and-grad ``fun``'s own gradients);
``"oracle-N"`` are disagreements the oracle found beyond them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from .cells import Cell


class Known(NamedTuple):
    label: str
    description: str
    matches: Callable[[Cell], bool]


# Empty: the defects of issue 20 and the oracle's own findings (oracle-1, a
# float64 noise scale; oracle-2, k = 1's unfolded keys; oracle-3, data_axes at
# k = 1 in the global view) are fixed, and their cells pass. A disagreement
# found later goes here, with its label, until it is fixed.
KNOWN: tuple[Known, ...] = ()


def defect(cell: Cell) -> Known | None:
    """The first registry entry that matches ``cell``, if any."""
    return next((k for k in KNOWN if k.matches(cell)), None)
