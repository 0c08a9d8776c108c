# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The docs build's own code (docs/_ext): notebook copies, API pages, results,
and the HLO census the guides call.

The notebooks are executed once per CI run, by the notebook tests; the docs
build renders the executed copies only while they match the stored notebooks.
The API pages come from each module's ``__all__``, skip a module that does not
exist, and give each object one page.
"""

from __future__ import annotations

import logging
import sys
import textwrap
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("sphinx")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "_ext"))
import executed_notebooks  # noqa: E402
import optax_accum_docs  # noqa: E402


def _notebook(source: str, output: str | None = None):
    cell = nbformat.v4.new_code_cell(source)
    if output is not None:
        cell.outputs = [nbformat.v4.new_output("stream", text=output)]
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# t"), cell])


@pytest.fixture
def folders(tmp_path, monkeypatch):
    stored, executed = tmp_path / "notebooks", tmp_path / "executed"
    stored.mkdir()
    monkeypatch.setattr(executed_notebooks, "NOTEBOOKS_DIR", stored)
    monkeypatch.setattr(executed_notebooks, "EXECUTED_DIR", executed)
    return stored, executed


def test_executed_copy_is_kept_while_it_matches(folders):
    stored, executed = folders
    nbformat.write(_notebook("print(1)"), stored / "01_a.ipynb")
    nbformat.write(_notebook("print(2)"), stored / "02_b.ipynb")
    assert executed_notebooks.executed_copy("01_a") is None

    path = executed_notebooks.save(_notebook("print(1)", output="1\n"))
    assert path == executed / "01_a.ipynb"
    assert executed_notebooks.executed_copy("01_a") == path
    assert nbformat.read(path, as_version=4).cells[1].outputs[0].text == "1\n"
    assert executed_notebooks.executed_copy("02_b") is None

    # An edited notebook no longer matches its copy: the docs build runs it.
    nbformat.write(_notebook("print(10)"), stored / "01_a.ipynb")
    assert executed_notebooks.executed_copy("01_a") is None


def test_a_notebook_of_no_stored_pair_is_not_saved(folders):
    stored, executed = folders
    nbformat.write(_notebook("print(1)"), stored / "01_a.ipynb")
    assert executed_notebooks.save(_notebook("print(3)", output="3\n")) is None
    assert not executed.exists()


def test_stage_notebooks_excludes_only_matching_copies(folders, tmp_path, monkeypatch):
    stored, _ = folders
    nbformat.write(_notebook("print(1)"), stored / "01_a.ipynb")
    nbformat.write(_notebook("print(2)"), stored / "02_b.ipynb")
    executed_notebooks.save(_notebook("print(1)", output="1\n"))
    srcdir = tmp_path / "docs"
    monkeypatch.delenv(optax_accum_docs.REQUIRE_EXECUTED, raising=False)
    assert optax_accum_docs.stage_notebooks(srcdir) == ["notebooks/01_a.ipynb"]
    staged = nbformat.read(srcdir / "notebooks" / "01_a.ipynb", as_version=4)
    assert staged.cells[1].outputs  # the executed copy
    assert (srcdir / "notebooks" / "02_b.ipynb").exists()  # to be executed

    monkeypatch.setenv(optax_accum_docs.REQUIRE_EXECUTED, "1")
    with pytest.raises(RuntimeError, match="02_b"):
        optax_accum_docs.stage_notebooks(srcdir)


def _package(root: Path) -> None:
    pkg = root / "docs_tools_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            '''
            """A package."""
            from .sub import Moved

            def f():
                """F."""

            __all__ = ["Moved", "f"]
            '''
        )
    )
    (pkg / "sub.py").write_text(
        '"""Sub."""\n\nclass Moved:\n    """Moved."""\n\n__all__ = ["Moved"]\n'
    )
    (pkg / "no_all.py").write_text(
        '"""No __all__."""\nimport os\n\ndef g():\n    """G."""\n\n'
        "class H:\n    pass\n\ndef _private():\n    pass\n"
    )
    (pkg / "broken.py").write_text("import docs_tools_no_such_dependency\n")


def test_api_pages(tmp_path, monkeypatch, caplog):
    _package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(
        optax_accum_docs,
        "API_MODULES",
        (
            "docs_tools_pkg",
            "docs_tools_pkg.sub",
            "docs_tools_pkg.no_all",
            "docs_tools_pkg.missing",
        ),
    )
    srcdir = tmp_path / "docs"
    stale = srcdir / "api" / "modules" / "docs_tools_pkg.gone.rst"
    stale.parent.mkdir(parents=True)
    stale.write_text("old")
    with caplog.at_level(logging.INFO):
        written = optax_accum_docs.write_api_pages(srcdir)
    assert written == ["docs_tools_pkg", "docs_tools_pkg.sub", "docs_tools_pkg.no_all"]
    assert not stale.exists()
    assert "skipping docs_tools_pkg.missing: no such module" in caplog.text

    def listed(module):
        text = (srcdir / "api" / "modules" / f"{module}.rst").read_text()
        table = text.split(":nosignatures:\n\n")[1]
        return [line.strip() for line in table.splitlines() if line.strip()]

    # `Moved` is exported twice: one page, under the deeper module.
    assert listed("docs_tools_pkg") == ["f"]
    assert listed("docs_tools_pkg.sub") == ["Moved"]
    assert "docs_tools_pkg.Moved is docs_tools_pkg.sub.Moved" in caplog.text
    # Without __all__: the public functions and classes the module defines.
    assert listed("docs_tools_pkg.no_all") == ["H", "g"]

    # A module that exists but cannot import fails the build.
    monkeypatch.setattr(optax_accum_docs, "API_MODULES", ("docs_tools_pkg.broken",))
    with pytest.raises(ModuleNotFoundError, match="docs_tools_no_such_dependency"):
        optax_accum_docs.write_api_pages(srcdir)


def test_benchmark_results_page(tmp_path, monkeypatch):
    results = tmp_path / "repo" / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "a.md").write_text("| x |\n|---|\n| 1 |\n\n![plot](a.png)\n")
    (results / "b.md").write_text("## B\n")
    (results / "a.png").write_bytes(b"")
    (results / "c.png").write_bytes(b"")
    monkeypatch.setattr(optax_accum_docs, "REPO", tmp_path / "repo")
    srcdir = tmp_path / "repo" / "docs"
    optax_accum_docs.write_benchmark_results(srcdir)
    page = (srcdir / optax_accum_docs.BENCHMARK_RESULTS).read_text()
    assert "```{include} ../benchmarks/results/a.md" in page
    assert "```{include} ../benchmarks/results/b.md" in page
    # c.png is shown by no results file, so the page shows it; a.png is
    # shown by a.md already.
    assert "](../benchmarks/results/c.png)" in page
    assert "](../benchmarks/results/a.png)" not in page


def test_hlo_census_counts_all_reduces_in_and_outside_the_branches():
    import hlo_census

    hlo = textwrap.dedent("""
        HloModule m

        %add (a: f32[], b: f32[]) -> f32[] {
          ROOT %s = f32[] add(f32[] %a, f32[] %b)
        }

        %boundary (p: f32[4]) -> f32[4] {
          %p = f32[4] parameter(0)
          ROOT %r = f32[4] all-reduce(f32[4] %p), to_apply=%add
        }

        %hold (p: f32[4]) -> f32[4] {
          ROOT %p = f32[4] parameter(0)
        }

        ENTRY %main (x: f32[4], i: s32[]) -> f32[4] {
          %x = f32[4] parameter(0)
          %i = s32[] parameter(1)
          %y = f32[4] all-reduce-start(f32[4] %x), to_apply=%add
          ROOT %c = f32[4] conditional(s32[] %i, f32[4] %y, f32[4] %y), BRANCHES
        }
    """).replace("BRANCHES", "branch_computations={%hold, %boundary}")
    assert hlo_census.all_reduces(hlo) == (1, 1)


def test_hlo_census_on_a_compiled_accumulate_step():
    # The claim of the accumulate guide: with axis_name, one all-reduce per
    # update, in the boundary branch, and none on the hold steps.
    import hlo_census
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    import optax_accum

    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    tx = optax_accum.accumulate(optax.sgd(0.1), 2, axis_name="d")
    params = {"w": jnp.zeros(3)}
    specs = optax_accum.state_specs(jax.eval_shape(tx.init, params), "d")

    def step(state, g):
        return tx.update({"w": g[0]}, state, params)[1]

    state = jax.jit(
        jax.shard_map(lambda: tx.init(params), mesh=mesh, in_specs=(), out_specs=specs)
    )()
    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(specs, P("d")), out_specs=specs)
    )
    g = jax.device_put(jnp.ones((4, 3)), jax.sharding.NamedSharding(mesh, P("d")))
    hlo = run.lower(state, g).compile().as_text()
    assert hlo_census.all_reduces(hlo) == (1, 0)
