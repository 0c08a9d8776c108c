# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The docs' compatibility table, rendered from `table` (the tests' own).

For each face (rows) and device mode (columns), which options work: an
option is listed as refused where `table.REFUSED` refuses it for every cell
of that face and mode, as conditional where it refuses it for some (the
note says which), and is absent where it does not apply.
"""

from __future__ import annotations

import itertools

from . import table
from .cells import FACES, MODES, VARIABLES, Cell

FACE_NAMES = {
    "accumulate": "`accumulate`",
    "multisteps": "`MultiSteps`",
    "microbatch": "`microbatch` (value-and-grad `fun`)",
    "loss": "`microbatch_value_and_grad` (loss)",
    "nnx": "`flax.nnx_train_step`",
    "linen": "`flax.linen_train_step`",
}
MODE_NAMES = {
    "single": "one device",
    "global": "global view (8 devices)",
    "axis_name": "`axis_name` (shard_map)",
    "data_axes": "`data_axes`",
}
OPTION_NAMES = {
    "none": "plain",
    "skip_fn": "`skip_fn`",
    "skip_large": "`skip_large_updates`",
    "noise": "`noise_scale_decay`",
    "has_aux": "`has_aux`",
    "rng": "`rng_argnums`",
    "float0": "integer params (`float0`)",
    "close": "`close_window`",
    "schedule": "k schedule",
    "clip": "`fun` post-processes grads",
    "weights": "weights",
}
_REST = ("reduction", "weights", "k", "dtype", "acc", "inner")


def _cells(face: str, mode: str, option: str):
    for values in itertools.product(*(VARIABLES[v] for v in _REST)):
        yield Cell(face, mode, option=option, **dict(zip(_REST, values, strict=True)))


def _status(face: str, mode: str, option: str) -> str:
    cells = [c for c in _cells(face, mode, option) if table.applicable(c)]
    if not cells:
        return ""
    refused = [c for c in cells if table.refusal(c) is not None]
    if not refused:
        return "yes"
    if len(refused) == len(cells):
        return "refused"
    reasons = sorted({table.refusal(c).why for c in refused})
    return "yes, except: " + "; ".join(reasons)


def _weights(face: str, mode: str) -> str:
    cells = [c for c in _cells(face, mode, "none") if table.applicable(c)]
    if not cells:
        return ""
    weighted = [c for c in cells if c.weighted]
    refused = [c for c in weighted if table.refusal(c) is not None]
    return "refused" if refused and len(refused) == len(weighted) else "yes"


def markdown() -> str:
    """A Markdown table: one row per face, one column per mode; each cell
    lists the options that work there (and how the others are refused)."""
    head = "| face | " + " | ".join(MODE_NAMES[m] for m in MODES) + " |"
    lines = [head, "|" + " --- |" * (len(MODES) + 1)]
    for face in FACES:
        row = [FACE_NAMES[face]]
        for mode in MODES:
            row.append(_entry(face, mode))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _entry(face: str, mode: str) -> str:
    parts = []
    for option in VARIABLES["option"]:
        status = _status(face, mode, option)
        if status:
            parts.append(f"{OPTION_NAMES[option]}: {status}")
    if not parts:
        return "not covered"
    weights = _weights(face, mode)
    parts.append(f"{OPTION_NAMES['weights']}: {weights}")
    return "<br>".join(parts)
