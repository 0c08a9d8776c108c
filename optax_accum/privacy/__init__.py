# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The privacy wing: differentially private training with accumulation.

Per-example clipping (`clipped_value_and_grad`), then the sum over a logical
batch's calls, noised once and normalised by the expected batch size
(`dp_accumulate`), on the shared core of `accumulate`. Poisson sampling of
logical batches padded to whole micro-batches (`poisson_microbatches`), and
the accounting of the Poisson-subsampled Gaussian on dp_accounting
(`epsilon`, `noise_multiplier_for`; the ``privacy`` extra).
"""

from ._accounting import epsilon as epsilon
from ._accounting import noise_multiplier_for as noise_multiplier_for
from ._dp_accumulate import dp_accumulate as dp_accumulate
from ._noise import DPNoiseState as DPNoiseState
from ._sampling import PoissonBatch as PoissonBatch
from ._sampling import PoissonMicrobatches as PoissonMicrobatches
from ._sampling import pad_microbatches as pad_microbatches
from ._sampling import poisson_microbatches as poisson_microbatches
from ._value_and_grad import clipped_value_and_grad as clipped_value_and_grad

__all__ = [
    "DPNoiseState",
    "PoissonBatch",
    "PoissonMicrobatches",
    "clipped_value_and_grad",
    "dp_accumulate",
    "epsilon",
    "noise_multiplier_for",
    "pad_microbatches",
    "poisson_microbatches",
]
