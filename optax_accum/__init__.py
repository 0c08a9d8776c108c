# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""optax_accum: exact, fast, memory-lean gradient accumulation for JAX."""

from importlib.metadata import PackageNotFoundError, version

from ._accumulate import AccumulateState as AccumulateState
from ._accumulate import SkipFn as SkipFn
from ._accumulate import accumulate as accumulate
from ._accumulate import has_updated as has_updated
from ._accumulate import state_specs as state_specs
from ._multisteps import MultiSteps as MultiSteps
from ._multisteps import MultiStepsState as MultiStepsState
from ._skip import skip_large_updates as skip_large_updates
from ._skip import skip_not_finite as skip_not_finite

try:
    __version__ = version("optax_accum")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "AccumulateState",
    "MultiSteps",
    "MultiStepsState",
    "SkipFn",
    "accumulate",
    "has_updated",
    "skip_large_updates",
    "skip_not_finite",
    "state_specs",
]
