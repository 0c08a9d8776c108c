# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Cells that today's code gets wrong: one registry, predicate -> defect.

Each entry marks the cells it matches ``xfail(strict=True)``: when the fix
lands, the cell passes, the strict xfail turns into a failure, and the entry
is deleted. Labels ``"issue 20 defect N"`` are the defects of issue 20
(section 2; ``0`` is section 1, a value-and-grad ``fun``'s own gradients);
``"oracle-N"`` are disagreements the oracle found beyond them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from . import table
from .cells import ROWS, Cell


class Known(NamedTuple):
    label: str
    description: str
    matches: Callable[[Cell], bool]


_FUSED = ("microbatch", "nnx", "linen")  # the loss face is not judged yet
_SKIPS = ("skip_fn", "skip_large")


def _partial(c: Cell) -> bool:
    """The bad pattern is on one device of several."""
    return c.bad_device and c.devices > 1


def _idle_rejections(c: Cell) -> int:
    """How many calls the model rejects right after an update (a value
    question: the registry asks the model)."""
    from . import data, expect

    return expect.stream(c, data.build(c))["idle_rejections"]


def _swamped(c: Cell) -> bool:
    """A Flax step whose only micro-batch holds NaN rows with a usable
    weight: every parameter is NaN from the first step on, in the model
    too, whatever the defect."""
    return (
        c.face in ("nnx", "linen")
        and c.k == 1
        and c.nan_grad
        and c.weights in ("none", "counts")
    )


def _refused(c: Cell) -> bool:
    return bool(table.refusals(c))


KNOWN: tuple[Known, ...] = (
    Known(
        "issue 20 defect 12",
        "microbatch(k=1, noise_scale_decay=...) without axis_name is not refused",
        lambda c: (
            c.face in _FUSED
            and c.k == 1
            and c.option == "noise"
            and c.reduction == "mean"
            and not c.mapped
        ),
    ),
    Known(
        "oracle-1",
        "noise_scale_decay with float64 gradients fails at trace time in "
        "accumulate and MultiSteps: the boundary's noise sums are float64, "
        "the hold branch's float32 (lax.cond branch types differ)",
        lambda c: (
            c.stream
            and c.option == "noise"
            and c.dtype == "f64"
            and c.acc != "f32"
            and not _refused(c)
        ),
    ),
    Known(
        "oracle-2",
        "microbatch with k = 1 passes rng_argnums keys unfolded, where "
        "micro-batch 0 of k >= 2 gets fold_in(key, 0) (and data_axes also "
        "folds the device index): the key depends on k",
        lambda c: (
            c.face in ("microbatch", "linen")
            and c.option == "rng"
            and c.k == 1
            and not _refused(c)
            and not _swamped(c)
        ),
    ),
    Known(
        "oracle-3",
        "data_axes with k = 1 runs the global view: a negative weight on one "
        "device's rows is summed into the micro-batch's weight instead of "
        "rejecting that device's part, as k >= 2 does",
        lambda c: (
            c.face in _FUSED
            and c.mode == "data_axes"
            and c.k == 1
            and c.weights == "negative"
            and _partial(c)
            and not _refused(c)
        ),
    ),
    Known(
        "issue 20 defect 0",
        "weight_fn in the global view differentiates share * value: fun's own "
        "(clipped) gradients are dropped",
        lambda c: (
            c.face == "microbatch"
            and c.option == "clip"
            and c.weighted
            and c.k >= 2
            and c.mode in ("single", "global")
            and c.dtype in ("f32", "f64")
        ),
    ),
    Known(
        "issue 20 defect 1",
        "k = 1 ignores weight_fn outside axis_name",
        lambda c: (
            c.face in _FUSED
            and c.k == 1
            and not c.mapped
            and c.weighted
            and (
                c.reduction == "sum"
                or c.weights == "nan"
                or (c.weights in ("zeros", "negative") and not _partial(c))
            )
            and not _refused(c)
            and not _swamped(c)
        ),
    ),
    Known(
        "issue 20 defect 2",
        "an fp16 buffer overflows in the reduction over devices",
        lambda c: (
            c.mapped and c.dtype == "f16" and c.acc == "none" and c.magnitude == "large"
        ),
    ),
    Known(
        "issue 20 defect 4",
        "device-local aux leaves are taken for rows when their length is the "
        "rows per device",
        lambda c: c.mode == "data_axes" and c.option == "has_aux" and c.dim == ROWS,
    ),
    Known(
        "issue 20 defect 5",
        "float0 gradients crash microbatch with k >= 2, accumulate with the "
        "noise scale, skip_large_updates",
        lambda c: (
            (
                c.face == "microbatch"
                and c.float0
                and (c.k >= 2 or c.mapped)
                # The one combination seen to work: a plain sum into a
                # float32 buffer, on several devices.
                and not (
                    c.mode != "single"
                    and c.acc == "f32"
                    and c.reduction == "sum"
                    and not c.weighted
                )
            )
            or (
                c.stream
                and c.float0
                and c.option in ("noise", "skip_large")
                and not _refused(c)
            )
        ),
    ),
    Known(
        "issue 20 defect 9",
        "data_axes with skip_fn (accumulate, MultiSteps) or noise_scale_decay "
        "(MultiSteps) fails at trace time",
        lambda c: (
            c.stream
            and c.mode == "data_axes"
            and (
                (c.option in _SKIPS and not _refused(c))
                or (
                    c.face == "multisteps"
                    and c.option == "noise"
                    and c.reduction == "mean"
                    and not c.weighted
                )
            )
        ),
    ),
    Known(
        "issue 20 defect 6",
        "skip_fn rejects a weight-0 micro-batch whose gradient is NaN",
        lambda c: (
            c.face == "accumulate"
            and c.option in _SKIPS
            and c.weights == "zeros"
            and (not _partial(c) or c.mapped)
            and c.mode != "data_axes"
        ),
    ),
    Known(
        "issue 20 defect 8",
        "reduction='sum' with data_axes and no weight_fn is devices times the "
        "global view",
        lambda c: (
            c.face in _FUSED
            and c.mode == "data_axes"
            and c.reduction == "sum"
            and not c.weighted
            and not (c.nan_grad and c.face != "microbatch")  # NaN parameters
            and c.k >= 2
            and not _refused(c)
        ),
    ),
    Known(
        "issue 20 defect 10",
        "skip_large_updates under axis_name judges each device's gradient",
        lambda c: c.face == "accumulate" and c.mapped and c.option == "skip_large",
    ),
    Known(
        "issue 20 defect 11",
        "has_updated(MultiStepsState) is True after a rejected mini-step",
        lambda c: (
            c.face == "multisteps"
            and c.option in _SKIPS
            and not _refused(c)
            and _idle_rejections(c) > 0
        ),
    ),
    Known(
        "issue 20 defect 13",
        "a concrete jax.Array weight that is negative is silently rejected",
        lambda c: c.eager and c.weights in ("nan", "negative"),
    ),
    Known(
        "issue 20 defect 14",
        "microbatch's plain bf16 sum loses the mean at large k",
        lambda c: (
            c.face in _FUSED and c.dtype == "bf16" and c.acc == "none" and c.k >= 64
        ),
    ),
)


def defect(cell: Cell) -> Known | None:
    """The first registry entry that matches ``cell``, if any."""
    return next((k for k in KNOWN if k.matches(cell)), None)
