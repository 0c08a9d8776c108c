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

ZB-H1 (Qi et al., *Zero Bubble Pipeline Parallelism*, ICLR 2024) splits the
backward into B, the input gradient on the critical path, and W, the weight
gradient, deferred into what would be bubbles; see `_zero_bubble_h1`.

`bubble_fraction` reads a table as the idle share of device-time under
lock-step SPMD, given the costs of the ops (`_costs.measure_costs` reads
them from the compiled stage): each tick lasts as long as its busiest
device's op (every tick ends in a ``ppermute``). `idle_slots` counts idle
(tick, device) slots.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np


class Op(enum.IntEnum):
    """What a device does in one cell of a `ScheduleTable`."""

    IDLE = 0
    FORWARD = 1
    BACKWARD = 2  # the whole backward: input and weight gradients
    INPUT = 3  # B of a split backward: the input gradient only
    WEIGHT = 4  # W of a split backward: the weight gradient only


IDLE, FORWARD, BACKWARD = Op.IDLE, Op.FORWARD, Op.BACKWARD
INPUT, WEIGHT = Op.INPUT, Op.WEIGHT
SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zb_h1")
# The schedules that run several stages per device and need M a multiple of S.
_REPEATED = ("circular", "interleaved_1f1b")


class ScheduleTable(NamedTuple):
    """A schedule: ``op``, ``microbatch`` and ``repeat``, each ``(ticks, S)``.

    ``op`` holds `Op` values: 0 (idle), 1 (forward), 2 (backward), or for a
    split backward 3 (B, the input gradient) and 4 (W, the weight gradient);
    ``microbatch`` and ``repeat`` are -1 on idle cells. Device ``s`` with
    repeat ``r`` runs stage ``r * S + s``.
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


def _zb_pick(s: int, stages: int, ready_b: bool, ready_f: bool, pending_w: int):
    """ZB-H1's choice on device ``s``: W when S are pending (the memory cap),
    else B (the critical path), else F (1F1B's in-flight rule is in
    ``ready_f``), else a deferred W in what would be a bubble."""
    if pending_w >= stages:
        return WEIGHT
    if ready_b:
        return INPUT
    if ready_f:
        return FORWARD
    return WEIGHT if pending_w else IDLE


def _zero_bubble_h1(stages: int, microbatches: int) -> ScheduleTable:
    """ZB-H1: 1F1B's forwards, the backward split into B and W, by simulation.

    Forwards follow 1F1B's rule (fewer than ``S - s`` micro-batches between F
    and B on device ``s``); B runs as soon as its cotangent is there; W runs
    in ticks with nothing else to do, or when S are pending. So at most S
    stage inputs and S pending W residuals are held, flat in M. With equal
    costs the table has ``3M + S - 1`` ticks (the lower bound) for M ≥ S.
    """
    ticks = 3 * microbatches + 2 * stages + 2
    table = _empty(ticks, stages)
    f_done = np.full((stages, microbatches), -1)
    b_done = np.full((stages, microbatches), -1)
    count = np.zeros((stages, 5), np.int64)  # ops done, indexed by Op
    for t in range(ticks):
        for s in range(stages):
            n_f, n_b, n_w = count[s, FORWARD], count[s, INPUT], count[s, WEIGHT]
            done = f_done[s] if s == stages - 1 else b_done[s + 1]
            ready_b = n_b < n_f and 0 <= done[n_b] < t
            ready_f = (
                n_f < microbatches
                and n_f - n_b < stages - s
                and (s == 0 or 0 <= f_done[s - 1, n_f] < t)
            )
            op = _zb_pick(s, stages, ready_b, ready_f, n_b - n_w)
            if op == IDLE:
                continue
            m = int(count[s, op])
            count[s, op] += 1
            if op != WEIGHT:
                (f_done if op == FORWARD else b_done)[s, m] = t
            table.op[t, s], table.microbatch[t, s], table.repeat[t, s] = op, m, 0
    if (count[:, WEIGHT] != microbatches).any():  # pragma: no cover - a bug
        raise AssertionError("the ZB-H1 simulation did not finish.")
    last = int(np.nonzero((table.op != IDLE).any(axis=1))[0][-1]) + 1
    return ScheduleTable(*(a[:last] for a in table))


def schedule_table(
    schedule: str, num_stages: int, num_microbatches: int, repeats: int = 1
) -> ScheduleTable:
    """The static table of a pipeline schedule (ticks × devices).

    Args:
      schedule: ``"gpipe"``, ``"circular"``, ``"1f1b"``,
        ``"interleaved_1f1b"`` or ``"zb_h1"``.
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
    if schedule == "zb_h1":
        return _zero_bubble_h1(num_stages, num_microbatches)
    return _forward_and_mirror(num_stages, num_microbatches, repeats)


