# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The compiler lane: claims checked on XLA:GPU and XLA:TPU without the devices."""
