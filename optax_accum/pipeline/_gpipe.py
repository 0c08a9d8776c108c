# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""GPipe and circular: every forward, then every backward, mirrored.

The table lists the backward ticks too, in the order a transposed forward
loop would run them. `_loop` runs it: each stage input waits in a slot until
its backward recomputes the slot under one ``jax.vjp`` (GPipe's remat: one
stage input per micro-batch, O(M) activations, what MaxText and Praxis
save).
"""

from __future__ import annotations

import functools

from . import _loop
from . import _schedule as sched

# The op of the slot where the last stage computes a micro-batch's loss.
LOSS_OP = sched.BACKWARD

run = functools.partial(_loop.run, split=False)
