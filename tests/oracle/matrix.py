# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The cells the tests run: an all-pairs covering array, the cells each defect
needs, and a seeded sample of them for the fast lane.

The full product of the variables is 2,112,000 cells, 741,120 of them
applicable; every pair of values
of any two variables appears in at least one cell of the covering array
(`allpairspy`), leaving out combinations that `table.NOT_APPLICABLE` rules
out.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random

from allpairspy import AllPairs

from . import table
from .cells import KS, PIPELINE_FACES, PRIVACY_FACES, VARIABLES, Cell

FAST = 30  # cells in the fast lane
FAST_PIPELINE = 1  # and of each pipeline face's
FAST_PRIVACY = 2  # and of the privacy face's
SEED = 20


def _admissible(values: list) -> bool:
    """allpairspy's filter, on a partial row: no rule whose variables are all
    set may rule it out."""
    return _admissible_row(dict(zip(VARIABLES, values, strict=False)))


def _admissible_row(row: dict) -> bool:
    for rule in table.NOT_APPLICABLE:
        if all(v in row for v in rule.when) and all(
            row[v] in vals for v, vals in rule.when.items()
        ):
            return False
    return True


def _pairs(row: dict) -> set:
    items = sorted(row.items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


@functools.cache
def feasible_pairs() -> frozenset:
    """Every pair of values some applicable cell holds. The rules constrain
    only face, option and mode, so it is enough to enumerate those."""
    out: set = set()
    free = {v: VARIABLES[v] for v in VARIABLES if v not in ("face", "option", "mode")}
    for face, option, mode in itertools.product(
        VARIABLES["face"], VARIABLES["option"], VARIABLES["mode"]
    ):
        if not _admissible_row({"face": face, "option": option, "mode": mode}):
            continue
        fixed = {"face": face, "option": option, "mode": mode}
        out |= _pairs(fixed)
        for var, values in free.items():
            for value in values:
                out |= {tuple(sorted(((var, value), f))) for f in fixed.items()}
    for (a, va), (b, vb) in itertools.combinations(free.items(), 2):
        out |= {tuple(sorted(((a, x), (b, y)))) for x in va for y in vb}
    return frozenset(out)


def _complete(cells: list[dict]) -> list[dict]:
    """allpairspy's filter can leave pairs out: add rows, greedily, until
    every feasible pair is covered."""
    missing = set(feasible_pairs())
    for row in cells:
        missing -= _pairs(row)
    while missing:
        (a, va), (b, vb) = min(missing, key=repr)
        row = {a: va, b: vb}
        for var in VARIABLES:
            if var not in row:
                row[var] = _best_value(row, var, missing)
        cells.append(row)
        missing -= _pairs(row)
    return cells


def _best_value(row: dict, var: str, missing: set) -> object:
    """The admissible value of ``var`` that covers most missing pairs."""
    ok = [v for v in VARIABLES[var] if _admissible_row({**row, var: v})]
    return max(ok, key=lambda v: len(_pairs({**row, var: v}) & missing))


@functools.cache
def covering() -> tuple[Cell, ...]:
    """Every feasible pair of values in at least one cell."""
    order = list(VARIABLES)
    rows = AllPairs(list(VARIABLES.values()), filter_func=_admissible)
    cells = [dict(zip(order, r, strict=True)) for r in rows]
    return tuple(Cell(**row) for row in _complete(cells))


def _c(face, mode, reduction, weights, k, dtype, acc, option, inner="sgd", **kw):
    return Cell(face, mode, reduction, weights, k, dtype, acc, option, inner, **kw)


# What each defect of issue 20 needs (section 2 numbers; 0 is section 1).
EXPLICIT = (
    # 0: a value-and-grad fun's own (clipped) gradients, weighted, global view.
    _c("microbatch", "global", "mean", "counts", 2, "f32", "promote", "clip"),
    # 1: k = 1 ignores weight_fn in the global view.
    _c("microbatch", "global", "sum", "counts", 1, "f32", "promote", "none"),
    _c("microbatch", "single", "mean", "zeros", 1, "f32", "promote", "none"),
    # 2: an fp16 buffer overflows in the reduction over devices.
    _c(
        "accumulate",
        "axis_name",
        "mean",
        "counts",
        2,
        "f16",
        "none",
        "none",
        magnitude="large",
    ),
    _c(
        "microbatch",
        "axis_name",
        "mean",
        "none",
        8,
        "f16",
        "none",
        "none",
        magnitude="large",
    ),
    # 4: device-local aux guessed row-wise by its shape.
    _c(
        "microbatch", "data_axes", "mean", "none", 2, "f32", "promote", "has_aux", dim=2
    ),
    # 5: float0 gradients with k >= 2, with the noise scale, skip_large_updates.
    _c("microbatch", "single", "mean", "none", 2, "f32", "promote", "float0"),
    _c("accumulate", "single", "mean", "none", 2, "f32", "promote", "float0"),
    _c(
        "accumulate",
        "single",
        "mean",
        "none",
        2,
        "f32",
        "promote",
        "noise",
        int_param=True,
    ),
    _c(
        "accumulate",
        "single",
        "mean",
        "none",
        2,
        "f32",
        "promote",
        "skip_large",
        int_param=True,
    ),
    # 6: skip_fn rejects a weight-0 micro-batch whose gradient is NaN.
    _c("accumulate", "single", "mean", "zeros", 3, "f32", "promote", "skip_fn"),
    # oracle-1: the noise scale with float64 gradients.
    _c("accumulate", "single", "mean", "none", 2, "f64", "promote", "noise"),
    _c("multisteps", "global", "mean", "none", 3, "f64", "none", "noise"),
    _c("microbatch", "single", "mean", "none", 2, "f64", "promote", "noise"),
    # oracle-2: k = 1 and rng_argnums.
    _c("microbatch", "single", "mean", "none", 1, "f32", "promote", "rng"),
    _c("microbatch", "data_axes", "mean", "none", 1, "f32", "promote", "rng"),
    _c("linen", "single", "mean", "none", 1, "f32", "promote", "rng"),
    # The weight contract's range: weights of 2**100 and 2**-100 are honoured.
    _c(
        "accumulate",
        "axis_name",
        "mean",
        "counts",
        3,
        "f32",
        "promote",
        "none",
        magnitude="heavy",
    ),
    _c(
        "multisteps",
        "single",
        "sum",
        "none",
        2,
        "bf16",
        "none",
        "none",
        magnitude="heavy",
    ),
    _c(
        "microbatch",
        "data_axes",
        "sum",
        "counts",
        2,
        "bf16",
        "promote",
        "none",
        magnitude="heavy",
    ),
    _c(
        "microbatch",
        "global",
        "mean",
        "counts",
        3,
        "f16",
        "none",
        "noise",
        magnitude="light",
    ),
    _c(
        "linen",
        "single",
        "mean",
        "counts",
        2,
        "f32",
        "promote",
        "none",
        magnitude="light",
    ),
    # oracle-3: data_axes at k = 1, a bad weight on one device's rows.
    _c(
        "microbatch",
        "data_axes",
        "mean",
        "negative",
        1,
        "f32",
        "promote",
        "none",
        bad_device=True,
    ),
    _c(
        "linen",
        "data_axes",
        "mean",
        "negative",
        1,
        "f32",
        "promote",
        "has_aux",
        bad_device=True,
    ),
    # 8: data_axes sum without weights.
    _c("microbatch", "data_axes", "sum", "none", 2, "f32", "promote", "none"),
    # 9: data_axes with skip_fn (accumulate), noise (MultiSteps).
    _c("accumulate", "data_axes", "mean", "none", 2, "f32", "promote", "skip_fn"),
    _c("accumulate", "data_axes", "mean", "none", 2, "f32", "promote", "skip_large"),
    _c("multisteps", "data_axes", "mean", "none", 2, "f32", "promote", "noise"),
    # 10: skip_large_updates per device under axis_name.
    _c("accumulate", "axis_name", "mean", "none", 2, "f32", "promote", "skip_large"),
    # 11: MultiSteps' has_updated after a rejected mini-step.
    _c(
        "multisteps",
        "single",
        "mean",
        "none",
        2,
        "f32",
        "promote",
        "skip_fn",
        nan_grad=True,
    ),
    # 12: microbatch k = 1 with the noise scale and no axis_name.
    _c("microbatch", "single", "mean", "none", 1, "f32", "promote", "noise"),
    # 13: a concrete negative weight.
    _c(
        "accumulate",
        "single",
        "mean",
        "negative",
        2,
        "f32",
        "promote",
        "none",
        eager=True,
    ),
    # 14: a bf16 buffer at k = 1024 on both faces.
    _c("microbatch", "single", "mean", "none", 1024, "bf16", "none", "none"),
    _c("accumulate", "single", "mean", "none", 1024, "bf16", "none", "none"),
    # Issue 28: the pipeline's schedules. A padding micro-batch, a rejected
    # weight, a data shard with no token, bf16, x64, keys and aux per data
    # shard, the weighted sum.
    _c("pipe-gpipe", "single", "mean", "zeros", 8, "f32", "promote", "none"),
    _c("pipe-1f1b", "single", "mean", "negative", 2, "f32", "promote", "none"),
    _c("pipe-circular", "single", "mean", "nan", 2, "f32", "promote", "none"),
    _c(
        "pipe-gpipe",
        "data_axes",
        "mean",
        "zeros",
        2,
        "f32",
        "promote",
        "none",
        bad_device=True,
    ),
    _c("pipe-1f1b", "data_axes", "mean", "nan", 2, "f32", "promote", "none"),
    _c("pipe-gpipe", "single", "mean", "none", 8, "bf16", "promote", "none"),
    _c("pipe-1f1b", "single", "mean", "counts", 8, "bf16", "none", "none"),
    _c("pipe-circular", "single", "mean", "counts", 2, "f64", "promote", "none"),
    _c("pipe-1f1b", "data_axes", "mean", "none", 2, "f32", "promote", "rng"),
    _c("pipe-gpipe", "data_axes", "mean", "counts", 2, "f32", "promote", "has_aux"),
    _c("pipe-1f1b", "single", "sum", "counts", 3, "f32", "promote", "none"),
    # The same for interleaved 1F1B (repeats 2: k a multiple of S = 2) and
    # ZB-H1, merged after the semantics work.
    *(
        _c(face, mode, red, w, k, dt, acc, opt, bad_device=bad)
        for face, k3 in (("pipe-interleaved", 8), ("pipe-zb", 3))
        for mode, red, w, k, dt, acc, opt, bad in (
            ("single", "mean", "zeros", 8, "f32", "promote", "none", False),
            ("single", "mean", "negative", 2, "f32", "promote", "none", False),
            ("single", "mean", "nan", 2, "f32", "promote", "none", False),
            ("data_axes", "mean", "zeros", 2, "f32", "promote", "none", True),
            ("data_axes", "mean", "nan", 2, "f32", "promote", "none", False),
            ("single", "mean", "none", 8, "bf16", "promote", "none", False),
            ("single", "mean", "counts", 8, "bf16", "none", "none", False),
            ("single", "mean", "counts", 2, "f64", "promote", "none", False),
            ("data_axes", "mean", "none", 2, "f32", "promote", "rng", False),
            ("data_axes", "mean", "counts", 2, "f32", "promote", "has_aux", False),
            ("single", "sum", "counts", k3, "f32", "promote", "none", False),
        )
    ),
)


# The privacy face's variables: it sums (reduction), in the promoted dtype
# (acc), and ignores the inner optimizer (dp_accumulate runs it).
PRIVACY_VARIABLES = {
    "mode": ("single", "global", "axis_name", "pmap"),
    "weights": ("none", "zeros"),
    "k": KS,
    "dtype": VARIABLES["dtype"],
    "nan_grad": (False, True),
    "bad_device": (False, True),
}
PRIVACY_EXPLICIT = (
    # A device whose part of a micro-batch is all padding skips it (lax.cond
    # per device); the other devices' parts count.
    _c("privacy", "axis_name", "sum", "zeros", 2, "f32", "promote", "none",
       bad_device=True, nan_grad=True),
    # k = 1: the only micro-batch of the first call is all padding.
    _c("privacy", "global", "sum", "zeros", 1, "f64", "promote", "none"),
    # Refused by name: weights, integer parameters.
    _c("privacy", "single", "sum", "counts", 2, "f32", "promote", "none"),
    _c("privacy", "axis_name", "sum", "nan", 3, "bf16", "promote", "none"),
    _c("privacy", "global", "sum", "none", 2, "f32", "promote", "float0"),
    # NaN examples (real, not padding): their entries count as 0.
    _c("privacy", "single", "sum", "none", 8, "bf16", "promote", "none", nan_grad=True),
)  # fmt: skip


@functools.cache
def privacy_cells() -> tuple[Cell, ...]:
    """The privacy face's all-pairs cells over `PRIVACY_VARIABLES`, and
    `PRIVACY_EXPLICIT`."""
    order = list(PRIVACY_VARIABLES)
    rows = AllPairs(list(PRIVACY_VARIABLES.values()))
    cells = [
        Cell(face=PRIVACY_FACES[0], reduction="sum", acc="promote",
             option="none", **dict(zip(order, r, strict=True)))
        for r in rows
    ]  # fmt: skip
    return tuple(dict.fromkeys((*cells, *PRIVACY_EXPLICIT)))


def twins() -> tuple[Cell, ...]:
    """Each covering cell again with other values only (another seed, the
    NaN rows and the device of the bad pattern flipped): the same structure,
    so no new compilation."""
    return tuple(
        dataclasses.replace(
            c, seed=1, nan_grad=not c.nan_grad, bad_device=not c.bad_device
        )
        for c in covering()
    )


@functools.cache
def all_cells() -> tuple[Cell, ...]:
    seen, out = set(), []
    for cell in (*covering(), *EXPLICIT, *twins(), *privacy_cells()):
        if cell not in seen and table.applicable(cell):
            seen.add(cell)
            out.append(cell)
    return tuple(out)


@functools.cache
def fast() -> tuple[Cell, ...]:
    """A seeded sample, without the k = 1024 cells; each pipeline face
    sampled apart (`FAST_PIPELINE` cells of each, its schedules being the
    slowest cells), so that the fast lane always holds every schedule."""
    pool = [
        c
        for c in all_cells()
        if c.k <= 8 and not c.pipeline and c.face not in PRIVACY_FACES
    ]
    pipes = [
        random.Random(SEED).sample(
            [c for c in all_cells() if c.face == face], FAST_PIPELINE
        )
        for face in PIPELINE_FACES
    ]
    chosen = random.Random(SEED).sample(pool, FAST)
    private = random.Random(SEED).sample(privacy_cells(), FAST_PRIVACY)
    return tuple(chosen + list(itertools.chain.from_iterable(pipes)) + private)


def slow() -> tuple[Cell, ...]:
    chosen = set(fast())
    return tuple(c for c in all_cells() if c not in chosen)
