# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The schedule tables: each op once, dependencies kept, bubbles as the formulas."""

from __future__ import annotations

import numpy as np
import pytest

from optax_accum import pipeline as pl
from optax_accum.pipeline import _interleaved

SIZES = [(s, m) for s in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16, 64)]
CASES = [
    (sch, s, m, r)
    for s, m in SIZES
    for sch, r in (
        ("gpipe", 1),
        ("1f1b", 1),
        ("circular", 1),
        ("circular", 2),
        ("circular", 3),
    )
    if sch != "circular" or m % s == 0
]


def ticks_of(table, stages):
    """``{(op, virtual stage, micro-batch): [ticks]}`` over the whole table."""
    found = {}
    for t, s in zip(*np.nonzero(table.op != pl.Op.IDLE), strict=True):
        j = table.repeat[t, s] * stages + s
        key = (int(table.op[t, s]), int(j), int(table.microbatch[t, s]))
        found.setdefault(key, []).append(int(t))
    return found


@pytest.mark.parametrize("schedule,stages,m,repeats", CASES)
def test_each_op_once_in_order(schedule, stages, m, repeats):
    table = pl.schedule_table(schedule, stages, m, repeats)
    assert table.op.shape == table.microbatch.shape == table.repeat.shape
    assert table.op.shape[1] == stages
    idle = table.op == pl.Op.IDLE
    assert np.all(table.microbatch[idle] == -1) and np.all(table.repeat[idle] == -1)
    found = ticks_of(table, stages)
    total = stages * repeats
    expected = {
        (op, j, i)
        for op in (pl.Op.FORWARD, pl.Op.BACKWARD)
        for j in range(total)
        for i in range(m)
    }
    assert set(found) == expected
    assert all(len(v) == 1 for v in found.values())
    tick = {k: v[0] for k, v in found.items()}
    for i in range(m):
        for j in range(1, total):
            assert tick[pl.Op.FORWARD, j, i] > tick[pl.Op.FORWARD, j - 1, i]
            assert tick[pl.Op.BACKWARD, j - 1, i] > tick[pl.Op.BACKWARD, j, i]
        assert tick[pl.Op.BACKWARD, total - 1, i] > tick[pl.Op.FORWARD, total - 1, i]


@pytest.mark.parametrize("stages,m", SIZES)
def test_bubble_formulas(stages, m):
    gpipe = pl.idle_slots("gpipe", stages, m)
    assert gpipe == pytest.approx((stages - 1) / (m + stages - 1))
    assert pl.idle_slots("1f1b", stages, m) <= gpipe + 1e-12
    if m % stages == 0:
        for r in (1, 2, 3):
            got = pl.idle_slots("circular", stages, m, r)
            assert got == pytest.approx((stages - 1) / (r * m + stages - 1))


@pytest.mark.parametrize("stages,m", [(2, 4), (4, 8), (8, 16), (4, 4)])
def test_circular_passes_meet(stages, m):
    """The runner keeps no buffer between passes: each forward runs exactly
    one tick after the one it depends on, across the wrap S-1 -> 0 too."""
    table = pl.schedule_table("circular", stages, m, 3)
    tick = {k: v[0] for k, v in ticks_of(table, stages).items()}
    for (op, j, i), t in tick.items():
        if op == pl.Op.FORWARD and j:
            assert t == tick[pl.Op.FORWARD, j - 1, i] + 1


@pytest.mark.parametrize("stages,m", SIZES)
def test_1f1b_keeps_at_most_s_minus_s_in_flight(stages, m):
    """Device s holds at most S - s micro-batches between their forward and
    backward: the 1F1B runner's S-slot buffers rely on it."""
    table = pl.schedule_table("1f1b", stages, m)
    for s in range(stages):
        flight = np.cumsum(table.op[:, s] == pl.Op.FORWARD) - np.cumsum(
            table.op[:, s] == pl.Op.BACKWARD
        )
        assert flight.max() <= stages - s


def test_1f1b_steady_state_alternates():
    op = pl.schedule_table("1f1b", 4, 8).op
    # Device 0: S warm-up forwards, then backward and forward in turn.
    assert op[:4, 0].tolist() == [1, 1, 1, 1]
    steady = op[op[:, 0] != pl.Op.IDLE, 0][4:12].tolist()
    assert steady == [2, 1] * 4


