# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Pipeline schedules as data: the static table of who does what, when.

A table has one row per tick and one column per device of the stage axis.
Each cell is an op (idle, forward or backward), the micro-batch it works on
and the repeat (the circular schedule's pass over the devices: virtual stage
``repeat * S + device``). The runners read their device's column inside one
``lax.scan``; the tests check the table's invariants; the guide draws it.

GPipe and circular list their backward ticks too, mirrored: that is the
order in which the transposed scan (``jax.grad`` of the forward loop) runs
them. 1F1B is built by simulation, one op per device per tick: a backward
whenever one is ready, else a forward while fewer than ``S - s`` micro-batches
are in flight on device ``s`` (so at most S stage inputs are ever held).
Interleaved 1F1B too, over ``S · repeats`` stages, with forwards on even
ticks and backwards on odd ones (`_interleaved` below).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np


class Op(enum.IntEnum):
    """What a device does in one cell of a `ScheduleTable`."""

    IDLE = 0
    FORWARD = 1
    BACKWARD = 2


IDLE, FORWARD, BACKWARD = Op.IDLE, Op.FORWARD, Op.BACKWARD
SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b")
# The schedules that run several stages per device and need M a multiple of S.
_REPEATED = ("circular", "interleaved_1f1b")


class ScheduleTable(NamedTuple):
    """A schedule: ``op``, ``microbatch`` and ``repeat``, each ``(ticks, S)``.

    ``op`` holds `Op` values: 0 (idle), 1 (forward) or 2 (backward); ``microbatch`` and
    ``repeat`` are -1 on idle cells. Device ``s`` with repeat ``r`` runs
    stage ``r * S + s``.
    """

    op: np.ndarray
    microbatch: np.ndarray
    repeat: np.ndarray

    @property
    def num_ticks(self) -> int:
        return self.op.shape[0]

    @property
    def num_forward_ticks(self) -> int:
        """Ticks up to the last forward (where GPipe's forward loop ends)."""
        return int(np.nonzero((self.op == FORWARD).any(axis=1))[0][-1]) + 1


def check_schedule(schedule: str, num_stages: int, num_microbatches: int, repeats: int):
    """Raises on an unknown schedule or counts it cannot run."""
    if schedule not in SCHEDULES:
        raise ValueError(f"`schedule` must be one of {SCHEDULES}, got {schedule!r}.")
    for name, v in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("repeats", repeats),
    ):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"`{name}` must be a positive int, got {v!r}.")
    if repeats > 1 and schedule not in _REPEATED:
        raise ValueError(
            f"`repeats`={repeats} needs `schedule='circular'` or "
            f"`schedule='interleaved_1f1b'`, got {schedule!r}."
        )
    if schedule in _REPEATED and num_microbatches % num_stages:
        raise ValueError(
            f"`num_microbatches`={num_microbatches} must be a multiple of the "
            f"number of stages {num_stages} for the {schedule} schedule (each "
            "group of S micro-batches comes back to device 0 just in time)."
        )


def _empty(ticks: int, stages: int) -> ScheduleTable:
    return ScheduleTable(
        np.zeros((ticks, stages), np.int32),
        np.full((ticks, stages), -1, np.int32),
        np.full((ticks, stages), -1, np.int32),
    )


def _forward_and_mirror(stages: int, microbatches: int, repeats: int) -> ScheduleTable:
    """GPipe (repeats 1) and circular: device s runs work item ``t - s``."""
    forward_ticks = repeats * microbatches + stages - 1
    table = _empty(2 * forward_ticks, stages)
    for t in range(forward_ticks):
        for s in range(stages):
            i = t - s
            if not 0 <= i < repeats * microbatches:
                continue
            # Groups of S micro-batches make every pass over the devices
            # before the next group starts: no buffer between passes.
            group, rest = divmod(i, stages * repeats)
            r, lane = divmod(rest, stages)
            m = group * stages + lane
            for tick, op in ((t, FORWARD), (2 * forward_ticks - 1 - t, BACKWARD)):
                table.op[tick, s] = op
                table.microbatch[tick, s] = m
                table.repeat[tick, s] = r
    return table


def _one_f_one_b(stages: int, microbatches: int) -> ScheduleTable:
    """PipeDream-flush 1F1B, one op per device per tick, by simulation."""
    ticks = 2 * (microbatches + stages - 1)
    table = _empty(ticks, stages)
    f_done = np.full((stages, microbatches), -1)  # tick of each forward
    b_done = np.full((stages, microbatches), -1)
    next_f = [0] * stages
    next_b = [0] * stages
    for t in range(ticks):
        for s in range(stages):
            m_b, m_f = next_b[s], next_f[s]
            done = f_done[s] if s == stages - 1 else b_done[s + 1]
            if m_b < m_f and 0 <= done[m_b] < t:
                op, m = BACKWARD, m_b
                b_done[s, m] = t
                next_b[s] += 1
            elif (
                m_f < microbatches
                and m_f - m_b < stages - s
                and (s == 0 or 0 <= f_done[s - 1, m_f] < t)
            ):
                op, m = FORWARD, m_f
                f_done[s, m] = t
                next_f[s] += 1
            else:
                continue
            table.op[t, s], table.microbatch[t, s], table.repeat[t, s] = op, m, 0
    if next_b != [microbatches] * stages:  # pragma: no cover - a schedule bug
        raise AssertionError("the 1F1B simulation did not finish.")
    return table


