# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""``python -m optax_accum``: bad arguments exit with usage; the demo's verdict."""

import pytest

from optax_accum.__main__ import main


@pytest.mark.parametrize(
    ("diffs", "failing"),
    [
        ((3e-7, 1e-4), None),
        ((3e-7, 1.1e-4), "microbatch 4x8"),
        ((float("nan"), 0.0), "accumulate 4x8"),
    ],
)
def test_demo_verdict(diffs, failing, capsys):
    from optax_accum._demo import RunResult, _verdict

    runs = [
        RunResult(name, None, max_param_diff=d)
        for name, d in zip(("accumulate 4x8", "microbatch 4x8"), diffs, strict=True)
    ]
    status = _verdict(runs, "large batch 32", tolerance=1e-4)
    out = capsys.readouterr().out
    if failing is None:
        assert status == 0
        assert out.startswith("OK: the accumulated runs match the large batch 32")
    else:
        assert status == 1
        assert out.startswith(f"FAIL: {failing} (")
        assert out.count(" 4x8 (") == 1
        assert "than 0.0001" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "-k", "0"],
        ["demo", "-b", "x"],
        ["demo", "--steps", "-3"],
        ["demo", "--seed", "-1"],
        [],
        ["bench", "--quick"],  # the benchmarks moved to benchmarks/run.py
    ],
)
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage: python -m optax_accum" in capsys.readouterr().err
