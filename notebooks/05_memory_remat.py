# ---
# jupyter:
#   accelerator: TPU
#   colab:
#     name: 05_memory_remat.ipynb
#     provenance: []
#   jupytext:
#     cell_metadata_filter: -all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: accelerator,colab,kernelspec,language_info,-jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
#   language_info:
#     name: python
# ---

# %% [markdown]
# # Memory: remat × precision × accumulation
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/optax-accum/optax_accum/blob/main/notebooks/05_memory_remat.ipynb)
#
# Gradient accumulation is one of three memory techniques people combine when
# training a transformer:
#
# * **accumulation**: `k` micro-batches of `b` sequences per optimizer step
#   instead of one batch of `k * b`;
# * **activation checkpointing** (remat): keep fewer activations for the
#   backward pass and recompute the rest (`nnx.remat` with a policy);
# * **mixed precision**: run the matrix products in bfloat16, keep the
#   parameters, the optimizer state and the gradient accumulator in float32.
#
# This notebook measures how far each combination takes you, on the GPT-style
# decoder of `examples/gpt.py` (GPT-2 small on a GPU or TPU, a tiny one on the
# CPU). Nothing is run to measure memory: every step is compiled ahead of time
# and XLA's memory analysis gives its peak, `argument + output - alias + temp`
# bytes (`optax_accum.compiled_memory_bytes`). Time is in the transformer
# table of `benchmarks/results/transformer_cpu.md` (`python
# benchmarks/bench_transformer.py`).

# %%
# Installs optax_accum where it is missing (a fresh Colab runtime) and keeps
# the runtime's jax, jaxlib and accelerator plugins exactly as they are: they
# go to pip as constraints, so it never replaces them. Where optax_accum
# already imports (a local checkout, CI) the cell does nothing and needs no
# network. The package comes from the first of:
#   1. a wheel uploaded to /content (Colab's Files pane), e.g.
#      /content/optax_accum-0.1.0-py3-none-any.whl, built in a clone with
#      `python -m build --wheel` (it lands in dist/);
#   2. a clone of the repository at /content/optax_accum
#      (`!git clone <repository URL> /content/optax_accum`);
#   3. the package index: `optax_accum` once it is published there.
# (Plain Python rather than `%pip`, so that this source also runs as a script.)
import glob
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile

if importlib.util.find_spec("optax_accum") is None:
    wheels = sorted(glob.glob("/content/optax_accum-*.whl"))
    if wheels:
        source = wheels[-1]
    elif os.path.isdir("/content/optax_accum"):
        source = "/content/optax_accum"
    else:
        source = "optax_accum"
    keep = sorted(
        f"{d.metadata['Name']}=={d.version}"
        for d in importlib.metadata.distributions()
        if d.metadata["Name"].lower().startswith(("jax", "libtpu"))
    )
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pins:
        pins.write("\n".join(keep))
    pip = [sys.executable, "-m", "pip", "install", "-q", "-c", pins.name]
    subprocess.run([*pip, f"{source}[examples]"], check=True)
    print(f"Installed optax_accum from {source}; kept {', '.join(keep) or 'no jax'}")

# %%
import jax

BACKEND = jax.default_backend()
FULL = BACKEND != "cpu"  # small sizes on the CPU, full sizes on a TPU or GPU
print(f"JAX {jax.__version__}, backend {BACKEND!r}, {jax.device_count()} device(s):")
for device in jax.devices():
    print("   ", device)

# %% [markdown]
# ## The reference model
#
# `examples/gpt.py` ships with the source, not with the installed package.
# The notebook loads it from the first place that has it: the checkout this
# notebook runs from, a clone at `/content/optax_accum`, or a `gpt.py` you
# uploaded next to the notebook (on Colab: the Files pane, into `/content`).

# %%
import functools
import pathlib

import matplotlib.pyplot as plt
import optax
from jax import numpy as jnp

import optax_accum