# Interleaved 1F1B (its runner: tests/pipeline/test_interleaved.py).
INTERLEAVED = [(s, m, r) for s, m in SIZES for r in (1, 2, 3) if m % s == 0]


@pytest.mark.parametrize("stages,m,repeats", INTERLEAVED)
def test_interleaved_each_op_once_in_order(stages, m, repeats):
    test_each_op_once_in_order("interleaved_1f1b", stages, m, repeats)


@pytest.mark.parametrize("stages,m,repeats", INTERLEAVED)
def test_interleaved_time_bubble_is_circulars(stages, m, repeats):
    """Forward ticks and backward ticks alternate on every device at once,
    so with any costs the lock-step time bubble is circular's formula."""
    table = pl.schedule_table("interleaved_1f1b", stages, m, repeats)
    want = (stages - 1) / (repeats * m + stages - 1)
    for costs in ((1, 1, 1), (1, 0.5, 0.5), (1, 2, 1)):
        got = pl.bubble_fraction("interleaved_1f1b", stages, m, repeats, costs)
        assert got == pytest.approx(want)
    assert not (table.op[1::2] == pl.Op.FORWARD).any()
    assert not (table.op[::2] == pl.Op.BACKWARD).any()


@pytest.mark.parametrize("stages,m,repeats", INTERLEAVED)
def test_interleaved_in_flight_bounded(stages, m, repeats):
    """Device s holds at most Megatron's warm-up + 1 (micro-batch, stage)
    pairs between forward and backward, whatever M."""
    table = pl.schedule_table("interleaved_1f1b", stages, m, repeats)
    for s in range(stages):
        flight = np.cumsum(table.op[:, s] == pl.Op.FORWARD) - np.cumsum(
            table.op[:, s] == pl.Op.BACKWARD
        )
        assert flight.max() <= 2 * (stages - s - 1) + (repeats - 1) * stages + 1


@pytest.mark.parametrize("stages,repeats", [(2, 2), (4, 2), (4, 3), (8, 2)])
def test_interleaved_buffers_flat_in_m(stages, repeats):
    """The runner's planned buffer slots are O(S·r): the same for M = 8S as
    for M = 2S, and each holds a value until its backward reads it."""
    sizes = [
        _interleaved.plan(pl.schedule_table("interleaved_1f1b", stages, k, repeats))[1:]
        for k in (2 * stages, 8 * stages)
    ]
    assert sizes[0] == sizes[1]
    assert max(sizes[0]) <= 2 * stages * repeats


def test_interleaved_time_bubble_below_1f1b():
    """S = 4, M = 16, f = b = w = 1: 1F1B's is 1 - 48/72, GPipe's 3/19,
    interleaved 1F1B's circular's 3/(16 r + 3)."""
    unit = (1, 1, 1)
    one = pl.bubble_fraction("1f1b", 4, 16, costs=unit)
    assert one == pytest.approx(1 - 48 / 72)
    assert pl.bubble_fraction("gpipe", 4, 16, costs=unit) == pytest.approx(3 / 19)
    for r in (2, 3):
        got = pl.bubble_fraction("interleaved_1f1b", 4, 16, r, costs=unit)
        assert got == pytest.approx(3 / (16 * r + 3))
        assert got < one


