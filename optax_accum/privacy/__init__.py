# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The privacy wing: differentially private training with accumulation.

Per-example clipping (`clipped_value_and_grad`), then the sum over a logical
batch's calls, noised once and normalised by the expected batch size
(`dp_accumulate`), on the shared core of `accumulate`.
"""

from ._dp_accumulate import dp_accumulate as dp_accumulate
from ._noise import DPNoiseState as DPNoiseState
from ._value_and_grad import clipped_value_and_grad as clipped_value_and_grad

__all__ = ["DPNoiseState", "clipped_value_and_grad", "dp_accumulate"]
