# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Compiled memory, the device's memory statistics, the compilation cache."""

from __future__ import annotations

from typing import Any

import jax

import optax_accum


def compiled_memory(compiled: Any) -> dict[str, int]:
    """XLA's memory analysis of one compiled call, in bytes.

    ``peak`` is `optax_accum.compiled_memory_bytes` (argument + output -
    alias + temp, device memory only); ``host`` is what the analysis puts in
    host memory itself (0 on the CPU, which reports no split); the others are
    ``memory_analysis()``'s fields.
    """
    stats = compiled.memory_analysis()
    host = (
        stats.host_argument_size_in_bytes
        + stats.host_output_size_in_bytes
        - stats.host_alias_size_in_bytes
        + stats.host_temp_size_in_bytes
    )
    return {
        "peak": optax_accum.compiled_memory_bytes(compiled),
        "host": int(host),
        "temp": int(stats.temp_size_in_bytes),
        "argument": int(stats.argument_size_in_bytes),
        "output": int(stats.output_size_in_bytes),
        "alias": int(stats.alias_size_in_bytes),
    }


def memory_stats(device: Any = None) -> dict[str, int]:
    """``device.memory_stats()``, or ``{}`` where the backend reports none."""
    device = device if device is not None else jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return {}
    return dict(stats or {})


def use_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache in ``path``, for every compilation.

    A step compiled here and again in a fresh process (`peaks`) is then
    loaded there instead of compiled again.
    """
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
