# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Interleaved timing rounds and median ratios against an anchor.

On a shared machine absolute times drift with the load; a ratio of two times
taken in the same round does not drift with it. So every variant runs once
per round, in turn, and a ratio is the median over rounds of the per-round
ratios, with the 25th and 75th percentiles as its spread.

The statistics are the standard library's (`statistics.median`,
`statistics.quantiles` with ``method="inclusive"``, which is NumPy's default
linear percentile). A benchmarking package was considered: ``pyperf`` times
one function per process and calibrates loops, and ``pytest-benchmark``
times one function per test; neither interleaves variants that carry
compiled state within one process, which is what a ratio needs here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax


class Timed(NamedTuple):
    """A variant with an untimed setup: ``run(setup())`` is timed.

    ``run`` returns what to wait for (`jax.block_until_ready`) before the
    clock stops; ``setup`` (e.g. a fresh copy of the state) is waited for
    before it starts.
    """

    run: Callable[[Any], Any]
    setup: Callable[[], Any] = lambda: None


class Ratio(NamedTuple):
    """A median of per-round ratios, and its 25th and 75th percentiles."""

    median: float
    q25: float
    q75: float


def time_once(variant: Callable[[], Any] | Timed) -> float:
    """Seconds of one call of ``variant`` (a callable or a `Timed`)."""
    timed = variant if isinstance(variant, Timed) else Timed(lambda _: variant())
    inputs = jax.block_until_ready(timed.setup())
    start = time.perf_counter()
    jax.block_until_ready(timed.run(inputs))
    return time.perf_counter() - start


def interleaved(
    variants: Mapping[str, Callable[[], Any] | Timed] | Mapping[Any, Any],
    rounds: int,
    warmup: int = 1,
    log: Callable[[str], None] | None = None,
) -> dict[Any, list[float]]:
    """Times each variant once per round, in turn: name -> seconds per round.

    ``warmup`` rounds run first and are not kept. ``log`` gets a line per
    timed round.
    """
    for _ in range(warmup):
        for variant in variants.values():
            time_once(variant)
    times: dict[Any, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        start = time.perf_counter()
        for name, variant in variants.items():
            times[name].append(time_once(variant))
        if log is not None:
            log(f"round {r + 1}/{rounds}: {time.perf_counter() - start:.1f} s")
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def ratio(times: Mapping[Any, Sequence[float]], name: Any, anchor: Any) -> Ratio:
    """Median and quartiles over rounds of ``time(name) / time(anchor)``."""
    per_round = [t / a for t, a in zip(times[name], times[anchor], strict=True)]
    if len(per_round) < 2:
        return Ratio(per_round[0], per_round[0], per_round[0])
    q25, _, q75 = statistics.quantiles(per_round, n=4, method="inclusive")
    return Ratio(statistics.median(per_round), q25, q75)


def ratios(times: Mapping[Any, Sequence[float]], anchor: Any) -> dict[Any, Ratio]:
    """`ratio` of every variant against ``anchor``."""
    return {name: ratio(times, name, anchor) for name in times}
