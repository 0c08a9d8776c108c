# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""README.md: every ``python`` block runs as pasted, and the page stays short.

Sybil (its Markdown ``PythonCodeBlockParser``) finds the blocks and evaluates
them. Each block is one test, run in this process (tests/conftest.py gives 8
CPU devices) in a fresh, empty working directory and a fresh namespace: the
document is parsed again for every block, so no block sees another's names.
A block must not change JAX's configuration or leave a mesh set, which would
leak into the tests that run after it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import jax
import pytest
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser

README = Path(__file__).resolve().parents[1] / "README.md"
MAX_LINES = 250

_SYBIL = Sybil(parsers=[PythonCodeBlockParser()])
# The opening line of every fenced block (``` or ~~~) and its info string.
_FENCE = re.compile(r"^(`{3,}|~{3,})[ \t]*([^\n`]*)$", re.MULTILINE)


def _block_lines() -> list[int]:
    return [example.line for example in _SYBIL.parse(README).examples()]


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """An empty working directory; JAX's config, mesh and os.environ checked."""
    monkeypatch.chdir(tmp_path)
    config = dict(jax.config.values)
    environ = dict(os.environ)
    yield tmp_path
    changed = sorted(k for k, v in jax.config.values.items() if config.get(k) != v)
    for name in changed:  # put it back before failing, so later tests are clean
        jax.config.update(name, config[name])
    os.environ.clear()
    os.environ.update(environ)
    assert not changed, f"the block changed JAX's configuration: {changed}"
    assert jax.sharding.get_abstract_mesh().empty, "the block left a mesh set"


@pytest.mark.parametrize("line", _block_lines(), ids=lambda line: f"line{line}")
def test_python_block_runs(line, isolated):
    assert jax.device_count() == 8 and jax.default_backend() == "cpu"
    document = _SYBIL.parse(README)  # a fresh namespace for this block alone
    document.namespace["__name__"] = "__main__"
    (example,) = [e for e in document.examples() if e.line == line]
    example.evaluate()


def test_every_python_block_is_collected():
    # A block tagged ```py, ```python3 or ```Python would be skipped silently.
    text = README.read_text(encoding="utf-8")
    infos = [m.group(2).strip() for m in _FENCE.finditer(text)]
    opening = infos[0::2]  # fences alternate: opening, closing
    assert all(info == "" for info in infos[1::2]), infos
    pythonish = [i for i in opening if i.split()[:1] and "py" in i.split()[0].lower()]
    assert pythonish == ["python"] * len(pythonish), pythonish
    assert len(_block_lines()) == len(pythonish) >= 3


def test_readme_is_at_most_250_lines():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines (at most {MAX_LINES})"


def test_relative_links_resolve():
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:|#", t)]
    assert local, "README.md links to no file of the repository"
    missing = [t for t in local if not (README.parent / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_the_wheel_lane_runs_every_block():
    """.ci/readme_blocks.py (the wheel lane's runner of the quickstarts) finds
    the same blocks as this test's Sybil, so the installed wheel runs them all."""
    import importlib.util

    path = README.parent / ".ci" / "readme_blocks.py"
    spec = importlib.util.spec_from_file_location("readme_blocks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = module._BLOCK.findall(README.read_text())
    parsed = [str(ex.parsed) for ex in _SYBIL.parse(README).examples()]
    assert len(found) == len(parsed) >= 3
    assert [b.strip() for b in found] == [p.strip() for p in parsed]
