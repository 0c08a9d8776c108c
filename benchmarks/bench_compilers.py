# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`accumulate`'s per-micro-batch step against `optax.MultiSteps`'s, per compiler.

Both steps are compiled (not run) for XLA:CPU, XLA:GPU (an H100) and XLA:TPU
(a v5e chip), without the GPU or TPU (`optax_accum._targets`, the
``compilers`` extra), for two models: the GPT of ``examples/gpt.py``
(``cpu_small``, 10.3M parameters, a micro-batch of 2 sequences, AdamW, k = 4,
weighted by tokens) and a 4-layer MLP 1024 wide (4.2M parameters, a
micro-batch of 8 rows, AdamW). Per step: the working memory (``temp``, read
from the peak on XLA:TPU), whether the inner optimizer is reachable only
through a branch (a conditional or the boundary's loop: Adam's sqrt is the
marker), the conditionals, the selects, and the copies of 1,000 elements or
more.

Run ``python benchmarks/bench_compilers.py --out benchmarks/results`` (two
minutes on 2 cores; ``--quick``: a tiny GPT and a 128-wide MLP), or through
``benchmarks/run.py``. Without the ``compilers`` extra only XLA:CPU's rows are
made.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import harness  # noqa: E402
from transformer.steps import Key, gpt, init_state, step_fn  # noqa: E402

import optax_accum  # noqa: E402
from optax_accum import _targets  # noqa: E402
from tests.helpers import hlo  # noqa: E402

MiB = 2**20
K = 4
SIZES = {  # the GPT preset and the MLP's width
    "full": {"gpt": "cpu_small", "width": 1024},
    "quick": {"gpt": "tiny", "width": 128},
}


def gpt_step(mode, preset):
    cfg = gpt.preset(preset)
    params = jax.eval_shape(lambda: gpt.init_params(cfg))
    fn, kind = step_fn(Key(mode, "none", "f32", K, 2), cfg)
    state = jax.eval_shape(lambda p: init_state(kind, p), params)
    batch = jax.eval_shape(lambda: gpt.random_batch(jax.random.key(0), cfg, 2))
    return fn, (params, state, batch)


def mlp_step(mode, width):
    params = [
        {"w": jax.ShapeDtypeStruct((width, width), jnp.float32),
         "b": jax.ShapeDtypeStruct((width,), jnp.float32)}
        for _ in range(4)
    ]  # fmt: skip
    inner = optax.adamw(1e-3, weight_decay=0.1)
    if mode == "accumulate":
        tx = optax_accum.accumulate(inner, K)
    else:
        tx = optax.MultiSteps(inner, K).gradient_transformation()

    def loss(p, x):
        h = x
        for i, layer in enumerate(p):
            h = h @ layer["w"] + layer["b"]
            h = jnp.tanh(h) if i < len(p) - 1 else h
        return jnp.mean(h**2)

    def step(p, s, x):
        updates, s = tx.update(jax.grad(loss)(p, x), s, p)
        return optax.apply_updates(p, updates), s

    state = jax.eval_shape(tx.init, params)
    return step, (params, state, jax.ShapeDtypeStruct((8, width), jnp.float32))


def compile_on(target, fn, args):
    """The optimized HLO, and (temp, peak) in bytes."""
    if target == "cpu":
        program = jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile()
        one = jax.sharding.Mesh(jax.devices("cpu")[:1], ("data",))
        compiled = _targets.Compiled(program, "cpu", "XLA:CPU", one)
    else:
        compiled = _targets.compile_for(fn, *args, target=target, donate_argnums=(0, 1))
    m = compiled.memory()
    return compiled.as_text(), (m.temp, m.peak)


def facts(text):
    comps, _ = hlo.computations(text)
    guarded = hlo.reachable(comps, hlo.branch_roots(comps) | hlo.while_bodies(comps))
    sqrt = {c for c, lines in comps.items() for ln in lines if " sqrt(" in ln}
    return {
        "in_branch": bool(sqrt) and sqrt <= guarded,
        "conditionals": text.count(" conditional("),
        "selects": len(re.findall(r" select\(", text)),
        "large_copies": len(hlo.large_copies(comps)),
    }


def measure(quick: bool = False, rounds: int | None = None) -> dict:
    del rounds  # compiled, not timed
    sizes = SIZES["quick" if quick else "full"]
    targets = ["cpu"] + [t for t in ("h100", "v5e") if _targets.available(t)]
    models = (
        (f"GPT {sizes['gpt']}", gpt_step, sizes["gpt"]),
        (f"MLP {sizes['width']}", mlp_step, sizes["width"]),
    )
    rows = []
    for model, make, size in models:
        for target in targets:
            for mode in ("accumulate", "multisteps"):
                text, (temp, peak) = compile_on(target, *make(mode, size))
                rows.append(
                    {"model": model, "compiler": target, "step": mode,
                     "temp": temp, "peak": peak, **facts(text)}
                )  # fmt: skip
    return {"rows": rows}


def markdown(data: dict) -> str:
    lines = [
        f"Made by `{data.get('command', 'python benchmarks/bench_compilers.py')}`. "
        "Compiled, not run: XLA:GPU for an H100 and XLA:TPU for a v5e chip "
        "without the devices (the `compilers` extra). One micro-step of "
        "`accumulate` and of `optax.MultiSteps` (AdamW, k = 4, state donated); "
        "ratios are `accumulate`'s over `optax.MultiSteps`' in the same "
        "compiler. Temp is the working memory (on XLA:TPU the peak less "
        "arguments and outputs); the inner optimizer is in a branch where "
        "Adam's sqrt is reachable only through a conditional or the "
        "boundary's loop.",
        "",
        "| model | compiler | step | temp MiB | ratio | peak MiB | ratio "
        "| inner in a branch | conditionals | selects | large copies |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    ours = {}
    for r in data["rows"]:
        ratios = ["", ""]
        if r["step"] == "accumulate":
            ours[r["model"], r["compiler"]] = r
        else:
            a = ours[r["model"], r["compiler"]]
            ratios = [f"{a[q] / max(r[q], 1):.2f}" for q in ("temp", "peak")]
        lines.append(
            f"| {r['model']} | {r['compiler']} | {r['step']} | {r['temp'] / MiB:.2f} "
            f"| {ratios[0]} | {r['peak'] / MiB:.1f} | {ratios[1]} | {r['in_branch']} "
            f"| {r['conditionals']} | {r['selects']} | {r['large_copies']} |"
        )
    return "\n".join(lines)


def _measure(quick: bool = False, rounds: int | None = None) -> dict:
    return {**measure(quick, rounds), "command": harness.report.command_line()}


if __name__ == "__main__":
    raise SystemExit(harness.script_main("compilers", __doc__, _measure, markdown))
