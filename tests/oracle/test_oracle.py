# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Every face and device mode against the float64 model (see `tests.oracle`).

A cell either equals the model at its dtype's tolerance, or is refused with a
ValueError or TypeError that names the options, as `table` declares. The fast
lane runs a seeded sample; the rest of the covering array is slow. Cells
that today's code gets wrong are strict xfails through `known`.
"""

from __future__ import annotations

import itertools

import pytest

from . import known, matrix, table
from .cells import VARIABLES
from .run import run_cell


def _params(cells, marks=()):
    out = []
    for cell in cells:
        entry = known.defect(cell)
        m = list(marks)
        if entry is not None:
            m.append(pytest.mark.xfail(strict=True, reason=entry.label))
        out.append(pytest.param(cell, id=cell.id(), marks=m))
    return out


@pytest.mark.parametrize("cell", _params(matrix.fast()))
def test_fast_sample(cell):
    run_cell(cell)


@pytest.mark.parametrize("cell", _params(matrix.slow(), [pytest.mark.slow]))
def test_covering_array(cell):
    run_cell(cell)


def test_covering_array_covers_every_pair():
    covered = set()
    for cell in matrix.covering():
        assert table.applicable(cell), cell
        covered |= matrix._pairs({v: getattr(cell, v) for v in VARIABLES})
    assert matrix.feasible_pairs() <= covered


def test_each_known_entry_matches_a_cell():
    cells = matrix.all_cells()
    for entry in known.KNOWN:
        assert any(entry.matches(c) for c in cells), entry.label


def test_explicit_cells_are_applicable():
    assert all(table.applicable(c) for c in matrix.EXPLICIT)
    assert len(set(itertools.chain(matrix.EXPLICIT))) == len(matrix.EXPLICIT)
