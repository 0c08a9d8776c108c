# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Test set-up: 8 CPU devices so that pmap and sharding run on every test run."""

import jax

# Must run before any JAX backend is initialised.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
