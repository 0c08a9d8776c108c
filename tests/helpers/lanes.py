# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The fast lane's share of a parametrized sweep.

``pytest -m "not slow"`` runs each sweep's representative cases; the whole
suite (CI, the README's ``pytest``) runs every case. ``sweep`` keeps that
choice next to the cases, in the test file, where a reader sees it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pytest


def sweep(cases: Iterable[Any], fast: Sequence[Any]) -> list[Any]:
    """``pytest.param``s for ``cases``: those in ``fast`` run in the fast lane.

    Args:
      cases: the sweep's cases, each a value or a tuple of values (one per
        parametrized argument).
      fast: the cases the fast lane keeps; every other case is marked
        ``slow``.

    Returns:
      A list to pass to ``pytest.mark.parametrize``.

    Raises:
      ValueError: if a case in ``fast`` is not one of ``cases``.

    Example:
      >>> [bool(p.marks) for p in sweep([1, 2, 4], fast=[2])]  # marked slow?
      [True, False, True]
    """
    cases = list(cases)
    unknown = [case for case in fast if case not in cases]
    if unknown:
        raise ValueError(f"fast={unknown!r} are not cases of the sweep {cases!r}")
    return [
        pytest.param(
            *(case if isinstance(case, tuple) else (case,)),
            marks=() if case in fast else pytest.mark.slow,
        )
        for case in cases
    ]
