# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""A cell of the oracle's matrix: one value of each variable.

The variables are the face, the device mode, the reduction, the weights, k,
the dtype, the accumulator dtype, one option, the inner optimizer, NaN rows
(``nan_grad``) and whether the bad weight is on one device's rows only
(``bad_device``). A few more (``magnitude``, ``dim``, ``eager``,
``int_param``) are set only by the explicit cells that a defect needs.
`Cell.structure` is what a compiled function depends on; ``seed`` and the
value-only variables are fed as arrays.
"""

from __future__ import annotations

import dataclasses

# The pipeline's schedules are faces too (`pipeline.value_and_grad`).
PIPELINE_FACES = (
    "pipe-gpipe",
    "pipe-1f1b",
    "pipe-circular",
    "pipe-interleaved",
    "pipe-zb",
)
# The faces that run 2 stages per device (``repeats``); the others run 1.
PIPE_REPEATS = {"pipe-circular": 2, "pipe-interleaved": 2}
FACES = (
    "accumulate",
    "multisteps",
    "microbatch",
    "loss",
    "nnx",
    "linen",
    *PIPELINE_FACES,
)
MODES = ("single", "global", "axis_name", "pmap", "data_axes")
REDUCTIONS = ("mean", "sum")
WEIGHTS = ("none", "counts", "zeros", "nan", "negative")
KS = (1, 2, 3, 8)
DTYPES = ("f32", "bf16", "f16", "f64")
ACCS = ("promote", "none", "f32")
OPTIONS = (
    "none",
    "skip_fn",
    "skip_large",
    "noise",
    "has_aux",
    "rng",
    "float0",
    "close",
    "schedule",
    "clip",
)
INNERS = ("sgd", "adam")

# The variables of the covering array, in order.
VARIABLES = {
    "face": FACES,
    "mode": MODES,
    "reduction": REDUCTIONS,
    "weights": WEIGHTS,
    "k": KS,
    "dtype": DTYPES,
    "acc": ACCS,
    "option": OPTIONS,
    "inner": INNERS,
    "nan_grad": (False, True),
    "bad_device": (False, True),
}

# The privacy wing's face (`privacy.clipped_value_and_grad`): its own cells
# (`matrix.privacy_cells`), beside the covering array of `FACES`.
PRIVACY_FACES = ("privacy",)
STREAM_FACES = ("accumulate", "multisteps")  # one micro-batch per call
# k micro-batches per call
LOOP_FACES = ("microbatch", "loss", "nnx", "linen", *PIPELINE_FACES)
DEVICES = 8  # the global view, axis_name and data_axes run on 8 CPU devices
# The pipeline's mesh: 2 stages, and with data_axes 4 data shards (8 devices).
PIPE_STAGES, PIPE_DATA = 2, 4
ROWS = 2  # rows of a micro-batch per device


@dataclasses.dataclass(frozen=True)
class Cell:
    """One combination of the variables (see the module docstring)."""

    face: str
    mode: str
    reduction: str
    weights: str
    k: int
    dtype: str
    acc: str
    option: str
    inner: str = "sgd"
    nan_grad: bool = False  # one micro-batch's rows hold NaN (finite weight)
    # "large": fp16-sized values and weights; "heavy", "light": weights
    # scaled by 2**100 or 2**-100 (honoured, the weight contract says).
    magnitude: str = "unit"
    dim: int = 3  # parameter size (defect 4 sets it to ROWS)
    eager: bool = False  # accumulate called outside jit (concrete weights)
    int_param: bool = False  # an integer parameter besides another option
    bad_device: bool = False  # the bad pattern on device 0's rows only
    seed: int = 0

    @property
    def float0(self) -> bool:
        """Whether the parameters hold an integer leaf (a float0 gradient)."""
        return self.option == "float0" or self.int_param

    @property
    def devices(self) -> int:
        """The devices that hold the batch's rows (the pipeline: data shards)."""
        if self.mode == "single":
            return 1
        return PIPE_DATA if self.pipeline else DEVICES

    @property
    def pipeline(self) -> bool:
        return self.face in PIPELINE_FACES

    @property
    def repeats(self) -> int:
        """The pipeline's stages per device (`PIPE_REPEATS`)."""
        return PIPE_REPEATS.get(self.face, 1)

    @property
    def num_stages(self) -> int:
        """The pipeline's stages, ``S · repeats``."""
        return PIPE_STAGES * self.repeats

    @property
    def mapped(self) -> bool:
        """Inside a mapped axis (``shard_map`` or ``pmap``): ``axis_name``."""
        return self.mode in ("axis_name", "pmap")

    @property
    def weighted(self) -> bool:
        return self.weights != "none"

    @property
    def stream(self) -> bool:
        return self.face in STREAM_FACES

    def structure(self) -> tuple:
        """What the compiled function depends on: values are left out."""
        return (
            self.face,
            self.mode,
            self.reduction,
            self.weighted,
            self.k,
            self.dtype,
            self.acc,
            self.option,
            self.inner,
            self.dim,
            self.eager,
            self.int_param,
            self.bad_device,
        )

    def id(self) -> str:
        extra = [
            s
            for s, on in (
                ("nangrad", self.nan_grad),
                (self.magnitude, self.magnitude != "unit"),
                (f"dim{self.dim}", self.dim != 3),
                ("eager", self.eager),
                ("int", self.int_param),
                ("baddev", self.bad_device),
                (f"s{self.seed}", self.seed),
            )
            if on
        ]
        parts = [
            self.face,
            self.mode,
            self.reduction,
            f"w-{self.weights}",
            f"k{self.k}",
            self.dtype,
            f"acc-{self.acc}",
            self.option,
            self.inner,
            *extra,
        ]
        return "/".join(parts)