candidates = [
    pathlib.Path(optax_accum.__file__).resolve().parents[1] / "examples/gpt.py",
    pathlib.Path("/content/optax_accum/examples/gpt.py"),
    pathlib.Path("gpt.py").resolve(),
    pathlib.Path("/content/gpt.py"),
]
path = next((p for p in candidates if p.is_file()), None)
if path is None:
    raise FileNotFoundError(
        "this notebook needs examples/gpt.py of the optax_accum repository: "
        "upload it next to the notebook (on Colab, to /content) or clone the "
        "repository to /content/optax_accum; looked in "
        + ", ".join(map(str, candidates))
    )
spec = importlib.util.spec_from_file_location("gpt", path)
gpt = importlib.util.module_from_spec(spec)
sys.modules["gpt"] = gpt  # its dataclasses look the module up by name
spec.loader.exec_module(gpt)

# On the CPU: a tiny model whose activations (long sequences, small vocabulary)
# outweigh its parameters, as they do in a real one; it compiles in a second.
CFG = (
    gpt.preset("gpt2_small")
    if FULL
    else gpt.preset("tiny", n_layers=2, n_heads=4, seq_len=128)
)
MICRO = 4  # sequences per micro-batch
KS = [1, 2, 4, 8, 16] if FULL else [1, 4, 16]
REMATS = ["none", "dots", "full"]
DTYPES = ["float32", "bfloat16"]
MiB = 2**20

params = jax.eval_shape(lambda: gpt.init_params(CFG))  # shapes only, for now
num_params = gpt.num_params(params)
print(CFG)
print(f"{num_params:,} parameters ({4 * num_params / MiB:,.1f} MiB in float32)")

# %% [markdown]
# ## Two ways to accumulate, one to not
#
# Each step trains with AdamW and donates its parameters and optimizer
# state, as a real training loop does.
#
# * **`microbatch`**: one compiled step on all `k * b` sequences that loops
#   over the `k` micro-batches in a `lax.scan`, weighting each by its number of
#   tokens (the exact token mean of the whole batch);
# * **`accumulate`**: `k` calls of a step on `b` sequences, the optimizer
#   wrapped in `optax_accum.accumulate` (the batch streams in one micro-batch at
#   a time; `k` does not change the step's buffers);
# * **full batch**: `microbatch` with `k = 1`, no loop.

# %%
tx = optax.adamw(3e-4, weight_decay=0.1)


def variant(remat, dtype):
    return gpt.make_loss(CFG.replace(remat=remat, dtype=dtype))


def microbatch_step(remat, dtype, k):
    grad_fn = optax_accum.microbatch(
        jax.value_and_grad(variant(remat, dtype)), k, weight_fn=gpt.token_count
    )

    def step(params, opt_state, batch):
        _, grads = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1)), tx.init(params)


def accumulate_step(remat, dtype, k=1):
    acc = optax_accum.accumulate(tx, every_k=k)
    loss = variant(remat, dtype)

    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = acc.update(
            grads, opt_state, params, weight=gpt.token_count(batch)
        )
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1)), acc.init(params)


def batch_of(rows):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((rows, *x.shape), x.dtype), gpt.example(CFG)
    )


@functools.cache
def compiled_peak(method, remat, dtype, k, rows):
    step, state = (accumulate_step if method == "accumulate" else microbatch_step)(
        remat, dtype, k
    )
    compiled = step.lower(params, state, batch_of(rows)).compile()
    return optax_accum.compiled_memory_bytes(compiled)


def peak(method, remat, dtype, k):
    # Compiled peak memory of one call, for an update of k micro-batches.
    if method == "accumulate":  # one call sees one micro-batch, whatever k
        return compiled_peak("accumulate", remat, dtype, 1, MICRO)
    if method == "full":  # one step on the whole batch, no loop
        return compiled_peak("microbatch", remat, dtype, 1, k * MICRO)
    return compiled_peak("microbatch", remat, dtype, k, k * MICRO)


