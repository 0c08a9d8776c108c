# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""``benchmarks/run.py`` over ``bench_*.py`` scripts: ``--quick``, ``--full``.

Stand-in scripts check the runner's contract (each script's ``measure``
returns its rows as data, ``markdown`` renders them; the JSON holds the data
itself); one test runs the repository's benchmarks at their quick sizes.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RUN_PY = ROOT / "benchmarks" / "run.py"

SCRIPT = """
def measure(quick):
    return {{"rows": [{{"name": "{name}", "quick": quick, "value": {value}}}]}}

def markdown(data):
    lines = ["| name | quick | value |", "|---|---|---:|"]
    for r in data["rows"]:
        lines.append(f"| {{r['name']}} | {{r['quick']}} | {{r['value']}} |")
    return "\\n".join(lines)
"""


def _runner():
    spec = importlib.util.spec_from_file_location("_bench_run", RUN_PY)
    module = importlib.util.module_from_spec(spec)
    write_bytecode = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # no __pycache__ in benchmarks/
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = write_bytecode
    return module


def _scripts(folder: Path, **values: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in values.items():
        (folder / f"bench_{name}.py").write_text(SCRIPT.format(name=name, value=value))
    return folder


def test_runs_each_script_in_order_and_renders_its_data(tmp_path, capsys):
    bench_dir = _scripts(tmp_path / "benchmarks", b_second=2.5, a_first=1)
    (bench_dir / "helper.py").write_text("raise RuntimeError('not a benchmark')\n")
    md = tmp_path / "tables.md"
    argv = ["--quick", "--benchmarks-dir", str(bench_dir), "--out", str(md)]
    assert _runner().main(argv) == 0
    out = capsys.readouterr().out
    assert out.index("### bench_a_first") < out.index("### bench_b_second")
    assert "| a_first | True | 1 |" in out and "| b_second | True | 2.5 |" in out
    written = md.read_text()
    assert written.startswith(
        "### bench_a_first\n\n| name | quick | value |\n|---|---|---:|\n"
        "| a_first | True | 1 |"
    )
    assert "| b_second | True | 2.5 |" in written


def test_without_quick_passes_false(tmp_path, capsys):
    bench_dir = _scripts(tmp_path, x=0)
    assert _runner().main(["--benchmarks-dir", str(bench_dir)]) == 0
    assert "| x | False | 0 |" in capsys.readouterr().out


def test_missing_directory_is_a_clear_error(tmp_path, capsys):
    status = _runner().main(["--benchmarks-dir", str(tmp_path / "nowhere")])
    assert status == 2
    assert "no bench_*.py found" in capsys.readouterr().err


def test_script_without_measure_and_markdown(tmp_path):
    (tmp_path / "bench_bad.py").write_text("def run(quick):\n    return '| x |'\n")
    with pytest.raises(AttributeError, match=r"bench_bad.py has no `measure"):
        _runner().main(["--benchmarks-dir", str(tmp_path)])


@pytest.mark.parametrize(
    "argv", [["--smoke"], ["--device", "--quick"], ["--device", "--full"]]
)
def test_device_flags_that_do_not_combine(argv, capsys):
    with pytest.raises(SystemExit) as info:
        _runner().main(argv)
    assert info.value.code == 2
    assert "usage: python benchmarks/run.py" in capsys.readouterr().err


def test_full_writes_one_markdown_and_one_json_of_the_data(tmp_path, capsys):
    bench_dir = _scripts(tmp_path / "benchmarks", a_table=7)
    (bench_dir / "bench_b_plot.py").write_text(
        SCRIPT.format(name="b_plot", value=3)
        + textwrap.dedent("""
        def write_full(data, out_dir):
            (out_dir / "b_plot.png").write_bytes(b"png")
        """)
    )
    runner = _runner()
    assert runner.main(["--full", "--benchmarks-dir", str(bench_dir)]) == 0
    results = bench_dir / "results"
    (md_path,) = results.glob("bench_*.md")
    assert md_path.name == "bench_cpu.md"  # the device's name
    assert (results / "b_plot.png").read_bytes() == b"png"
    md = md_path.read_text()
    assert md.startswith("## Benchmarks on cpu (cpu, 8 device(s))")
    assert "`python benchmarks/run.py --full`" in md
    assert "### bench_a_table\n\n| name | quick | value |" in md
    data = json.loads(md_path.with_suffix(".json").read_text())
    assert data["backend"] == "cpu" and data["device"] == "cpu"
    # The scripts' own data, not rows parsed back from the Markdown.
    assert data["benchmarks"]["bench_a_table"] == {
        "rows": [{"name": "a_table", "quick": False, "value": 7}]
    }
    assert data["benchmarks"]["bench_b_plot"]["rows"][0]["value"] == 3
    assert "Wrote" in capsys.readouterr().out

    out = tmp_path / "elsewhere" / "report.md"
    argv = ["--full", "--quick", "--benchmarks-dir", str(bench_dir)]
    assert runner.main([*argv, "--out", str(out)]) == 0
    assert "| a_table | True | 7 |" in out.read_text()
    stored = json.loads(out.with_suffix(".json").read_text())
    assert stored["benchmarks"]["bench_a_table"]["rows"][0]["quick"] is True


def test_quick_on_the_repository_benchmarks(tmp_path):
    scripts = sorted(p.stem for p in RUN_PY.parent.glob("bench_*.py"))
    assert len(scripts) >= 4, scripts
    md = tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, str(RUN_PY), "--quick", "--out", str(md)],
        capture_output=True,
        text=True,
        timeout=900,  # every benchmark's quick config, on 2 busy cores
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = md.read_text()
    for stem in scripts:
        assert f"### {stem}\n" in proc.stdout
        section = written.split(f"### {stem}\n", 1)[1].split("\n### ", 1)[0]
        assert re.search(r"^\|[-:| ]+\|$", section, re.MULTILINE), section
