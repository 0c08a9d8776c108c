# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The parts of ``bench_sharded.py``: layouts, variants, collectives, report."""
