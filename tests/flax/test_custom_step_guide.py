# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Runs docs/guides/flax_custom_step.md's code cells, as the page shows them.

The page's cells check each custom nnx step against `nnx_train_step` (issue
23, docs: "A custom nnx step"); this test runs them outside the docs build.
"""

from __future__ import annotations

import pathlib
import re

import pytest

pytest.importorskip("flax")

PAGE = pathlib.Path(__file__).parents[2] / "docs" / "guides" / "flax_custom_step.md"
CODE_CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```$", re.S | re.M)


@pytest.mark.slow
def test_custom_nnx_steps_in_the_guide_match_the_helper():
    cells = CODE_CELL.findall(PAGE.read_text())
    assert len(cells) == 5
    namespace: dict = {}
    for cell in cells:
        exec(compile(cell, str(PAGE), "exec"), namespace)