# Interleaved 1F1B (Narayanan et al. 2021; Megatron-LM, torch's
# ScheduleInterleaved1F1B), one op per device per tick.


def interleaved_orders(stages: int, microbatches: int, repeats: int):
    """Each device's forward and backward order of ``(micro-batch, repeat)``.

    Groups of S micro-batches: a group's forwards run repeat 0, 1, ... (each
    over the S micro-batches of the group), its backwards the repeats in
    reverse. The same on every device.
    """
    groups = range(microbatches // stages)
    lanes = range(stages)
    fwd = [(g * stages + i, r) for g in groups for r in range(repeats) for i in lanes]
    bwd = [
        (g * stages + i, r)
        for g in groups
        for r in reversed(range(repeats))
        for i in lanes
    ]
    return fwd, bwd


def interleaved_limit(stages: int, repeats: int, s: int) -> int:
    """Device ``s``'s most (micro-batch, stage) pairs between F and B:
    Megatron's warm-up, ``2 (S - s - 1) + (r - 1) S`` forwards, plus one."""
    return 2 * (stages - s - 1) + (repeats - 1) * stages + 1


def _interleaved(stages: int, microbatches: int, repeats: int) -> ScheduleTable:
    """Interleaved 1F1B by simulation, phase-aligned for lock-step SPMD:
    every device runs forwards on even ticks and backwards on odd ones.

    On an even tick a device runs its next forward if it is ready and fewer
    than `interleaved_limit` are in flight (memory O(S·r), flat in M); on an
    odd tick its next backward if it is ready. A tick lasts as long as its
    busiest device, so no tick mixes a forward with a longer backward: the
    time bubble is circular's, ``(S-1)/(r·M+S-1)``, whatever the costs of F
    and B, where 1F1B's (which mixes them) is larger than its slot count.
    """
    last, work = stages * repeats - 1, microbatches * repeats
    fwd, bwd = interleaved_orders(stages, microbatches, repeats)
    f_done = np.full((last + 1, microbatches), -1)  # tick of each op
    b_done = np.full((last + 1, microbatches), -1)
    nf, nb = [0] * stages, [0] * stages
    rows = []
    while min(nb) < work:
        t, row = len(rows), [None] * stages
        for s in range(stages):
            limit = interleaved_limit(stages, repeats, s)
            if t % 2 == 0 and nf[s] < work and nf[s] - nb[s] < limit:
                m, r = fwd[nf[s]]
                j = r * stages + s
                if j == 0 or 0 <= f_done[j - 1, m] < t:
                    row[s], f_done[j, m] = (FORWARD, m, r), t
                    nf[s] += 1
            elif t % 2 == 1 and nb[s] < nf[s]:
                m, r = bwd[nb[s]]
                j = r * stages + s
                after = f_done[j, m] if j == last else b_done[j + 1, m]
                if 0 <= after < t:
                    row[s], b_done[j, m] = (BACKWARD, m, r), t
                    nb[s] += 1
        rows.append(row)
        if len(rows) > 8 * (work + stages):  # pragma: no cover - a schedule bug
            raise AssertionError("the interleaved 1F1B simulation did not finish.")
    table = _empty(len(rows), stages)
    for t, row in enumerate(rows):
        for s, cell in enumerate(row):
            if cell is not None:
                table.op[t, s], table.microbatch[t, s], table.repeat[t, s] = cell
    return table


def schedule_table(
    schedule: str, num_stages: int, num_microbatches: int, repeats: int = 1
) -> ScheduleTable:
    """The static table of a pipeline schedule (ticks × devices).

    Args:
      schedule: ``"gpipe"``, ``"circular"``, ``"1f1b"`` or
        ``"interleaved_1f1b"``.
      num_stages: S, the size of the stage axis (devices).
      num_microbatches: M (a multiple of S for ``"circular"`` and
        ``"interleaved_1f1b"``).
      repeats: stages per device (``"circular"`` and ``"interleaved_1f1b"``).

    Returns:
      A `ScheduleTable`: ``op``, ``microbatch`` and ``repeat`` arrays.

    Examples:
      >>> from optax_accum.pipeline import schedule_table
      >>> schedule_table("gpipe", 2, 2).op[:3].tolist()  # 1 = forward
      [[1, 0], [1, 1], [0, 1]]
    """
    check_schedule(schedule, num_stages, num_microbatches, repeats)
    if schedule == "interleaved_1f1b":
        return _interleaved(num_stages, num_microbatches, repeats)
    if schedule == "1f1b":
        return _one_f_one_b(num_stages, num_microbatches)
    return _forward_and_mirror(num_stages, num_microbatches, repeats)


def bubble_fraction(
    schedule: str, num_stages: int, num_microbatches: int, repeats: int = 1
) -> float:
    """The fraction of (tick, device) slots that are idle in the table.

    GPipe: ``(S-1)/(M+S-1)``; circular: ``(S-1)/(r·M+S-1)``; 1F1B: GPipe's.
    Interleaved 1F1B idles more slots (its forwards wait for even ticks, its
    backwards for odd ones) but no device time in lock-step: its time
    bubble is circular's slot bubble.

    Examples:
      >>> from optax_accum.pipeline import bubble_fraction
      >>> bubble_fraction("gpipe", 4, 4)
      0.42857142857142855
    """
    table = schedule_table(schedule, num_stages, num_microbatches, repeats)
    return float(np.mean(table.op == IDLE))
