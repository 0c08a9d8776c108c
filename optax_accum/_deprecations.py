# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Renamed public names: one release of thin aliases that warn and name the new one."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def warn(old: str, new: str, stacklevel: int = 3) -> None:
    """A DeprecationWarning saying ``old`` is now ``new``."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new}.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_arguments(
    renames: dict[str, str], name: str | None = None
) -> Callable[[F], F]:
    """Accepts each old keyword ``old=`` as ``renames[old]``, with a warning.

    ``name`` is the function's name in the messages (default its
    ``__name__``). The wrapped function keeps its signature
    (``inspect.signature`` follows ``__wrapped__``). Passing both spellings
    raises a TypeError.
    """

    def decorate(fn: F) -> F:
        shown = name or fn.__name__

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **rename(kwargs, renames, shown, stacklevel=4))

        return wrapper  # type: ignore[return-value]

    return decorate


def rename(
    kwargs: dict[str, Any], renames: dict[str, str], shown: str, stacklevel: int = 4
) -> dict[str, Any]:
    """``kwargs`` with each deprecated key replaced by its new name (warning)."""
    kwargs = dict(kwargs)
    for old, new in renames.items():
        if old not in kwargs:
            continue
        if new in kwargs:
            raise TypeError(
                f"{shown}() got both `{old}` (deprecated) and `{new}`; "
                f"pass only `{new}`."
            )
        warn(f"`{shown}({old}=...)`", f"`{new}=`", stacklevel=stacklevel)
        kwargs[new] = kwargs.pop(old)
    return kwargs


def module_getattr(module: str, aliases: dict[str, tuple[str, Callable[[], Any]]]):
    """A module ``__getattr__`` serving renamed names: ``old -> (new, getter)``."""

    def __getattr__(name: str) -> Any:
        if name in aliases:
            new, get = aliases[name]
            warn(f"`{module}.{name}`", f"`{new}`")
            return get()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
