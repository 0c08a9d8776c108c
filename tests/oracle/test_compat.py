# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The docs' compatibility table renders from the declared table."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import compat, table
from .cells import FACES, MODES, Cell


@pytest.mark.slow
def test_table_lists_every_face_and_mode():
    text = compat.markdown()
    lines = text.splitlines()
    header = lines[0]
    assert all(compat.MODE_NAMES[m] in header for m in MODES)
    assert all(any(compat.FACE_NAMES[f] in line for line in lines[2:]) for f in FACES)
    assert all(line.count("|") == len(MODES) + 3 for line in lines)


def test_table_reads_the_refusals():
    assert compat.status("multisteps", "single", "none", weighted=True) == "refused"
    assert compat.status("accumulate", "data_axes", "noise") == "refused"
    assert compat.status("microbatch", "single", "noise") == "yes (k ≥ 2, mean only)"
    assert compat.status("accumulate", "single", "has_aux") == ""


def test_every_refusal_names_an_option():
    for rule in table.REFUSED:
        assert rule.names and rule.why


def test_docs_page_calls_the_generator():
    page = Path(__file__).parents[2] / "docs" / "guides" / "compatibility.md"
    assert "compat.markdown()" in page.read_text()
    index = (page.parents[1] / "index.md").read_text()
    assert "guides/compatibility" in index


def test_a_cell_is_refused_by_the_rules_that_match_it():
    cell = Cell(
        "multisteps", "axis_name", "mean", "counts", 2, "f32", "promote", "none"
    )
    assert {r.names for r in table.refusals(cell)} == {("weight",), ("axis_name",)}


def test_table_has_the_privacy_face():
    assert compat.status("privacy", "axis_name", "none") == "yes"
    assert compat.status("privacy", "single", "float0") == "refused"
    assert compat.status("privacy", "global", "none", weighted=True) == (
        "yes (padding rows)"
    )
    assert compat.status("privacy", "pmap", "none") == "yes"
    assert compat.status("privacy", "data_axes", "none") == ""
