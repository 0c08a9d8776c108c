# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Sharded-layout suites: parameter layouts, axis_name, optax's sharding tests."""
