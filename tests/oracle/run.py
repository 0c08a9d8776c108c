# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""One cell, end to end: refused as the table says, or equal to the model."""

from __future__ import annotations

import pytest

from . import adapt_loop, adapt_stream, compare, data, expect, table
from .cells import PRIVACY_FACES, Cell


def _adapter(cell: Cell):
    if cell.face in PRIVACY_FACES:
        from . import adapt_privacy

        return adapt_privacy.run
    if cell.stream:
        return adapt_stream.run
    if cell.face in ("nnx", "linen"):
        from . import adapt_flax  # flax is optional

        return adapt_flax.run
    return adapt_loop.run


def run_cell(cell: Cell) -> None:
    """Asserts the cell's contract (see `table`)."""
    inputs = data.build(cell)
    run = _adapter(cell)
    rules = table.refusals(cell)
    if rules:
        with pytest.raises((ValueError, TypeError)) as info:
            run(cell, inputs)
        message = str(info.value)
        named = [r for r in rules if all(n in message for n in r.names)]
        wanted = " or ".join(repr(r.names) for r in rules)
        assert named, f"refused without naming {wanted}: {message!r}"
        return
    got = run(cell, inputs)
    if cell.face in PRIVACY_FACES:
        want = expect.privacy(cell, inputs)
    elif cell.stream:
        want = expect.stream(cell, inputs)
    else:
        want = expect.loop(cell, inputs)
    compare.check(cell, got, want)
