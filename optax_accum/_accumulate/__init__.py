# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The accumulate wing: `accumulate`, its `MultiSteps` drop-in, skips, state readers.

Per-call accumulation: the state holds the window's sums, and ``lax.cond``
emits zeros on hold steps and the inner optimizer's update at the boundary.
The engine (`_engine`) is shared by both transformations.
"""

from ._accumulate import AccumulateState as AccumulateState
from ._accumulate import accumulate as accumulate
from ._accumulate import state_specs as state_specs
from ._accumulate import sum_and_clear as sum_and_clear
from ._engine import Engine as Engine
from ._multisteps import MultiSteps as MultiSteps
from ._multisteps import MultiStepsState as MultiStepsState
from ._skip import SkipFn as SkipFn
from ._skip import skip_large_updates as skip_large_updates
from ._skip import skip_not_finite as skip_not_finite
from ._states import find_state as find_state
from ._states import has_updated as has_updated
from ._states import noise_scale as noise_scale
from ._update_count import update_count as update_count
