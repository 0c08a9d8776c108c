# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The Colab notebooks: each runs top to bottom, and each is stored as generated.

Every notebook runs in a fresh ``python3`` kernel (ipykernel, from the
``[notebooks]`` extra) inside a temporary working folder, so nothing is left
behind. The kernel is a separate process: this suite's conftest settings (8 CPU
devices, CPU only) do not reach it, so each notebook sets up its own devices,
as it does on Colab.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
COLAB_URL = (
    "https://colab.research.google.com/github/optax-accum/optax_accum/blob/main/"
    "notebooks/{}"
)


def _ids(paths: list[Path]) -> list[str]:
    return [p.stem for p in paths]


def _load_builder():
    spec = importlib.util.spec_from_file_location("_build", NOTEBOOKS_DIR / "_build.py")
    module = importlib.util.module_from_spec(spec)
    write_bytecode = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # no __pycache__ in notebooks/
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = write_bytecode
    return module


def test_notebooks_exist():
    assert [p.stem for p in NOTEBOOKS][:4] == [
        "01_quickstart",
        "02_token_weighting",
        "03_memory",
        "04_pod_scale",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_stored_without_outputs(path: Path):
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], f"cell {i} of {path.name} has outputs"
            assert cell.get("execution_count") is None, (
                f"cell {i} of {path.name} has an execution count"
            )
    assert "widgets" not in nb["metadata"], f"{path.name} stores widget state"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_has_badge_install_and_devices(path: Path):
    nb = json.loads(path.read_text())
    first = "".join(nb["cells"][0]["source"])
    assert COLAB_URL.format(path.name) in first, f"{path.name}: Colab badge link"
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    install = code[0]
    assert 'find_spec("optax_accum") is None' in install, "install cell is not guarded"
    assert "%pip install" in install
    assert any("jax.devices()" in c for c in code), "no cell reports the devices"


def test_generator_is_in_sync():
    pytest.importorskip("nbformat")
    builder = _load_builder()
    assert builder.main(["--check"]) == 0, "run `python notebooks/_build.py`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_runs(path: Path, tmp_path: Path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
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
