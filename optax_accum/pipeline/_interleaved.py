# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Interleaved 1F1B: 1F1B over ``S · repeats`` virtual stages.

Device ``s`` runs stages ``s, s + S, ...`` (repeat ``r`` is stage
``r·S + s``), one op per tick as the table says, the backward an explicit
``jax.vjp`` as in `_1f1b`. A stage output of device S-1 goes around the ring
to device 0's next repeat, a cotangent of device 0 back to device S-1's
previous one: the same two ``ppermute``s per tick.

Where a value waits is data too: `_plan.plan` reads the table and gives every
stage input and every pending cotangent a buffer slot for the ticks between
its arrival and its backward (a slot freed is reused), so the buffers hold
the table's most values in flight, O(S·r), flat in M. The repeat is part
of the dispatch index: each branch takes its repeat's weights from the
``(R, ...)`` stack with a static slice, and the gradient sums are one such
stack updated in place at the repeat (`_sums`), so the loop holds no
second copy of the stack. The runner (`_loop`) knows nothing of the
schedule but the table.
"""

from __future__ import annotations

import functools

import numpy as np

from . import _loop, _plan
from . import _schedule as sched

# The op of the slot where the last stage computes a micro-batch's loss.
LOSS_OP = sched.BACKWARD


def plan(table: sched.ScheduleTable) -> tuple[tuple[np.ndarray, ...], int, int]:
    """``(cells, x slots, g slots)``: `_plan.plan` of a whole-backward table."""
    cells, nx, ng, _ = _plan.plan(table, split=False)
    return cells, nx, ng


run = functools.partial(_loop.run, split=False)
