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

_ParameterSet = type(pytest.param(None))


def _values(case: Any) -> tuple[Any, ...]:
    if isinstance(case, _ParameterSet):
        return tuple(case.values)
    return case if isinstance(case, tuple) else (case,)


def sweep(cases: Iterable[Any], fast: Sequence[Any]) -> list[Any]:
    """``pytest.param``s for ``cases``: those in ``fast`` run in the fast lane.

    Args:
      cases: the sweep's cases, each a value, a tuple of values (one per
        parametrized argument) or a ``pytest.param``, whose marks and id it
        keeps.
      fast: the cases the fast lane keeps, by value; every other case is
        marked ``slow``.

    Returns:
      A list to pass to ``pytest.mark.parametrize``.

    Raises:
      ValueError: if a case in ``fast`` is not one of ``cases``.

    Example:
      >>> [bool(p.marks) for p in sweep([1, 2, 4], fast=[2])]  # marked slow?
      [True, False, True]
    """
    cases = list(cases)
    keys = [_values(case) for case in cases]
    fast_keys = [_values(case) for case in fast]
    unknown = [
        case for case, key in zip(fast, fast_keys, strict=True) if key not in keys
    ]
    if unknown:
        raise ValueError(f"fast={unknown!r} are not cases of the sweep {cases!r}")
    return [
        pytest.param(
            *key,
            marks=[
                *getattr(case, "marks", ()),
                *(() if key in fast_keys else (pytest.mark.slow,)),
            ],
            id=getattr(case, "id", None),
        )
        for case, key in zip(cases, keys, strict=True)
    ]