def idle_slots(
    schedule: str, num_stages: int, num_microbatches: int, repeats: int = 1
) -> float:
    """The share of the table's (tick, device) slots that are idle.

    GPipe: ``(S-1)/(M+S-1)``; circular: ``(S-1)/(r·M+S-1)``; 1F1B: GPipe's.
    Interleaved 1F1B idles more slots (its forwards wait for even ticks, its
    backwards for odd ones) but no more device time; ZB-H1 has three ops per
    micro-batch and stage where the others have two. So slots compare
    tables, not step times: for those, `bubble_fraction` with costs.

    Examples:
      >>> from optax_accum.pipeline import idle_slots
      >>> idle_slots("gpipe", 4, 4)
      0.42857142857142855
    """
    table = schedule_table(schedule, num_stages, num_microbatches, repeats)
    return float(np.mean(table.op == IDLE))


def bubble_fraction(
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    repeats: int = 1,
    costs: tuple[float, float, float] | None = None,
) -> float:
    """The idle share of device-time under lock-step SPMD, at op costs.

    ``costs=(f, b, w)`` are the times of a forward, an input-gradient (B)
    and a weight-gradient (W) op (a whole backward costs ``b + w``), e.g.
    `measure_costs` of the model, or stated ones such as ``(1, 1, 1)``. Each
    tick lasts as long as its busiest device's op, since every tick ends in
    a ``ppermute``. With equal costs GPipe's is ``(S-1)/(M+S-1)``; 1F1B's is
    worse than its slot count, as its ticks mix forwards with whole
    backwards; interleaved 1F1B's is circular's ``(S-1)/(r·M+S-1)``.

    Without ``costs`` it is the time bubble at costs ``(1, 1, 1)``; the share
    of idle slots is `idle_slots`.

    Examples:
      >>> from optax_accum.pipeline import bubble_fraction
      >>> round(bubble_fraction("gpipe", 4, 4, costs=(1, 1, 1)), 4)
      0.4286
      >>> round(bubble_fraction("1f1b", 4, 16, costs=(1, 1, 1)), 4)
      0.3333
    """
    unit = op_costs((1, 1, 1) if costs is None else costs)
    table = schedule_table(schedule, num_stages, num_microbatches, repeats)
    busy = unit[table.op]
    return float(1.0 - busy.sum() / (num_stages * busy.max(axis=1).sum()))


def op_costs(costs) -> np.ndarray:
    """The time of each `Op` (indexed by its value) from ``costs=(f, b, w)``."""
    ok = isinstance(costs, (tuple, list)) and len(costs) == 3
    if ok:
        ok = all(
            not isinstance(c, bool)
            and isinstance(c, (int, float, np.integer, np.floating))
            and np.isfinite(c)
            and c >= 0
            for c in costs
        )
    if not ok or sum(costs) <= 0:
        raise ValueError(
            "`costs` must be (f, b, w): three finite non-negative times of a "
            "forward, an input-gradient and a weight-gradient op, not all "
            f"zero; got {costs!r}."
        )
    f, b, w = (float(c) for c in costs)
    return np.array([0.0, f, b + w, b, w])  # idle, F, whole backward, B, W
