# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The planner's micro-batch for one GPT on the CPU, an H100 and a TPU v5e.

``plan_fused_step`` plans the fused step (``microbatch_value_and_grad`` then
AdamW, parameters and state donated) of ``examples/gpt.py``'s ``cpu_small``
model (10.3M parameters, 128-token sequences) for a batch of 16,384
sequences, micro-batches a multiple of 256: compiled by XLA:GPU for an H100
80GB and by XLA:TPU for a v5e chip (``target=``, the ``compilers`` extra, no
device needed), each against its device's memory; and by XLA:CPU against the
same two budgets. The planner guide shows the table and explains it.

Run ``python benchmarks/plan_targets.py`` (about ten minutes on 2 cores: a
GPT compiles in 10 s for XLA:CPU, 20 s for XLA:GPU and up to 2 minutes for
XLA:TPU); it writes ``benchmarks/results/plan_targets.json`` and ``.md``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the plans' CPU is this one

import jax
import optax

import optax_accum
from optax_accum import _targets

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BATCH = 16_384  # sequences per update (2.1M tokens)
MULTIPLE = 256  # candidates: 256, 512, ..., 16,384
GiB = 2**30


def _gpt():
    spec = importlib.util.spec_from_file_location("gpt", ROOT / "examples" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpt", gpt)  # its dataclasses look themselves up
    spec.loader.exec_module(gpt)
    return gpt


gpt = _gpt()
CONFIG = gpt.preset("cpu_small")
loss = gpt.make_loss(CONFIG)
tx = optax.adamw(1e-3)
params = jax.eval_shape(lambda: gpt.init_params(CONFIG))  # shapes only
opt_state = jax.eval_shape(tx.init, params)
example = gpt.example(CONFIG)


def make_step(k):
    """The train step for ``k`` micro-batches per update."""
    grad_fn = optax_accum.microbatch_value_and_grad(loss, k)

    def step(params, opt_state, batch):
        value, grads = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1))


def plan(target=None, memory_budget=None):
    """`plan_fused_step` for ``target`` (None: this machine's CPU)."""
    return optax_accum.plan_fused_step(
        make_step,
        params,
        opt_state,
        example,
        BATCH,
        multiple_of=MULTIPLE,
        memory_budget=memory_budget,
        target=target,
    )


def rows() -> list[dict]:
    """One row per plan: an H100 and the CPU at its memory, then a v5e."""
    out = []
    for target in ("h100", "v5e"):
        memory = _targets.device_memory(target)
        for where, p in (("cpu", plan(None, memory)), (target, plan(target))):
            out.append({"where": where, **p._asdict()})
    return out


def markdown(rows: list[dict]) -> str:
    lines = [
        "| compiled for | budget (GiB) | micro-batch | k | peak (GiB) | next size "
        "(GiB) | compiler |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        nxt = r["next_microbatch_size"]
        if nxt is not None:
            nxt = f"{nxt}: {r['next_memory_bytes'] / GiB:.2f}"
        lines.append(
            f"| {r['where']} | {r['memory_budget'] / GiB:.2f} | "
            f"{r['microbatch_size']} | {r['num_microbatches']} | "
            f"{r['memory_bytes'] / GiB:.2f} | "
            f"{nxt or '-'} | {r['compiler']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    result = rows()
    (RESULTS / "plan_targets.json").write_text(json.dumps(result, indent=1) + "\n")
    text = (
        f"# The planner on three compilers\n\n`python benchmarks/plan_targets.py`: "
        f"`examples/gpt.py` cpu_small, AdamW, a fused step of {BATCH:,} "
        f"sequences, micro-batches a multiple of {MULTIPLE}.\n\n" + markdown(result)
    )
    (RESULTS / "plan_targets.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
