# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Sphinx extension: the pages that the docs build generates before reading.

On ``config-inited`` it writes, under the source folder (all of it ignored by
git and rewritten on every build):

* ``api/modules/<module>.rst``: one page per documented module, listing every
  name of the module's ``__all__`` in an ``autosummary`` table; autosummary
  then writes one page per name into ``api/generated/`` (emptied first). A
  module that does not exist (``optax_accum.distributed`` before it is added)
  is skipped with a note in the build log; any other import error fails the
  build. A module without ``__all__`` (``optax_accum.flax`` today) gets the
  public functions and classes it defines, with a note in the log.
* ``notebooks/<name>.ipynb``: the notebooks of ``notebooks/``. Where the test
  run left an executed copy of a notebook (see `executed_notebooks`), that copy
  is rendered as it is and excluded from execution; the others are executed
  by myst-nb.
* ``_benchmark_results.md``, included by ``benchmarks.md`` (and beside it,
  so that the images' relative paths mean the same to both): an ``include``
  of every ``benchmarks/results/*.md``, and an image for every results PNG
  that no included file shows.
"""

from __future__ import annotations

import importlib
import inspect
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import executed_notebooks
from sphinx.util import logging

LOGGER = logging.getLogger(__name__)
REPO = executed_notebooks.REPO
API_MODULES = (
    "optax_accum",
    "optax_accum.flax",
    "optax_accum.distributed",
    "optax_accum.pipeline",
    "optax_accum.privacy",
)
# Set (to anything but "" or "0") where the notebooks must come from the test
# run, as on CI: a missing or outdated copy then fails the build instead of
# being executed a second time.
REQUIRE_EXECUTED = "OPTAX_ACCUM_DOCS_REQUIRE_EXECUTED_NOTEBOOKS"
BENCHMARK_RESULTS = "_benchmark_results.md"


def _write(path: Path, text: str) -> None:
    """Writes ``text`` unless the file holds it already (keeps Sphinx's mtimes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _public_names(module: ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    # No `__all__`: the public functions and classes the module defines.
    names = sorted(
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and obj.__module__ == module.__name__
    )
    LOGGER.info(
        f"API: {module.__name__} has no __all__; documenting the public "
        f"functions and classes it defines: {', '.join(names)}"
    )
    return names


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:  # the module exists but one of its imports is missing
            raise
        LOGGER.info(f"API: skipping {name}: no such module in this version")
        return None


def _documented_names(modules: list[ModuleType]) -> dict[str, list[str]]:
    """The names to document per module: each object once, in the deepest module.

    An object exported by two modules (a name kept at the top level for a
    release after it moved to a submodule) gets one page, under the submodule:
    two would describe one class twice, which Sphinx reports.
    """
    listed: dict[str, list[tuple[str, Any]]] = {}
    owner: dict[int, str] = {}
    for module in modules:
        listed[module.__name__] = [
            (n, getattr(module, n, None)) for n in _public_names(module)
        ]
    for name, items in listed.items():
        for _, obj in items:
            current = owner.get(id(obj))
            if current is None or name.count(".") > current.count("."):
                owner[id(obj)] = name
    names: dict[str, list[str]] = {}
    for name, items in listed.items():
        names[name] = []
        for attr, obj in items:
            if owner[id(obj)] == name:
                names[name].append(attr)
            else:
                LOGGER.info(
                    f"API: {name}.{attr} is {owner[id(obj)]}.{attr}; documented "
                    "there only"
                )
    return names


def write_api_pages(srcdir: Path) -> list[str]:
    """Writes ``api/modules/<module>.rst`` for each module; their names."""
    folder = srcdir / "api" / "modules"
    modules = [m for m in map(_import, API_MODULES) if m is not None]
    documented = _documented_names(modules)
    for name, names in documented.items():
        title = f"``{name}``"
        lines = [
            title,
            "=" * len(title),
            "",
            f".. automodule:: {name}",
            "   :no-members:",
            "",
            f".. currentmodule:: {name}",
            "",
            ".. autosummary::",
            "   :toctree: ../generated",
            "   :nosignatures:",
            "",
            *(f"   {n}" for n in names),
            "",
        ]
        _write(folder / f"{name}.rst", "\n".join(lines))
    for stale in folder.glob("*.rst"):
        if stale.stem not in documented:
            stale.unlink()
    LOGGER.info(f"API: pages for {', '.join(documented)}")
    return list(documented)


def stage_notebooks(srcdir: Path) -> list[str]:
    """Copies the notebooks into ``notebooks/``; the exclude patterns for myst-nb."""
    folder = srcdir / "notebooks"
    folder.mkdir(parents=True, exist_ok=True)
    stored = executed_notebooks.stored_notebooks()
    required = os.environ.get(REQUIRE_EXECUTED, "") not in ("", "0")
    excluded, missing = [], []
    for name, path in stored.items():
        copy = executed_notebooks.executed_copy(name)
        if copy is None:
            missing.append(name)
        else:
            excluded.append(f"notebooks/{name}.ipynb")
        source = path if copy is None else copy
        target = folder / f"{name}.ipynb"
        if not target.exists() or target.read_bytes() != source.read_bytes():
            shutil.copyfile(source, target)
    for stale in folder.glob("*.ipynb"):
        if stale.stem not in stored:
            stale.unlink()
    if missing and required:
        raise RuntimeError(
            f"{REQUIRE_EXECUTED} is set, but these notebooks have no up-to-date "
            f"executed copy in {executed_notebooks.EXECUTED_DIR}: "
            f"{', '.join(missing)}. Run the notebook tests first with "
            "`PYTHONPATH=docs/_ext python -m pytest -p executed_notebooks "
            "tests/test_notebooks.py`."
        )
    LOGGER.info(
        "notebooks: rendered from the test run's executed copies: "
        f"{', '.join(n.split('/')[-1] for n in excluded) or 'none'}; "
        f"executed by this build: {', '.join(missing) or 'none'}"
    )
    return excluded


def write_benchmark_results(srcdir: Path) -> None:
    """Writes ``_benchmark_results.md`` from ``benchmarks/results/``."""
    results = REPO / "benchmarks" / "results"
    target = srcdir / BENCHMARK_RESULTS
    rel = os.path.relpath(results, srcdir)
    parts, shown = [], set()
    for md in sorted(results.glob("*.md")):
        text = md.read_text()
        shown |= {png.name for png in results.glob("*.png") if png.name in text}
        parts += [
            f"## `benchmarks/results/{md.name}`",
            "",
            f"```{{include}} {rel}/{md.name}",
            ":relative-images:",
            ":heading-offset: 1",
            "```",
            "",
        ]
    for png in sorted(p for p in results.glob("*.png") if p.name not in shown):
        parts += [
            f"## `benchmarks/results/{png.name}`",
            "",
            f"![benchmarks/results/{png.name}]({rel}/{png.name})",
            "",
        ]
    _write(target, "\n".join(parts))


def _prepare(app: Any, config: Any) -> None:
    srcdir = Path(app.srcdir)
    # autosummary rewrites its pages but never deletes one: a renamed name's
    # old page would be left outside every toctree (a warning, so an error).
    shutil.rmtree(srcdir / "api" / "generated", ignore_errors=True)
    write_api_pages(srcdir)
    config.nb_execution_excludepatterns = stage_notebooks(srcdir)
    write_benchmark_results(srcdir)


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    # A NamedTuple's fields are documented by its `Attributes:` section;
    # autodoc would add each again as "Alias for field number N".
    if what == "class" and type(obj).__name__ == "_tuplegetter":
        return True
    return None


def setup(app: Any) -> dict[str, Any]:
    app.connect("config-inited", _prepare)
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
