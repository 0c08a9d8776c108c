# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Runs the `Examples:` in every public module's docstrings."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import optax_accum

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(optax_accum.__path__, "optax_accum.")
    if m.name != "optax_accum.__main__"
)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    if name == "optax_accum.flax" or name.startswith("optax_accum.flax."):
        pytest.importorskip("flax")
    if name == "optax_accum._loss_scale":
        pytest.importorskip("jmp")  # the example uses jmp's loss scale
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    assert result.failed == 0
