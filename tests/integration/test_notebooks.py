# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The Colab notebooks: each is paired with its source, and each runs.

Every notebook ``notebooks/0N_name.ipynb`` is paired through jupytext with a
py:percent source ``notebooks/0N_name.py``, the file people edit and review.
The tests find the pairs themselves, so a new notebook is covered as soon as
it is added: both files must exist, the stored ``.ipynb`` must hold exactly
the cells jupytext makes from the source, with no outputs, and it must run
top to bottom.

Every notebook runs in a fresh ``python3`` kernel (ipykernel, from the
``[notebooks]`` extra) inside a temporary working folder, so nothing is left
behind. The kernel is a separate process: this suite's conftest settings (8 CPU
devices, CPU only) do not reach it, so each notebook sets up its own devices,
as it does on Colab.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NAMES = sorted(
    {p.stem for p in NOTEBOOKS_DIR.glob("*.ipynb")}
    | {p.stem for p in NOTEBOOKS_DIR.glob("*.py")}
)
FORMATS = "ipynb,py:percent"
CELL_TIMEOUT_S = 300
COLAB_URL = (
    "https://colab.research.google.com/github/optax-accum/optax_accum/blob/main/"
    "notebooks/{}"
)
SYNC_HINT = "edit notebooks/{0}.py, then run `jupytext --sync notebooks/{0}.py`"


def _ipynb(name: str) -> Path:
    return NOTEBOOKS_DIR / f"{name}.ipynb"


def _source(name: str) -> Path:
    return NOTEBOOKS_DIR / f"{name}.py"


def _cells(nb) -> list[tuple[str, str, dict]]:
    # Cell ids are left out: jupytext keeps the stored ids when it syncs.
    return [(c.cell_type, c.source, dict(c.metadata)) for c in nb.cells]


def _without_jupytext(metadata) -> dict:
    return {k: v for k, v in metadata.items() if k != "jupytext"}


def test_notebooks_exist():
    assert NAMES[:4] == [
        "01_quickstart",
        "02_token_weighting",
        "03_memory",
        "04_pod_scale",
    ]
    assert not (NOTEBOOKS_DIR / "_build.py").exists()


@pytest.mark.parametrize("name", NAMES)
def test_is_a_jupytext_pair(name: str):
    assert _ipynb(name).exists(), f"{_source(name).name} has no notebook: " + (
        f"run `jupytext --to ipynb notebooks/{name}.py`"
    )
    assert _source(name).exists(), f"{_ipynb(name).name} has no source: " + (
        f"run `jupytext --set-formats {FORMATS} notebooks/{name}.ipynb`"
    )
    nb = json.loads(_ipynb(name).read_text())
    assert nb["metadata"].get("jupytext", {}).get("formats") == FORMATS
    header = _source(name).read_text().split("# ---\n")[1]
    assert f"formats: {FORMATS}" in header
    assert "format_name: percent" in header


@pytest.mark.parametrize("name", NAMES)
def test_pair_is_in_sync(name: str):
    jupytext = pytest.importorskip("jupytext")
    nbformat = pytest.importorskip("nbformat")
    if not (_ipynb(name).exists() and _source(name).exists()):
        pytest.skip("not a pair (test_is_a_jupytext_pair fails)")
    expected = jupytext.read(_source(name))
    stored = nbformat.read(_ipynb(name), as_version=4)
    assert _cells(stored) == _cells(expected), SYNC_HINT.format(name)
    metadata = _without_jupytext(expected.metadata)
    assert _without_jupytext(stored.metadata) == metadata, SYNC_HINT.format(name)


@pytest.mark.parametrize("name", NAMES)
def test_stored_without_outputs(name: str):
    path = _ipynb(name)
    if not path.exists():
        pytest.skip("no notebook (test_is_a_jupytext_pair fails)")
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], f"cell {i} of {path.name} has outputs"
            assert cell.get("execution_count") is None, (
                f"cell {i} of {path.name} has an execution count"
            )
    assert "widgets" not in nb["metadata"], f"{path.name} stores widget state"


@pytest.mark.parametrize("name", NAMES)
def test_has_badge_install_and_devices(name: str):
    path = _ipynb(name)
    if not path.exists():
        pytest.skip("no notebook (test_is_a_jupytext_pair fails)")
    nb = json.loads(path.read_text())
    first = "".join(nb["cells"][0]["source"])
    assert COLAB_URL.format(path.name) in first, f"{path.name}: Colab badge link"
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    install = code[0]
    assert 'find_spec("optax_accum") is None' in install, "install cell is not guarded"
    assert '"pip", "install"' in install
    assert any("jax.devices()" in c for c in code), "no cell reports the devices"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name: str, tmp_path: Path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    path = _ipynb(name)
    if not path.exists():
        pytest.skip("no notebook (test_is_a_jupytext_pair fails)")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{e}", pytrace=False)
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert not leftovers, f"{path.name} wrote files: {leftovers}"
