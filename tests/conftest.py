# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Test set-up: 8 CPU devices, so that pmap and sharding run on every test run,
and JAX's persistent compilation cache.

Compilation is most of the suite's time. The cache (in ``.pytest_cache/jax``,
keyed by the compiled program, so a changed program is compiled anew) makes
a repeated run, the inner loop, several times faster; set
``OPTAX_ACCUM_TEST_CACHE=off`` to compile everything afresh, or to another
folder.
"""

import os
from pathlib import Path

import jax

# Must run before any JAX backend is initialised.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

_cache = os.environ.get(
    "OPTAX_ACCUM_TEST_CACHE", str(Path(__file__).parents[1] / ".pytest_cache" / "jax")
)
if _cache != "off":
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
