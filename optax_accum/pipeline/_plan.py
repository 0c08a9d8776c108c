# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Where the runner's values wait, read from the table and the stage.

`plan` gives every value a slot of a buffer from the tick it arrives (or
is made) to the last tick that reads it, a freed slot reused, so the
buffers hold the table's most values in flight. `probe` reads from a
stage's traced ``jax.vjp`` which of its residuals are the stage's own
parameters: a split backward (ZB-H1) keeps the others in a slot between F
and W and puts the current parameters back, so no pending slot holds a
parameter-sized copy.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from . import _schedule as sched

IDLE, FORWARD, BACKWARD = sched.IDLE, sched.FORWARD, sched.BACKWARD
INPUT, WEIGHT = sched.INPUT, sched.WEIGHT


class Plan(NamedTuple):
    """Per tick and device (``cells``): op, micro-batch, repeat, the slot
    the arriving stage output and cotangent are written to (-1: none), the
    slots the op reads its stage input and cotangent from, and its residual
    slot; and the number of slots of each buffer."""

    cells: tuple[np.ndarray, ...]
    nx: int
    ng: int
    nr: int


def _slots(live: dict, ticks: int) -> tuple[np.ndarray, dict, int]:
    """Greedy slots for one device's ``live`` intervals ``{key: [start,
    end]}``: ``(store, where, count)``, the slot written at each start tick
    (-1 elsewhere), each key's slot, and the number of slots."""
    store = np.full(ticks, -1, np.int32)
    free_at: list[int] = []  # per slot, the first tick it is free again
    where = {}
    for key, (start, end) in sorted(live.items(), key=lambda kv: kv[1][0]):
        slot = next((i for i, f in enumerate(free_at) if f <= start), len(free_at))
        if slot == len(free_at):
            free_at.append(0)
        free_at[slot] = end + 1
        store[start], where[key] = slot, slot
    return store, where, len(free_at)


def plan(table: sched.ScheduleTable, split: bool) -> Plan:
    """Where each value waits: a slot from the tick it arrives (or is made)
    to the last tick that reads it, a freed slot reused. Stage inputs (x)
    arrive from the device before; cotangents (g) from the device after;
    residuals (split only) are made at F (the last stage: at B) and read at
    B and W. The slots hold the table's most values in flight."""
    ticks, stages = table.op.shape
    last = stages * (int(table.repeat.max()) + 1) - 1
    back = INPUT if split else BACKWARD
    at = {}
    for t, s in zip(*np.nonzero(table.op != IDLE), strict=True):
        j = int(table.repeat[t, s]) * stages + int(s)
        at[int(table.op[t, s]), int(table.microbatch[t, s]), j] = int(t)
    lives = [[{} for _ in range(stages)] for _ in range(3)]
    for (op, m, j), t in at.items():
        if op != FORWARD:
            continue
        s, t_b = j % stages, at[back, m, j]
        if j > 0:
            end = t if split and j < last else t_b
            lives[0][s][m, j] = [at[FORWARD, m, j - 1] + 1, end]
        if j < last:
            lives[1][s][m, j] = [at[back, m, j + 1] + 1, t_b]
        if split:
            lives[2][s][m, j] = [t_b if j == last else t, at[WEIGHT, m, j]]
    stores = [np.full((ticks, stages), -1, np.int32) for _ in range(3)]
    reads = [np.zeros((ticks, stages), np.int32) for _ in range(3)]
    sizes = [1, 1, 1]
    for k in range(3):
        for s in range(stages):
            store, where, count = _slots(lives[k][s], ticks)
            stores[k][:, s], sizes[k] = store, max(sizes[k], count)
            for t in np.nonzero(table.op[:, s] != IDLE)[0]:
                key = (
                    int(table.microbatch[t, s]),
                    int(table.repeat[t, s]) * stages + s,
                )
                reads[k][t, s] = where.get(key, 0)
    cells = (table.op, table.microbatch, table.repeat, stores[0], stores[1], *reads)
    return Plan(cells, *sizes)


class Residuals(NamedTuple):
    """How a stage ``vjp``'s leaves wait between F and W: ``source[i]`` is
    the stage parameter leaf that residual ``i`` is (the traced program
    forwards it), or -1 for one kept in the slot (``kept``: their types)."""

    treedef: Any
    source: tuple[int, ...]
    kept: tuple[jax.ShapeDtypeStruct, ...]


def probe(stage: Any, sp: Any, x: Any) -> Residuals:
    """The `Residuals` of ``jax.vjp(stage, sp, x)``, read from its jaxpr: a
    residual that is an input parameter (not a copy of one) is not kept."""
    found = {}

    def leaves(sp, x):
        vjp = jax.vjp(stage, sp, x)[1]
        flat, found["treedef"] = jax.tree.flatten(vjp)
        return flat

    closed = jax.make_jaxpr(leaves)(sp, x)
    params = closed.jaxpr.invars[: len(jax.tree.leaves(sp))]
    source, kept = [], []
    for v, aval in zip(closed.jaxpr.outvars, closed.out_avals, strict=True):
        j = next((i for i, p in enumerate(params) if v is p), -1)
        source.append(j)
        if j < 0:
            kept.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    return Residuals(found["treedef"], tuple(source), tuple(kept))


def paired(table: sched.ScheduleTable) -> bool:
    """Forwards only on even ticks and whole backwards only on odd ones."""
    even, odd = table.op[0::2], table.op[1::2]
    return (
        table.num_ticks % 2 == 0
        and bool(np.isin(even, (IDLE, FORWARD)).all())
        and bool(np.isin(odd, (IDLE, BACKWARD)).all())
    )


def phases(table: sched.ScheduleTable, split: bool) -> list[tuple]:
    """``(start, stop, forward sends, backward sends)`` per loop: a table
    whose backward ops all follow its forward ops (GPipe, circular) runs as
    two loops, each with only its direction's ``ppermute``; any other, one."""
    stages = table.op.shape[1]
    j = table.repeat * stages + np.arange(stages)
    last = stages * (int(table.repeat.max()) + 1) - 1
    back = INPUT if split else BACKWARD
    f = ((table.op == FORWARD) & (j < last)).any(axis=1)
    b = ((table.op == back) & (j > 0)).any(axis=1)
    ticks = table.num_ticks
    p = int(np.nonzero(b)[0][0]) if b.any() else ticks
    if 0 < p < ticks and not f[p:].any():
        return [(0, p, True, False), (p, ticks, False, True)]
    return [(0, ticks, True, True)]
