# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Shared test helpers: HLO parsing, sharded-parameter layouts, small models."""