def test_interleaved_needs_m_multiple_of_s():
    with pytest.raises(ValueError, match=r"`num_microbatches`=6 must be a multiple"):
        pl.schedule_table("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match=r"`repeats` must be a positive int"):
        pl.schedule_table("interleaved_1f1b", 4, 8, 0)


# ZB-H1 and the time bubble (issue 28).


@pytest.mark.parametrize("stages,m", SIZES)
def test_zb_h1_each_op_once_in_order(stages, m):
    """Every (micro-batch, stage) gets one F, one B and one W: F in stage
    order, B in reverse after the last F, W after its B on the same device;
    no whole backward; one op per device per tick (a cell holds one op)."""
    table = pl.schedule_table("zb_h1", stages, m)
    idle = table.op == pl.Op.IDLE
    assert np.all(table.microbatch[idle] == -1) and np.all(table.repeat[idle] == -1)
    assert not np.any(table.op == pl.Op.BACKWARD)
    found = ticks_of(table, stages)
    ops = (pl.Op.FORWARD, pl.Op.INPUT, pl.Op.WEIGHT)
    assert set(found) == {
        (op, j, i) for op in ops for j in range(stages) for i in range(m)
    }
    assert all(len(v) == 1 for v in found.values())
    tick = {k: v[0] for k, v in found.items()}
    F, B, W = ops
    for i in range(m):
        for j in range(stages):
            assert tick[W, j, i] > tick[B, j, i] > tick[F, j, i]
            if j:
                assert tick[F, j, i] > tick[F, j - 1, i]
                assert tick[B, j - 1, i] > tick[B, j, i]
    # The table ends with its last op.
    assert not idle[-1].all()


@pytest.mark.parametrize("stages,m", SIZES)
def test_zb_h1_memory_bounds(stages, m):
    """Device s holds at most S - s stage inputs (F to B, as 1F1B) and at
    most S pending W residuals, taken in micro-batch order: the runner's
    S-slot buffers (slot m mod S) rely on it."""
    table = pl.schedule_table("zb_h1", stages, m)
    for s in range(stages):
        count = {op: np.cumsum(table.op[:, s] == op) for op in pl.Op}
        flight = count[pl.Op.FORWARD] - count[pl.Op.INPUT]
        pending = count[pl.Op.INPUT] - count[pl.Op.WEIGHT]
        assert flight.max() <= stages - s
        assert pending.max() <= stages
        for op in (pl.Op.FORWARD, pl.Op.INPUT, pl.Op.WEIGHT):
            order = table.microbatch[table.op[:, s] == op, s]
            assert order.tolist() == list(range(m))


@pytest.mark.parametrize("stages,m", SIZES)
def test_time_bubble(stages, m):
    """With equal costs GPipe's time bubble is its slot formula; ZB-H1's
    table has 3M + S - 1 ticks once M ≥ S (each device's 3M ops plus the
    fill), the lower bound."""
    unit = (1, 1, 1)
    gpipe = pl.bubble_fraction("gpipe", stages, m, costs=unit)
    assert gpipe == pytest.approx((stages - 1) / (m + stages - 1))
    zb = pl.bubble_fraction("zb_h1", stages, m, costs=unit)
    assert zb == pytest.approx(pl.idle_slots("zb_h1", stages, m))
    if m >= stages:
        assert pl.schedule_table("zb_h1", stages, m).num_ticks == 3 * m + stages - 1
        assert zb == pytest.approx((stages - 1) / (3 * m + stages - 1))
    assert zb <= pl.bubble_fraction("1f1b", stages, m, costs=unit) + 1e-12


def test_time_bubble_values():
    """S = 4, M = 16, costs (1, 1, 1): the issue's numbers."""
    unit = (1, 1, 1)
    one_f_one_b = pl.bubble_fraction("1f1b", 4, 16, costs=unit)
    assert one_f_one_b == pytest.approx(1 - 48 / 72)
    assert pl.idle_slots("1f1b", 4, 16) == pytest.approx(3 / 19)
    assert pl.bubble_fraction("gpipe", 4, 16, costs=unit) == pytest.approx(3 / 19)
    zb = pl.bubble_fraction("zb_h1", 4, 16, costs=unit)
    assert zb == pytest.approx(3 / 51)
    assert zb <= one_f_one_b / 2
    # Unequal costs: a tick lasts as long as its slowest op.
    got = pl.bubble_fraction("gpipe", 2, 2, costs=(1, 2, 1))
    assert got == pytest.approx(1 - 2 * 2 * 4 / (2 * (3 * 1 + 3 * 3)))


@pytest.mark.parametrize(
    "costs",
    [
        (1, 1),
        (1, 1, 1, 1),
        (1, -1, 1),
        (1, float("nan"), 1),
        (0, 0, 0),
        "abc",
        3,
        (True, 1, 1),
        (1, float("inf"), 1),
    ],
)
def test_bad_costs(costs):
    with pytest.raises(ValueError, match="`costs`"):
        pl.bubble_fraction("gpipe", 2, 2, costs=costs)


def test_zb_h1_needs_repeats_one():
    with pytest.raises(ValueError, match="repeats"):
        pl.schedule_table("zb_h1", 2, 4, 2)
