# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The transformer memory table, compiled by XLA:CPU, XLA:GPU and XLA:TPU.

The steps of ``benchmarks/transformer/steps.py`` for ``examples/gpt.py``'s
``cpu_small`` GPT (AdamW, f32, no remat, micro-batches of 2 sequences,
parameters and state donated): the fused step (`microbatch`) at k = 4 and
16 against a hand-written ``lax.scan``, and `accumulate`'s per-micro-batch
step against ``optax.MultiSteps``'s. Each is compiled (not run) for the CPU,
an H100 and a TPU v5e chip (``optax_accum._targets``, the ``compilers``
extra, no device needed); memory is device memory, ``argument + output -
alias + temp`` read alike on each compiler, and each ratio is against the
anchor in the same compiler. With `offload` (AdamW's state in host memory
between updates, lowered there for each compiler), the device peak is read
against the same step without it. Time stays a CPU ratio
(``bench_transformer.py``): a compile gives no time on hardware.

Run ``python benchmarks/memory_targets.py``; it writes
``benchmarks/results/memory_targets.json`` and ``.md``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_compilers import compile_on  # noqa: E402
from transformer.steps import Key, gpt, init_state, step_fn  # noqa: E402

from optax_accum import _offload, _targets  # noqa: E402
from optax_accum._planner import _compile  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MiB = 2**20
MICRO = 2
STEPS = [  # (mode, k), and the anchor each is read against
    ("scan", 4), ("microbatch", 4), ("scan", 16), ("microbatch", 16),
    ("multisteps", 16), ("accumulate", 16),
    ("microbatch+offload", 16), ("accumulate+offload", 16),
]  # fmt: skip
ANCHOR = {
    "microbatch": "scan",
    "accumulate": "multisteps",
    "microbatch+offload": "microbatch",
    "accumulate+offload": "accumulate",
}


def _args(key: Key, cfg):
    fn, kind = step_fn(key, cfg)
    params = jax.eval_shape(lambda: gpt.init_params(cfg))
    state = jax.eval_shape(lambda p: init_state(kind, p), params)
    batch = jax.eval_shape(lambda: gpt.random_batch(jax.random.key(0), cfg, key.rows))
    return fn, (params, state, batch)


def _offloaded(where: str, key: Key, cfg) -> tuple[int, int]:
    """(temp, peak) of a step whose AdamW state is in host memory, measured
    as the planner measures it: the state placed by `offload` (in host
    memory) here, and kept there for the target (`_planner._compile`)."""
    fn, kind = step_fn(key, cfg)
    params = gpt.init_params(cfg)
    state = jax.tree.map(_offload.abstract, (params, init_state(kind, params)))
    batch = jax.eval_shape(lambda: gpt.random_batch(jax.random.key(0), cfg, key.rows))
    step = jax.jit(fn, donate_argnums=key.donated)
    here = where == "cpu"
    compiler = _compile.here() if here else _compile.for_target(where, state)
    peak, _ = compiler.measure(step, (*state, batch))
    return -1, peak  # temp: not split from the host buffers on every compiler


def measure() -> dict:
    cfg = gpt.preset("cpu_small")
    compilers = ["cpu"] + [t for t in ("h100", "v5e") if _targets.available(t)]
    rows = []
    for mode, k in STEPS:
        row = {"mode": mode, "k": k}
        for where in compilers:
            key = Key(mode, "none", "f32", k, MICRO)
            if mode.endswith("+offload"):
                temp, peak = _offloaded(where, key, cfg)
            else:
                _, (temp, peak) = compile_on(where, *_args(key, cfg))
            row[where] = {"temp": temp, "peak": peak}
            print(mode, k, where, peak, flush=True)
        rows.append(row)
    return {"preset": "cpu_small", "micro": MICRO, "compilers": compilers, "rows": rows}


def markdown(data: dict) -> str:
    compilers = data["compilers"]
    head = " | ".join(f"{c} peak MiB | {c} ratio" for c in compilers)
    lines = [f"| step | k | {head} |", "|---|---:|" + "---:|" * 2 * len(compilers)]
    by = {(r["mode"], r["k"]): r for r in data["rows"]}
    for r in data["rows"]:
        anchor = by.get((ANCHOR.get(r["mode"]), r["k"]))
        cells = []
        for c in compilers:
            ratio = f"{r[c]['peak'] / anchor[c]['peak']:.3f}" if anchor else ""
            cells += [f"{r[c]['peak'] / MiB:.1f}", ratio]
        lines.append(f"| {r['mode']} | {r['k']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    data = measure()
    (RESULTS / "memory_targets.json").write_text(json.dumps(data, indent=1) + "\n")
    text = (
        "# The transformer's memory on three compilers\n\n"
        "`python benchmarks/memory_targets.py`: `examples/gpt.py` cpu_small, "
        f"AdamW, f32, micro-batches of {MICRO} sequences, compiled (not run); "
        "ratio: against `lax.scan` (fused) or `optax.MultiSteps` (accumulate), "
        "and with `offload` against the same step without it, in the same "
        "compiler. Device memory only: an offloaded state's host buffers are "
        "left out.\n\n" + markdown(data)
    )
    (RESULTS / "memory_targets.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
