# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Reading compiled HLO text in tests: computations and what calls what."""

from __future__ import annotations

import re
from collections.abc import Iterable

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
    r"=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
ALL_REDUCE = re.compile(r"\ball-reduce(?:-start)?\(")


def computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    """Each computation's instruction lines, and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry = name = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            name = header.group(2)
            comps[name] = []
            if header.group(1):
                entry = name
        elif line.strip() == "}":
            name = None
        elif name is not None:
            comps[name].append(line.strip())
    return comps, entry


def callees(line: str) -> list[str]:
    """Computations an instruction calls: fusions, loops, branches, reducers."""
    names = _CALLS.findall(line)
    for group in _BRANCHES.findall(line):
        names += [x.strip().lstrip("%") for x in group.split(",")]
    return names


def reachable(comps: dict[str, list[str]], roots: Iterable[str]) -> set[str]:
    """``roots`` and every computation they call, transitively."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c]:
            todo += callees(line)
    return seen


def branch_roots(comps: dict[str, list[str]]) -> set[str]:
    """The branch computations of every conditional."""
    roots: set[str] = set()
    for lines in comps.values():
        for line in lines:
            for group in _BRANCHES.findall(line):
                roots |= {x.strip().lstrip("%") for x in group.split(",")}
            roots |= set(re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line))
    return roots


def while_bodies(comps: dict[str, list[str]]) -> set[str]:
    """The body computations of every while loop."""
    return {
        b
        for lines in comps.values()
        for line in lines
        if " while(" in line
        for b in re.findall(r"body=%?([\w.\-]+)", line)
    }


def count(comps: dict[str, list[str]], names: Iterable[str], pattern=ALL_REDUCE) -> int:
    """Matches of ``pattern`` in the named computations."""
    return sum(len(pattern.findall(line)) for c in names for line in comps[c])
