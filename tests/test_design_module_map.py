# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""design.md's module map names every module of every wing, and no other.

The guide's executed cell makes the same check in the docs build, which runs
after the tests; this test catches a new module in the fast lane instead (a
module added without its row failed two CI runs at the docs stage).
"""

from __future__ import annotations

import ast
import pkgutil
import re
from pathlib import Path

import optax_accum

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "guides" / "design.md"
ROOT = Path(optax_accum.__file__).parent


def _tables() -> dict[str, set[str]]:
    """The modules in the first column of each wing's table, by wing."""
    tables: dict[str, set[str]] = {}
    wing = None
    for line in DESIGN.read_text().splitlines():
        if line.startswith("**The core**"):
            wing = ""
        elif heading := re.match(r"^\*\*`(\w+)/`\*\*", line):
            wing = heading.group(1)
        elif line.startswith("#"):
            wing = None
        elif wing is not None and (row := re.match(r"^\| `(\w+)` \|", line)):
            tables.setdefault(wing, set()).add(row.group(1))
    return tables


def _cell_map() -> dict[str, set[str]]:
    """The ``mapped`` dict of the guide's executed check."""
    text = DESIGN.read_text()
    start = text.index("mapped = {")
    end = text.index("\n}\n", start) + 2
    return ast.literal_eval(text[start + len("mapped = ") : end])


def _found(wing: str) -> set[str]:
    return {m.name for m in pkgutil.iter_modules([str(ROOT / wing)])}


def test_every_wing_table_lists_exactly_its_modules():
    tables = _tables()
    assert set(tables) == set(_cell_map())
    for wing, names in tables.items():
        # The root table also has rows for __init__ and the wings' folders.
        found = _found(wing) | ({"__init__"} if not wing else set())
        wings = {w for w in tables if w} if not wing else set()
        assert names - wings == found - wings, (wing or "optax_accum", names ^ found)


def test_the_executed_check_maps_every_module():
    for wing, names in _cell_map().items():
        assert _found(wing) == names, (wing or "optax_accum", _found(wing) ^ names)
