# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""optax_accum: exact, fast, memory-lean gradient accumulation for JAX.

Two faces: `accumulate` (an optax transformation that accumulates across
calls; `MultiSteps` is its drop-in for ``optax.MultiSteps``) and `microbatch`
(k micro-batches fused into one compiled call). Wings: ``optax_accum.pipeline``
(pipeline parallelism) and ``optax_accum.privacy`` (DP-SGD: per-example
clipping, noise once per logical batch). Submodules, imported on their own:
``optax_accum.flax`` (Flax train steps), ``optax_accum.distributed``
(starting a multi-process job).
"""

from . import pipeline as pipeline
from . import privacy as privacy
from ._accumulate import AccumulateState as AccumulateState
from ._accumulate import MultiSteps as MultiSteps
from ._accumulate import MultiStepsState as MultiStepsState
from ._accumulate import SkipFn as SkipFn
from ._accumulate import accumulate as accumulate
from ._accumulate import find_state as find_state
from ._accumulate import has_updated as has_updated
from ._accumulate import noise_scale as noise_scale
from ._accumulate import skip_large_updates as skip_large_updates
from ._accumulate import skip_not_finite as skip_not_finite
from ._accumulate import state_specs as state_specs
from ._accumulate import update_count as update_count
from ._learning_rate import scale_learning_rate as scale_learning_rate
from ._loss_scale import ScaledGrads as ScaledGrads
from ._loss_scale import scaled_value_and_grad as scaled_value_and_grad
from ._microbatch import WeightFn as WeightFn
from ._microbatch import microbatch as microbatch
from ._microbatch import microbatch_value_and_grad as microbatch_value_and_grad
from ._noise_scale import NoiseScale as NoiseScale
from ._noise_scale import NoiseScaleState as NoiseScaleState
from ._offload import offload as offload
from ._partial_sums import defer_reduction as defer_reduction
from ._planner import MicrobatchPlan as MicrobatchPlan
from ._planner import compiled_memory_bytes as compiled_memory_bytes
from ._planner import plan_fused_step as plan_fused_step
from ._planner import plan_microbatch as plan_microbatch
from ._schedules import AdaptiveEveryK as AdaptiveEveryK
from ._schedules import adaptive_every_k as adaptive_every_k
from ._schedules import batch_size_warmup as batch_size_warmup
from ._sharding import state_shardings as state_shardings
from ._typing import AccumulatorDType as AccumulatorDType
from ._typing import AxisName as AxisName
from ._typing import Reduction as Reduction

# The one place the version is written: pyproject.toml reads it from here
# (hatch's `[tool.hatch.version]`), so the wheel, the metadata and this agree.
__version__ = "0.1.0"


__all__ = [
    "AccumulateState",
    "AccumulatorDType",
    "AdaptiveEveryK",
    "AxisName",
    "MicrobatchPlan",
    "MultiSteps",
    "MultiStepsState",
    "NoiseScale",
    "NoiseScaleState",
    "Reduction",
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
    "microbatch",
    "microbatch_value_and_grad",
    "noise_scale",
    "offload",
    "plan_fused_step",
    "plan_microbatch",
    "scale_learning_rate",
    "scaled_value_and_grad",
    "skip_large_updates",
    "skip_not_finite",
    "state_shardings",
    "state_specs",
    "update_count",
]
