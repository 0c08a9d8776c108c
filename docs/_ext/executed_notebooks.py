# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""One execution of the notebooks per CI run, shared by the tests and the docs.

``tests/test_notebooks.py`` executes every notebook of ``notebooks/`` with
nbclient. Loaded as a pytest plugin (``.ci/run`` does
``PYTHONPATH=docs/_ext python -m pytest -p executed_notebooks``), this module
keeps each executed copy, outputs included, in
``docs/_build/executed_notebooks/<name>.ipynb``. The docs build
(``docs/conf.py``) renders those copies instead of executing the notebooks a
second time.

A copy counts only while its cells are exactly the stored notebook's (type and
source), so a notebook edited after the test run is executed by the docs build
instead. The plugin recognises a notebook by those cells, not by the test that
runs it, so it keeps working wherever the notebook test lives.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = REPO / "notebooks"
EXECUTED_DIR = REPO / "docs" / "_build" / "executed_notebooks"


def _cells(nb: Any) -> list[tuple[str, str]]:
    return [(cell["cell_type"], cell["source"]) for cell in nb["cells"]]


def stored_notebooks() -> dict[str, Path]:
    """The notebooks of ``notebooks/``, by name (``01_quickstart``)."""
    return {p.stem: p for p in sorted(NOTEBOOKS_DIR.glob("*.ipynb"))}


def _read(path: Path) -> Any:
    import nbformat

    return nbformat.read(path, as_version=4)


def executed_copy(name: str) -> Path | None:
    """The executed copy of notebook ``name``, if it matches the stored one."""
    stored = stored_notebooks().get(name)
    copy = EXECUTED_DIR / f"{name}.ipynb"
    if stored is None or not copy.exists():
        return None
    return copy if _cells(_read(copy)) == _cells(_read(stored)) else None


def save(nb: Any) -> Path | None:
    """Writes an executed notebook as the copy of the stored one it equals."""
    import nbformat

    cells = _cells(nb)
    for name, path in stored_notebooks().items():
        if _cells(_read(path)) == cells:
            EXECUTED_DIR.mkdir(parents=True, exist_ok=True)
            target = EXECUTED_DIR / f"{name}.ipynb"
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            nbformat.write(nb, partial)
            partial.replace(target)  # never a half-written copy
            return target
    return None


# pytest plugin hooks: wrap nbclient's execute so that each notebook that runs
# to the end is saved. A failing notebook raises before `save`, so it leaves
# no copy (and fails its test).
_ORIGINAL_EXECUTE = "_optax_accum_original_execute"


def pytest_configure(config: Any) -> None:
    try:
        from nbclient import NotebookClient
    except ImportError:  # the notebook tests skip themselves too
        return
    if hasattr(NotebookClient, _ORIGINAL_EXECUTE):
        return
    original = NotebookClient.execute

    @functools.wraps(original)
    def execute(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        save(self.nb)
        return result

    setattr(NotebookClient, _ORIGINAL_EXECUTE, original)
    NotebookClient.execute = execute


def pytest_unconfigure(config: Any) -> None:
    try:
        from nbclient import NotebookClient
    except ImportError:
        return
    original = getattr(NotebookClient, _ORIGINAL_EXECUTE, None)
    if original is not None:
        NotebookClient.execute = original
        delattr(NotebookClient, _ORIGINAL_EXECUTE)


def pytest_report_header(config: Any) -> str:
    return f"executed notebooks are saved to {EXECUTED_DIR}"