# %% [markdown]
# ## Peak memory against the effective batch
#
# At a fixed micro-batch of `b` sequences, `k` micro-batches make an
# effective batch of `k * b`. One line per combination of remat policy and
# compute dtype, for both ways to accumulate, against the full batch.

# %%
COMBOS = [(remat, dtype) for remat in REMATS for dtype in DTYPES]
peaks = {
    ("microbatch", remat, dtype): [peak("microbatch", remat, dtype, k) for k in KS]
    for remat, dtype in COMBOS
}

# %%
for remat, dtype in COMBOS:
    peaks["accumulate", remat, dtype] = [
        peak("accumulate", remat, dtype, k) for k in KS
    ]
for remat, dtype in [("none", "float32"), ("full", "bfloat16")]:
    peaks["full", remat, dtype] = [peak("full", remat, dtype, k) for k in KS]

print(f"peak MiB; micro-batch {MICRO}, effective batch k x {MICRO} sequences")
header = "".join(f"{'k=' + str(k):>9}" for k in KS)
print(f"{'step':>10} {'remat':>5} {'compute':>8} {header}")
for (method, remat, dtype), row in peaks.items():
    cells = "".join(f"{p / MiB:9.2f}" for p in row)
    print(f"{method:>10} {remat:>5} {dtype:>8} {cells}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
colors = {"none": "C0", "dots": "C1", "full": "C2"}
styles = {"float32": "-", "bfloat16": "--"}
batches = [k * MICRO for k in KS]
for ax, method in zip(axes, ["microbatch", "accumulate"], strict=True):
    for remat, dtype in COMBOS:
        ax.plot(
            batches,
            [p / MiB for p in peaks[method, remat, dtype]],
            styles[dtype],
            color=colors[remat],
            marker="o",
            label=f"remat {remat}, {dtype}",
        )
    for remat, dtype in [("none", "float32"), ("full", "bfloat16")]:
        ax.plot(
            batches,
            [p / MiB for p in peaks["full", remat, dtype]],
            ":",
            color=colors[remat],
            marker="^",
            label=f"full batch, remat {remat}, {dtype}",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("effective batch (sequences)")
    ax.set_title(f"{method}: micro-batch {MICRO}, k = {KS[0]}..{KS[-1]}")
    ax.grid(True, which="both", alpha=0.3)
axes[0].set_ylabel("compiled peak memory (MiB)")
axes[1].legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# What the plot shows:
#
# * **full batch**: the activations kept for the backward pass grow with the
#   batch; remat and bfloat16 lower the slope, they do not flatten it.
# * **`microbatch`**: flat in `k`. From `k = 2` on the loop carries one float32
#   gradient accumulator (the size of the parameters), then nothing more.
# * **`accumulate`**: one call sees one micro-batch, so nothing depends on
#   `k`; the accumulator lives in the optimizer state.
# * **remat** shrinks what one micro-batch keeps: `dots` saves only the
#   outputs of the weight matrix products, `full` only each block's input.
#   **bfloat16** halves the activations that are kept, but the step also
#   holds extra copies of the weights, so on a small model (and on the CPU)
#   it can cost more than it saves.

# %%
for remat, dtype in COMBOS:
    row = peaks["microbatch", remat, dtype]
    assert max(row[1:]) <= 1.1 * row[1], (remat, dtype, row)  # flat from k = 2
full_row = peaks["full", "none", "float32"]
assert full_row[-1] > 2 * full_row[0], full_row
print("microbatch: flat in k from k = 2; the full batch grows with it")
remat_saving = {
    (method, dtype): peaks[method, "full", dtype][-1] / peaks[method, "none", dtype][-1]
    for method in ["microbatch", "accumulate"]
    for dtype in DTYPES
}
print("peak with full remat / without, at the largest k:")
for (method, dtype), ratio in remat_saving.items():
    print(f"  {method:>10} {dtype:>8}: {ratio:.3f}")

# %% [markdown]
# On a GPU or TPU, remat lowers the peak of every micro-batch. On the CPU it
# does not: XLA:CPU does recompute (the compiled step has more matrix
# products with remat), but its scheduler runs the recomputation early, so the
# recomputed activations are alive as long as saved ones would be. The CPU
# rows of this notebook (and benchmarks/results/transformer_cpu.md) show
# accumulation and precision; the remat rows need an accelerator.

# %% [markdown]
# ## What the state costs: bfloat16 compute, float32 state
#
# The compute dtype changes what the step keeps while it runs, not what it
# carries between steps: the parameters stay float32, AdamW's two moments are
# float32, and `accumulate` adds one float32 accumulator (its default
# `accumulator_dtype`), whatever the gradients' dtype.

# %%
param_bytes = 4 * num_params
for remat, dtype in COMBOS:
    _, state = accumulate_step(remat, dtype)
    acc_leaves = jax.tree.leaves(state.accumulator)
    assert {x.dtype for x in acc_leaves} == {jnp.dtype("float32")}
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    print(
        f"remat {remat:>4}, {dtype:>8}: params {param_bytes / MiB:,.1f} MiB, "
        f"optimizer state {state_bytes / MiB:,.1f} MiB "
        f"= {state_bytes / param_bytes:.2f} x params (Adam's m and v + accumulator)"
    )
    assert abs(state_bytes / param_bytes - 3) < 0.01

# %% [markdown]
# ## What fits a budget?
#
# `optax_accum.plan_microbatch` finds the largest micro-batch whose compiled
# `accumulate` step fits a memory budget (a binary search, each candidate
# compiled and never run). With `k` micro-batches of it, the effective batch is
# as large as you like; the table says how large one micro-batch can be, and
# so how few micro-batches (how little loop overhead) reach a target batch. On
# a TPU or GPU the budget is the device's free memory; the CPU reports none, so
# the notebook picks one.

# %%
TARGET = 1024 if FULL else 128  # sequences per optimizer update
BUDGET = None if FULL else 32 * MiB
plans = {}
for remat, dtype in COMBOS:
    step, state = accumulate_step(remat, dtype)
    plans[remat, dtype] = optax_accum.plan_microbatch(
        step,
        params,
        state,
        gpt.example(CFG),
        TARGET,
        memory_budget=BUDGET,
        max_microbatch_size=TARGET // 2,  # at least two micro-batches
    )
budget = next(iter(plans.values())).memory_budget
print(f"budget {budget / MiB:,.1f} MiB, target {TARGET} sequences per update")
print(f"{'remat':>5} {'compute':>8} {'micro-batch':>12} {'k':>4} {'peak MiB':>9}")
for (remat, dtype), plan in plans.items():
    print(
        f"{remat:>5} {dtype:>8} {plan.microbatch_size:12d} "
        f"{plan.num_microbatches:4d} {plan.memory_bytes / MiB:9.2f}"
    )
for plan in plans.values():
    assert plan.memory_bytes <= plan.memory_budget
    assert plan.microbatch_size * plan.num_microbatches == TARGET

# %% [markdown]
# Take one real update with the plan of bfloat16 compute and full remat,
# checked against the plan's budget:

# %%
plan = plans["full", "bfloat16"]
step, state = accumulate_step("full", "bfloat16", plan.num_microbatches)
compiled = step.lower(params, state, batch_of(plan.microbatch_size)).compile()
assert optax_accum.compiled_memory_bytes(compiled) <= plan.memory_budget
p = gpt.init_params(CFG)
state = jax.tree.map(jnp.copy, state)
for i in range(plan.num_microbatches):
    batch = gpt.random_batch(jax.random.key(i), CFG, plan.microbatch_size)
    p, state = compiled(p, state, batch)
assert optax_accum.has_updated(state)
print(
    f"one update of {plan.effective_batch_size} sequences in "
    f"{plan.num_microbatches} micro-batches of {plan.microbatch_size}"
)
