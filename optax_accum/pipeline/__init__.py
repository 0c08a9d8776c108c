# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Pipeline parallelism over micro-batches: GPipe, circular, 1F1B,
interleaved 1F1B and ZB-H1.

The layers of a model sit on the devices of a mesh axis (the stage axis),
and the micro-batches fill the pipeline; their gradients accumulate before
the one update, so gradient accumulation is the pipeline's inner loop.
`value_and_grad` returns the exact loss and gradients of the sequential
model; `schedule_table` is the static schedule it runs (and the tests check,
and the guide draws); `bubble_fraction` reads it, under the op costs
`measure_costs` reads from the compiled stage (`idle_slots`: its idle slots).
"""

from ._costs import Costs as Costs
from ._costs import measure_costs as measure_costs
from ._schedule import Op as Op
from ._schedule import ScheduleTable as ScheduleTable
from ._schedule import bubble_fraction as bubble_fraction
from ._schedule import idle_slots as idle_slots
from ._schedule import schedule_table as schedule_table
from ._value_and_grad import value_and_grad as value_and_grad

__all__ = [
    "Costs",
    "Op",
    "ScheduleTable",
    "bubble_fraction",
    "idle_slots",
    "measure_costs",
    "schedule_table",
    "value_and_grad",
]
