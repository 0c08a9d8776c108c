# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""optax_accum: exact, fast, memory-lean gradient accumulation for JAX."""

from importlib.metadata import PackageNotFoundError, version

from ._accumulate import AccumulateState as AccumulateState
from ._accumulate import SkipFn as SkipFn
from ._accumulate import accumulate as accumulate
from ._accumulate import state_specs as state_specs
from ._distributed import LocalRun as LocalRun
from ._distributed import initialize_distributed as initialize_distributed
from ._distributed import launch_local as launch_local
from ._layout import defer_reduction as defer_reduction
from ._layout import state_shardings as state_shardings
from ._loss_scale import ScaledGrads as ScaledGrads
from ._loss_scale import scaled_value_and_grad as scaled_value_and_grad
from ._lr import batch_size_warmup as batch_size_warmup
from ._lr import scale_learning_rate as scale_learning_rate
from ._microbatch import WeightFn as WeightFn
from ._microbatch import microbatch as microbatch
from ._multisteps import MultiSteps as MultiSteps
from ._multisteps import MultiStepsNoiseState as MultiStepsNoiseState
from ._multisteps import MultiStepsState as MultiStepsState
from ._noise_scale import AdaptiveEveryK as AdaptiveEveryK
from ._noise_scale import NoiseScale as NoiseScale
from ._noise_scale import NoiseScaleState as NoiseScaleState
from ._noise_scale import adaptive_every_k as adaptive_every_k
from ._noise_scale import noise_scale as noise_scale
from ._planner import MicroBatchPlan as MicroBatchPlan
from ._planner import compiled_memory_bytes as compiled_memory_bytes
from ._planner import plan_micro_batch as plan_micro_batch
from ._skip import skip_large_updates as skip_large_updates
from ._skip import skip_not_finite as skip_not_finite
from ._states import find_state as find_state
from ._states import has_updated as has_updated

try:
    __version__ = version("optax_accum")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "AccumulateState",
    "AdaptiveEveryK",
    "LocalRun",
    "MicroBatchPlan",
    "MultiSteps",
    "MultiStepsNoiseState",
    "MultiStepsState",
    "NoiseScale",
    "NoiseScaleState",
    "ScaledGrads",
    "SkipFn",
    "WeightFn",
    "accumulate",
    "adaptive_every_k",
    "batch_size_warmup",
    "compiled_memory_bytes",
    "defer_reduction",
    "find_state",
    "has_updated",
    "initialize_distributed",
    "launch_local",
    "microbatch",
    "noise_scale",
    "plan_micro_batch",
    "scale_learning_rate",
    "scaled_value_and_grad",
    "skip_large_updates",
    "skip_not_finite",
    "state_shardings",
    "state_specs",
]
