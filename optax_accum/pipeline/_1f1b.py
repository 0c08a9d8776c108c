# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""1F1B: one op per device per tick, the backward a whole ``jax.vjp``.

Device ``s`` keeps at most ``S - s`` micro-batches in flight (the table's
rule), so `_loop.plan` gives at most S slots to the stage inputs and the
pending cotangents: activations O(S), flat in M. Each backward recomputes
its stage from the input it kept and takes every gradient at once.
"""

from __future__ import annotations

import functools

from . import _loop
from . import _schedule as sched

# The op of the slot where the last stage computes a micro-batch's loss.
LOSS_OP = sched.BACKWARD

run = functools.partial(_loop.run, split=False)
