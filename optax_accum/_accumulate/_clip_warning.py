# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Best effort: a one-time warning for clipping chained before the accumulator.

``optax.chain(optax.clip_by_global_norm(1.0), accumulate(adamw, k))`` clips
every micro-batch, then averages; the large batch clips the average once (the
docs' caveats say so too). At trace time, when ``optax.chain`` calls our
``update``, its frame holds the list of update functions: if a clipping
transformation comes before ours, warn once per process.

Best effort, by design: optax offers no API to see a chain's members, so this
reads ``optax.chain``'s frame locals, a private detail of optax. Any surprise
there (a renamed local, another optax version) means no warning, never an
error, and the caveat in the docs stays the contract. It costs a frame lookup
at trace time only.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

_warned = False


def _is_clipping(update_fn: Any, depth: int = 0) -> bool:
    module = getattr(update_fn, "__module__", "") or ""
    if "clipping" in module.rsplit(".", 1)[-1]:
        return True
    if depth > 1:
        return False
    # optax.with_extra_args_support wraps a plain GradientTransformation in a
    # closure over it.
    for cell in getattr(update_fn, "__closure__", None) or ():
        try:
            inner = getattr(cell.cell_contents, "update", None)
        except ValueError:  # an empty cell
            continue
        if inner is not None and _is_clipping(inner, depth + 1):
            return True
    return False


def warn_if_clipped_before(owner: str) -> None:
    """Warns once if the caller is ``optax.chain`` with clipping before us."""
    global _warned
    if _warned:
        return
    try:
        frame = sys._getframe(2)  # our update_fn's caller
        if frame.f_globals.get("__name__") != "optax.transforms._combining":
            return
        fns, current = frame.f_locals.get("update_fns"), frame.f_locals.get("fn")
        if fns is None or current is None:
            return
        before = list(fns)[: list(fns).index(current)]
        if not any(_is_clipping(f) for f in before):
            return
    except Exception:
        return
    _warned = True
    warnings.warn(
        f"optax.chain runs a clipping transformation before {owner}: it clips "
        "every micro-batch's gradient, then averages, where the large batch "
        "clips the average once. Put the clipping inside: "
        f"{owner}(optax.chain(optax.clip_by_global_norm(...), opt), ...).",
        UserWarning,
        stacklevel=3,
    )
