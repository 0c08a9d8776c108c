# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The optax_accum test suite (a package, so that folders may repeat module names)."""
