# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Reading compiled HLO text in tests: computations and what calls what."""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

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


def large_copies(comps: dict[str, list[str]], at_least: int = 1000) -> list[str]:
    """Copies of arrays with at least ``at_least`` elements, in any computation."""
    out = []
    for lines in comps.values():
        for line in lines:
            m = re.search(r"= \w+\[([\d,]*)\]\S* copy\(", line)
            if m:
                dims = [int(d) for d in m.group(1).split(",") if d]
                if int(np.prod(dims)) >= at_least:
                    out.append(line)
    return out


def count(comps: dict[str, list[str]], names: Iterable[str], pattern=ALL_REDUCE) -> int:
    """Matches of ``pattern`` in the named computations."""
    return sum(len(pattern.findall(line)) for c in names for line in comps[c])


COLLECTIVE = re.compile(
    r"\b(all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)"
    r"(?:-start)?\("
)
_GROUPS_LIST = re.compile(r"(?:replica_groups|source_target_pairs)=\{(\{[^=]*?\})\}")
_GROUPS_IOTA = re.compile(
    r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"
)


_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}"
)


def _mesh_groups(m: re.Match) -> list[list[int]]:
    """``replica_groups=mesh['a'=n,...](, device_ids=(...)) {'a',...}``."""
    names = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    sizes = [int(n) for _, n in names]
    ids = np.arange(int(np.prod(sizes)))
    if m.group(2):
        dims = [int(v) for v in m.group(2).split(",")]
        ids = ids.reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
    ids = ids.reshape(sizes)
    over = [i for i, (n, _) in enumerate(names) if f"'{n}'" in m.group(4)]
    rest = [i for i in range(len(names)) if i not in over]
    size = int(np.prod([sizes[i] for i in over])) if over else 1
    return ids.transpose(rest + over).reshape(-1, size).tolist()


def _groups(line: str, num_devices: int) -> list[list[int]]:
    mesh = _GROUPS_MESH.search(line)
    if mesh:
        return _mesh_groups(mesh)
    iota = _GROUPS_IOTA.search(line)
    if iota:
        shape = [int(v) for v in iota.group(1).split(",")]
        dims = [int(v) for v in iota.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(v) for v in iota.group(3).split(",")])
        return ids.reshape(shape).tolist()
    listed = _GROUPS_LIST.search(line)
    if listed:
        return [
            [int(v) for v in g.split(",") if v.strip()]
            for g in re.findall(r"\{([\d,\s]*)\}", listed.group(1))
        ]
    return [list(range(num_devices))]  # replica_groups={}: every device


_ARRAY = re.compile(r"\b(pred|[a-z]+)(\d*)\[([\d,]*)\]")


def payload_bytes(line: str) -> int:
    """Bytes of an instruction's result (all arrays of a tuple result)."""
    rest = line.split("=", 1)[1].strip() if "=" in line else ""
    # Layouts go first: XLA:TPU's hold parentheses (``{1,0:T(8,128)S(1)}``).
    rest = re.sub(r"\{[^{}]*\}", "", rest)
    # A tuple result reads up to its closing paren, an array up to the op's.
    result = rest.split(")", 1)[0] if rest.startswith("(") else rest.split("(", 1)[0]
    total = 0
    for kind, bits, dims in _ARRAY.findall(result):
        n = int(np.prod([int(d) for d in dims.split(",") if d]))
        total += n * (1 if kind == "pred" else int(bits or 8) // 8)
    return total


def collectives(
    comps: dict[str, list[str]], names: Iterable[str], num_devices: int
) -> list[tuple[str, list[list[int]], int]]:
    """Each collective in the named computations: (op, device groups, bytes)."""
    found = []
    for c in names:
        for line in comps[c]:
            m = COLLECTIVE.search(line)
            if m and "-done(" not in line:
                found.append(
                    (m.group(1), _groups(line, num_devices), payload_bytes(line))
                )
    return found


def crosses(groups: list[list[int]], mesh, axis: str) -> bool:
    """Whether a group holds devices at different coordinates along ``axis``.

    SPMD programs name devices by their position in the mesh's device order
    (the compiled program's device assignment), not by ``Device.id``.
    """
    where = dict(enumerate(np.ndindex(mesh.devices.shape)))
    k = mesh.axis_names.index(axis)
    return any(len({where[d][k] for d in g}) > 1 for g in groups)
