# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The planner wing: the largest micro-batch that fits, from compiled memory.

`plan_microbatch` and `plan_fused_step` (`_planner`) compile the step ahead
of time for each candidate size and read XLA's memory analysis; `_compile`
is where they compile it: this machine, or a GPU or TPU target.
"""

from ._planner import MicrobatchPlan as MicrobatchPlan
from ._planner import compiled_memory_bytes as compiled_memory_bytes
from ._planner import plan_fused_step as plan_fused_step
from ._planner import plan_microbatch as plan_microbatch
