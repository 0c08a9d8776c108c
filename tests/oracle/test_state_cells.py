# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The faces that hold state, wherever the state arrives (`state_cells`)."""

from __future__ import annotations

import pytest

from . import state_cells
from .adapt_state import run


@pytest.mark.parametrize("cell", state_cells.FAST, ids=lambda c: c.id())
def test_fast_sample(cell):
    run(cell)


@pytest.mark.slow
@pytest.mark.parametrize("cell", state_cells.slow(), ids=lambda c: c.id())
def test_covering_array(cell):
    run(cell)


def test_covering_array_covers_every_pair():
    covered = set()
    for cell in state_cells.covering():
        row = {v: getattr(cell, v) for v in state_cells.VARIABLES}
        assert state_cells.applicable(row), cell
        covered |= state_cells._pairs(row)
    assert state_cells.feasible_pairs() <= covered
    assert set(state_cells.FAST) <= set(state_cells.covering()) | set(state_cells.FAST)
