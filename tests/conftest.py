# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Test set-up: 8 CPU devices, so that pmap and sharding run on every test run,
a CPU code generator that compiles fast, and JAX's persistent compilation
cache.

Compilation is most of the suite's time.

- The tests read values, HLO after XLA's passes and buffer assignments, none
  of which depends on how the CPU backend turns fusions into machine code.
  ``--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false``
  makes that step about 2.5 times faster. The flags apply to this process
  only: the subprocesses the integration tests start (examples, notebooks,
  benchmarks, multi-host workers) run with XLA's defaults. Set
  ``OPTAX_ACCUM_TEST_XLA_FLAGS`` to other flags, or to ``""`` for XLA's
  defaults; a ``XLA_FLAGS`` of your own comes first.
- The cache (in ``.pytest_cache/jax``, keyed by the compiled program and its
  flags, so a changed program is compiled anew) makes a repeated run, the
  inner loop, several times faster; set ``OPTAX_ACCUM_TEST_CACHE=off`` to
  compile everything afresh, or to another folder.
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

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
_outer_flags = os.environ.get("XLA_FLAGS")
os.environ["XLA_FLAGS"] = " ".join(
    f
    for f in (_outer_flags, os.environ.get("OPTAX_ACCUM_TEST_XLA_FLAGS", FAST_COMPILE))
    if f
)
jax.jit(lambda: 0)()  # XLA reads XLA_FLAGS once, at its first compilation
if _outer_flags is None:
    del os.environ["XLA_FLAGS"]
else:
    os.environ["XLA_FLAGS"] = _outer_flags
