# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Transitional: `tests.helpers.hlo` under its old name, for one importer.

``benchmarks/bench_sharded.py`` puts ``tests/`` on ``sys.path`` and imports
``_hlo``. Delete this file once it imports ``tests.helpers.hlo`` instead.
"""

from helpers.hlo import *  # noqa: F403
