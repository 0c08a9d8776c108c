# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The microbatch wing: k micro-batches fused into one ``lax.scan``.

`microbatch` wraps a value-and-grad function, `microbatch_value_and_grad` a
loss (the loss face). What other wings use (the Flax steps, the pipeline) is
re-exported here: they import this package, never its private modules.
"""

from ._grad import microbatch_value_and_grad as microbatch_value_and_grad
from ._grad import value_and_grad_with_state as value_and_grad_with_state
from ._keywords import Keywords as Keywords
from ._keywords import MicrobatchKeywords as MicrobatchKeywords
from ._keywords import StepKeywords as StepKeywords
from ._keywords import WeightFn as WeightFn
from ._microbatch import microbatch as microbatch
from ._microbatch import microbatch_with_state as microbatch_with_state
from ._options import Options as Options
from ._options import options as options
