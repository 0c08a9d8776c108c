# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The docs' compatibility table, rendered from `table` (the tests' own).

One row per face and option, one column per device mode. An entry is "yes"
where no rule of `table.REFUSED` refuses it, "refused" where one refuses it
whatever the other variables, and "yes (condition)" where rules refuse some
values of the other variables (their ``short`` condition); a row or mode the
oracle does not drive is "—". Options are judged without weights; the
"weights" row judges weights with no option. The pipeline's "one device" is
its stage axis alone (no data axes); ``rng_argnums`` is its ``rng``.
"""

from __future__ import annotations

import itertools

from . import table
from .cells import FACES, MODES, PRIVACY_FACES, VARIABLES, Cell

FACE_NAMES = {
    "accumulate": "`accumulate`",
    "multisteps": "`MultiSteps`",
    "microbatch": "`microbatch`",
    "loss": "`microbatch_value_and_grad`",
    "nnx": "`nnx_train_step`",
    "linen": "`linen_train_step`",
    "pipe-gpipe": '`pipeline.value_and_grad` (`"gpipe"`)',
    "pipe-1f1b": '`pipeline.value_and_grad` (`"1f1b"`)',
    "pipe-circular": '`pipeline.value_and_grad` (`"circular"`)',
    "pipe-interleaved": '`pipeline.value_and_grad` (`"interleaved_1f1b"`)',
    "pipe-zb": '`pipeline.value_and_grad` (`"zb_h1"`)',
    "privacy": "`privacy.clipped_value_and_grad`",
}
MODE_NAMES = {
    "single": "one device",
    "global": "global view",
    "axis_name": "`axis_name` (shard_map)",
    "pmap": "`axis_name` (pmap)",
    "data_axes": "`data_axes`",
}
OPTION_NAMES = {
    "none": "plain",
    "skip_fn": "`skip_fn`",
    "skip_large": "`skip_large_updates`",
    "noise": "`noise_scale_decay`",
    "has_aux": "`has_aux`",
    "rng": "`rng_argnums`",
    "float0": "integer parameters",
    "close": "`close_window`",
    "schedule": "a schedule of k",
    "clip": "`fun` that edits its gradients",
}
_REST = ("reduction", "k", "dtype", "acc", "inner")


def _cells(face: str, mode: str, option: str, weights: tuple[str, ...]):
    for values in itertools.product(weights, *(VARIABLES[v] for v in _REST)):
        row = dict(zip(("weights", *_REST), values, strict=True))
        cell = Cell(face, mode, option=option, **row)
        if table.applicable(cell):
            yield cell


def status(face: str, mode: str, option: str, weighted: bool = False) -> str:
    """ "yes", "refused", "yes (conditions)", or "" (not applicable)."""
    weights = VARIABLES["weights"][1:] if weighted else ("none",)
    cells = list(_cells(face, mode, option, weights))
    if not cells:
        return ""
    refused = [table.refusal(c) for c in cells]
    if not any(refused):
        return "yes"
    if all(refused):
        return "refused"
    return "yes (" + ", ".join(sorted({r.short for r in refused if r})) + ")"


def markdown() -> str:
    """The table, in Markdown."""
    head = "| face | option | " + " | ".join(MODE_NAMES[m] for m in MODES) + " |"
    lines = [head, "|" + " --- |" * (len(MODES) + 2)]
    for face in (*FACES, *PRIVACY_FACES):
        rows = [(OPTION_NAMES[o], o, False) for o in VARIABLES["option"]]
        rows.append(("weights", "none", True))
        for name, option, weighted in rows:
            entries = [status(face, m, option, weighted) for m in MODES]
            if any(entries):
                cells = [e or "—" for e in entries]
                lines.append(
                    f"| {FACE_NAMES[face]} | {name} | " + " | ".join(cells) + " |"
                )
    return "\n".join(lines) + "\n"
