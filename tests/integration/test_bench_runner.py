# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The benchmark runner, ``python -m optax_accum bench``.

Stand-in benchmark scripts written to a temporary folder, and a ``--quick`` run
of the repository's own benchmarks in a subprocess.
"""

import re
import subprocess
import sys
import textwrap

import pytest

from optax_accum.__main__ import main


def test_bench_runs_each_script(tmp_path, capsys):
    bench_dir = tmp_path / "benchmarks"
    bench_dir.mkdir()
    for name, body in (("b_second", "two"), ("a_first", "one")):
        (bench_dir / f"bench_{name}.py").write_text(
            textwrap.dedent(f"""
            def run(quick: bool) -> str:
                return "| x |\\n|---|\\n| {body} quick={{}} |".format(quick)
        """)
        )
    (bench_dir / "helper.py").write_text("raise RuntimeError('not a benchmark')\n")
    md = tmp_path / "tables.md"
    status = main(
        ["bench", "--quick", "--benchmarks-dir", str(bench_dir), "--out", str(md)]
    )
    assert status == 0
    out = capsys.readouterr().out
    assert out.index("### bench_a_first") < out.index("### bench_b_second")
    assert "| one quick=True |" in out and "| two quick=True |" in out
    written = md.read_text()
    assert written.startswith("### bench_a_first\n\n| x |\n|---|\n| one quick=True |")
    assert "| two quick=True |" in written


def test_bench_without_quick_passes_false(tmp_path, capsys):
    (tmp_path / "bench_x.py").write_text(
        "def run(quick):\n    return f'quick={quick}'\n"
    )
    assert main(["bench", "--benchmarks-dir", str(tmp_path)]) == 0
    assert "quick=False" in capsys.readouterr().out


def test_bench_missing_directory_is_a_clear_error(tmp_path, capsys):
    status = main(["bench", "--benchmarks-dir", str(tmp_path / "nowhere")])
    assert status == 2
    assert "no benchmarks/bench_*.py found" in capsys.readouterr().err


def test_bench_script_without_run(tmp_path):
    (tmp_path / "bench_bad.py").write_text("x = 1\n")
    with pytest.raises(AttributeError, match=r"bench_bad.py has no `run"):
        main(["bench", "--benchmarks-dir", str(tmp_path)])


def test_default_benchmarks_dir_is_the_repository_one():
    from optax_accum.__main__ import BENCHMARKS_DIR

    assert BENCHMARKS_DIR.name == "benchmarks"
    assert (BENCHMARKS_DIR.parent / "pyproject.toml").is_file()


def test_bench_quick_on_the_repository_benchmarks(tmp_path):
    from optax_accum.__main__ import BENCHMARKS_DIR

    scripts = sorted(p.stem for p in BENCHMARKS_DIR.glob("bench_*.py"))
    assert scripts, f"no benchmarks in {BENCHMARKS_DIR}"
    md = tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, "-m", "optax_accum", "bench", "--quick", "--out", str(md)],
        capture_output=True,
        text=True,
        timeout=300,  # every benchmark's --quick run, on 2 busy cores
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = md.read_text()
    for stem in scripts:
        assert f"### {stem}\n" in proc.stdout
        section = written.split(f"### {stem}\n", 1)[1].split("\n### ", 1)[0]
        assert re.search(r"^\|[-:| ]+\|$", section, re.MULTILINE), section
