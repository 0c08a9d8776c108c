# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The compiler lane: the library's claims on XLA:GPU and XLA:TPU, compiled
here without the devices (`optax_accum._targets`).

A test that needs a target's compiler skips, with the reason, where the
``compilers`` extra is not installed. CI installs it and sets
``OPTAX_ACCUM_REQUIRE_COMPILERS=1``: a skip here is then a failure, so the
lane cannot pass by checking nothing.
"""

from __future__ import annotations

import os

import pytest

from optax_accum import _targets

REQUIRED = os.environ.get("OPTAX_ACCUM_REQUIRE_COMPILERS") == "1"


def require(target: str) -> None:
    """Skips (or, in CI, fails) the calling test without ``target``'s compiler."""
    if not _targets.available(target):
        pytest.skip(
            f"no compiler for {target!r}: the `compilers` extra is not installed"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    # An expected failure reports as skipped too, with ``wasxfail``.
    if REQUIRED and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
        report.outcome = "failed"
        report.longrepr = (
            f"skipped where OPTAX_ACCUM_REQUIRE_COMPILERS=1 (CI's compiler lane): "
            f"{reason}"
        )
