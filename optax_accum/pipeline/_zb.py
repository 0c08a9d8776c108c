# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""ZB-H1: 1F1B with the backward split into B (input gradient) and W (weights).

The table (`_schedule._zero_bubble_h1`) says, per tick and device, F, B, W
or nothing. `_loop` runs it with ``split=True``: F linearizes the stage once
and keeps its residuals in a slot (the parameters among them are not kept:
`_plan.probe` reads from the traced program which residuals are the
parameters themselves, and W puts the current ones back); B takes only the
input cotangent from them and keeps the stage output's cotangent; W takes
only the stage weights' gradient. The last stage linearizes at B, where its
loss is. So F, B and W each cost what their name says: no stage forward at
B, no input gradient at W. A device holds at most the ``S - s``
micro-batches of 1F1B between F and B, and at most S pending W: O(S)
residual sets, flat in M.
"""

from __future__ import annotations

import functools

from . import _loop
from . import _schedule as sched

# The op of the slot where the last stage computes a micro-batch's loss.
LOSS_OP = sched.INPUT

run = functools.partial(_loop.run, split=True)
