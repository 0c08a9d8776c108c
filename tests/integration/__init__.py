# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Slow integration tests: subprocesses, notebooks, multi-host, examples, benchmarks."""
