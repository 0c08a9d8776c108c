# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The shared setup: one GPT, its compiled steps, their memory and times.

`Bench` makes the parameters once, compiles each step once (lowered here,
compiled in a thread pool: XLA releases the GIL), records its compiled
memory (`harness.compiled_memory`) and times steps in interleaved rounds
(`harness.interleaved`). Every step donates its params and optimizer state
(the params only where the state is in host memory: `Key.donated`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import harness
import jax
import jax.numpy as jnp

from .steps import Key, gpt, init_state, step_fn

REMATS = ("none", "dots", "full")
COMBOS = tuple((r, d) for r in REMATS for d in ("f32", "bf16"))
ANCHOR = ("none", "f32")
MiB = 2**20


class Variant:
    """One compiled step: its key, the program and its memory."""

    def __init__(self, key: Key, compiled: Any, seconds: float, memory: dict):
        self.key, self.compiled, self.compile_seconds = key, compiled, seconds
        self.memory = memory
        self.mode, self.remat, self.dtype, self.k, self.micro = key


def _nbytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _compile(lowered: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    compiled = lowered.compile()
    return compiled, time.perf_counter() - start


class Bench:
    """Compiles the variants once, measures memory, times them interleaved.

    ``sizes`` needs ``preset`` (and may have ``changes``) of `gpt.preset`; the
    optimizer states are made on first use, one per kind of step.
    """

    def __init__(self, sizes: dict[str, Any], log: Callable[[str], None] = print):
        self.sizes, self.log = sizes, log
        self.cfg = gpt.preset(sizes["preset"], **sizes.get("changes", {}))
        self.params = gpt.init_params(self.cfg)
        self.states: dict[str, Any] = {}
        self.variants: dict[Key, Variant] = {}
        self.kinds: dict[Key, str] = {}
        self.batches: dict[int, Any] = {}
        self.compilations = 0

    def state(self, kind: str) -> Any:
        if kind not in self.states:
            self.states[kind] = init_state(kind, self.params)
        return self.states[kind]

    def batch(self, rows: int) -> Any:
        if rows not in self.batches:
            key = jax.random.fold_in(jax.random.key(1), rows)
            self.batches[rows] = gpt.random_batch(key, self.cfg, rows)
        return self.batches[rows]

    def inputs(self, key: Key) -> list[Any]:
        """What one update feeds: the batch, or its k micro-batches."""
        batch = self.batch(key.k * key.micro)
        if not key.per_micro:
            return [batch]
        # The rows `microbatch` gives micro-batch i: i, i + k, i + 2k, ...
        return [jax.tree.map(lambda x, i=i: x[i :: key.k], batch) for i in range(key.k)]

    def add(self, *key: Any) -> Variant:
        return self.add_many([Key(*key)])[0]

    def add_many(
        self, keys: Iterable[tuple], threads: int = 1, deadline: float | None = None
    ) -> list[Variant]:
        """Compiles the variants of ``keys``, in a pool of ``threads`` threads.

        After ``deadline`` (a `time.monotonic` value) no new variant is
        lowered. Returns the variants of ``keys`` that exist.
        """
        keys = [Key(*key) for key in keys]
        todo = list(dict.fromkeys(k for k in keys if k not in self.variants))
        with ThreadPoolExecutor(max(1, threads)) as pool:
            futures = {}
            for key in todo:
                if deadline is not None and time.monotonic() > deadline:
                    self.log(f"not compiled (time budget): {len(todo) - len(futures)}")
                    break
                fn, kind = step_fn(key, self.cfg)
                lowered = jax.jit(fn, donate_argnums=key.donated).lower(
                    self.params, self.state(kind), self.inputs(key)[0]
                )
                futures[pool.submit(_compile, lowered)] = (key, kind)
            for future in as_completed(futures):
                self._record(*futures[future], *future.result())
        return [self.variants[k] for k in keys if k in self.variants]

    def _record(self, key: Key, kind: str, compiled: Any, seconds: float) -> None:
        memory = harness.compiled_memory(compiled)
        memory["state"] = _nbytes((self.params, self.state(kind)))
        self.variants[key] = Variant(key, compiled, seconds, memory)
        self.kinds[key] = kind
        self.compilations += 1
        self.log(
            f"compiled {tuple(key)} in {seconds:.1f} s: "
            f"peak {memory['peak'] / MiB:.1f} MiB"
        )

    def update(self, key: Key) -> harness.Timed:
        """One update of ``key`` from a fresh copy of the params and state."""
        v = self.variants[key]

        def setup():
            state = self.states[self.kinds[key]]
            return jax.tree.map(jnp.copy, (self.params, state)), self.inputs(key)

        def run(args):
            (p, s), inputs = args
            for b in inputs:
                p, s = v.compiled(p, s, b)
            return p, s

        return harness.Timed(run, setup)

    def time_all(self, keys: list[tuple], rounds: int) -> dict[Key, list[float]]:
        updates = {Key(*key): self.update(Key(*key)) for key in keys}
        return harness.interleaved(updates, rounds, log=self.log)

    def fits(self, key: Key) -> bool:
        """Whether ``key``'s compiled peak is under 90% of the device's memory."""
        limit = harness.memory_stats().get("bytes_limit")
        if limit is not None and self.variants[key].memory["peak"] > 0.9 * limit:
            self.log(f"not timed (peak over 90% of the device's memory): {key}")
            return False
        return True


def model_info(bench: Bench) -> dict[str, Any]:
    return {
        "preset": bench.sizes["preset"],
        "config": {
            f: getattr(bench.cfg, f)
            for f in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len")
        },
        "params": gpt.num_params(bench.params),
        "param_bytes": _nbytes(bench.params),
    }


def model_line(model: dict[str, Any]) -> str:
    c = model["config"]
    return (
        f"GPT {model['preset']} ({model['params'] / 1e6:.1f}M params, "
        f"{c['n_layers']} layers, d_model {c['d_model']}, sequence {c['seq_len']}, "
        f"vocabulary {c['vocab_size']})"
    )


def grid_row(bench: Bench, key: Key, times: dict, anchor: Key | None) -> dict:
    """A CPU-grid row: sizes, memory, time per token against ``anchor``."""
    v = bench.variants[key]
    return {
        "mode": v.mode,
        "remat": v.remat,
        "dtype": v.dtype,
        "k": v.k,
        "micro_batch": v.micro,
        "effective_batch": v.k * v.micro,
        "tokens_per_update": v.k * v.micro * bench.cfg.seq_len,
        "memory": v.memory,
        "seconds_median": harness.median(times[key]) if key in times else None,
        "time_per_token_vs_full_f32": (
            harness.ratio(times, key, anchor).median
            if key in times and anchor in times
            else None
        ),
    }


def variant_row(bench: Bench, key: tuple) -> dict[str, Any]:
    """A device-section row: the step's sizes."""
    mode, remat, dtype, k, micro = key
    return {
        "step": mode,
        "remat": remat,
        "dtype": dtype,
        "k": k,
        "micro_batch": micro,
        "batch": k * micro,
        "tokens_per_update": k * micro * bench.cfg.seq_len,
    }
