# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The keywords a type checker sees (issue 33, §5).

The faces take their `Keywords` as ``**kwargs: Unpack[MicrobatchKeywords]``
(PEP 692), the Flax steps as ``Unpack[StepKeywords]``; the dataclass stays
the one declaration, and these TypedDicts must agree with it. mypy, run as
``pyproject.toml``'s ``[tool.mypy]`` says, reports nothing on the public
surface and a typed user script, and reports a misspelt keyword.
"""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from optax_accum._microbatch import _keywords
from tests.helpers.lanes import sweep

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "typing" / "user_script.py"


def _annotations(typed_dict) -> dict[str, str]:
    return {
        name: getattr(t, "__forward_arg__", t)
        for name, t in typed_dict.__annotations__.items()
    }


def test_the_typed_dicts_agree_with_the_declaration():
    declared = {f.name: f.type for f in dataclasses.fields(_keywords.Keywords)}
    assert _annotations(_keywords.MicrobatchKeywords) == declared
    steps = {n: t for n, t in declared.items() if n not in _keywords.STEP_RESERVED}
    assert _annotations(_keywords.StepKeywords) == steps
    from optax_accum.flax import _common

    assert set(_common._ACCEPTED) - {"argnums"} == set(steps)
    assert set(_common._RESERVED) == set(_keywords.STEP_RESERVED)


def _mypy(*files: str, cache: pathlib.Path) -> subprocess.CompletedProcess:
    pytest.importorskip("mypy")
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("mypy_cache")


def test_mypy_reports_no_error_on_the_public_surface(cache):
    out = _mypy(cache=cache)  # the files of pyproject.toml's [tool.mypy]
    assert out.returncode == 0, out.stdout + out.stderr
    assert "user_script.py" in (ROOT / "pyproject.toml").read_text()


# (the script's text, its misspelt version, the face, the misspelt keyword)
_MISSPELT = [
    ("\n        batch_argnums=(1, 2),", "\n        batch_argnum=(1, 2),",
     "microbatch", "batch_argnum"),
    ('batch_argnums=(1, 2), reduction="sum"',
     'batch_argnums=(1, 2), reductoin="sum"',
     "microbatch_value_and_grad", "reductoin"),
    ('nnx_train_step(nnx_loss, 2, reduction="mean"',
     'nnx_train_step(nnx_loss, 2, data_axis="data", reduction="mean"',
     "nnx_train_step", "data_axis"),
    ("weight_fn=count)", "weightfn=count)", "linen_train_step", "weightfn"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("right", "wrong", "face", "keyword"), sweep(_MISSPELT, fast=[_MISSPELT[2]])
)
def test_mypy_reports_a_misspelt_keyword(right, wrong, face, keyword, cache, tmp_path):
    source = SCRIPT.read_text()
    assert source.count(right) == 1
    bad = tmp_path / "user_script_misspelt.py"
    bad.write_text(source.replace(right, wrong))
    out = _mypy(str(bad), cache=cache)
    assert out.returncode == 1, out.stdout + out.stderr
    (error,) = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert f'Unexpected keyword argument "{keyword}" for "{face}"' in error


@pytest.mark.slow
def test_the_user_script_runs():
    # The calls mypy checks are real calls: the script runs (a few seconds of
    # compiling, hence slow).
    out = subprocess.run(
        [sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
