# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Differentially private training with accumulation (DP-SGD).

Poisson sampling of logical batches padded to whole micro-batches
(`poisson_microbatches`), and the accounting of the Poisson-subsampled
Gaussian on dp_accounting (`epsilon`, `noise_multiplier_for`; the
``privacy`` extra).
"""

from ._accounting import epsilon as epsilon
from ._accounting import noise_multiplier_for as noise_multiplier_for
from ._sampling import PoissonBatch as PoissonBatch
from ._sampling import PoissonMicrobatches as PoissonMicrobatches
from ._sampling import pad_microbatches as pad_microbatches
from ._sampling import poisson_microbatches as poisson_microbatches

__all__ = [
    "PoissonBatch",
    "PoissonMicrobatches",
    "epsilon",
    "noise_multiplier_for",
    "pad_microbatches",
    "poisson_microbatches",
]
