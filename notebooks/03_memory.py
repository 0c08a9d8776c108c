# ---
# jupyter:
#   accelerator: TPU
#   colab:
#     name: 03_memory.ipynb
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
# # How much memory does a micro-batch need?
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/optax-accum/optax_accum/blob/main/notebooks/03_memory.ipynb)
#
# Gradient accumulation trades time for memory: `k` micro-batches of size
# `b` need the activations of `b` examples, not `k * b`. This notebook
# measures it without running anything: each step is compiled ahead of
# time for abstract shapes and XLA's memory analysis
# (`jax.jit(f).lower(...).compile().memory_analysis()`) reports its
# argument, output and temporary bytes. Then it asks which micro-batch
# size fits a memory budget.
#
# Three ways to take one optimizer step on `k * b` examples:
#
# * **accumulate**: `k` calls of a jitted step on `b` examples each, with
#   `optax_accum.accumulate` (the batch streams in one micro-batch at a
#   time);
# * **microbatch**: one jitted step on the whole `k * b` batch that loops
#   over `k` micro-batches with `optax_accum.microbatch` (a `lax.scan`);
# * **full batch**: one step on `k * b` examples, no accumulation.

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

# TPUs multiply float32 matrices in bfloat16 passes by default; the exactness
# checks below compare float32 results, so ask for full precision.
jax.config.update("jax_default_matmul_precision", "highest")

BACKEND = jax.default_backend()
FULL = BACKEND != "cpu"  # small sizes on the CPU, full sizes on a TPU or GPU
print(f"JAX {jax.__version__}, backend {BACKEND!r}, {jax.device_count()} device(s):")
for device in jax.devices():
    print("   ", device)

# %%
import functools
import math

import matplotlib.pyplot as plt
import matplotlib.ticker
import optax
from jax import numpy as jnp

import optax_accum

DIM, HIDDEN, LAYERS, CLASSES = (1024, 4096, 4, 1000) if FULL else (64, 512, 3, 10)
MiB = 2**20


def init_params(key):
    sizes = [DIM] + [HIDDEN] * LAYERS + [CLASSES]
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (m, n)) / math.sqrt(m), "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def loss_fn(params, batch):
    h = batch["x"]
    for layer in params[:-1]:
        h = jax.nn.gelu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


params = init_params(jax.random.key(0))
example = {"x": jnp.zeros(DIM), "y": jnp.zeros([], jnp.int32)}
num_params = sum(p.size for p in jax.tree.leaves(params))
print(f"{num_params:,} parameters ({4 * num_params / MiB:.1f} MiB in float32)")


# %% [markdown]
# ## The three steps
#
# Each step donates its parameters and optimizer state, as a real training
# loop does, so updated buffers reuse the old ones (XLA reports them as
# aliased).


# %%
def accumulate_step(k):
    tx = optax_accum.accumulate(optax.adamw(1e-3), every_k=k)

    def step(params, state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1)), tx.init(params)


def microbatch_step(k):  # k = 1 is the full-batch step
    tx = optax.adamw(1e-3)
    grad_fn = optax_accum.microbatch(jax.value_and_grad(loss_fn), k)

    def step(params, state, batch):
        _, grads = grad_fn(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1)), tx.init(params)


def batch_of(size):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((size, *x.shape), x.dtype), example
    )


@functools.cache
def memory(method, k, size):
    # XLA's memory analysis of one step of `method`, compiled for `size` examples.
    step, state = accumulate_step(k) if method == "accumulate" else microbatch_step(k)
    compiled = step.lower(params, state, batch_of(size)).compile()
    stats = compiled.memory_analysis()
    return {
        "temp": stats.temp_size_in_bytes,
        "argument": stats.argument_size_in_bytes,
        "output": stats.output_size_in_bytes,
        "alias": stats.alias_size_in_bytes,
        "peak": optax_accum.compiled_memory_bytes(compiled),  # arg + out - alias + temp
    }


def per_update(method, k, b):
    # The memory of one update made of k micro-batches of b examples.
    if method == "accumulate":
        # k calls of one step on b examples; k is a constant inside it that
        # does not change its buffers, so one k (K, below) stands for all.
        return memory("accumulate", K, b)
    return memory("microbatch", k if method == "microbatch" else 1, k * b)


K = 8
m = per_update("accumulate", K, 64)
print(
    "accumulate step, 64 examples:", {key: f"{v / MiB:.2f} MiB" for key, v in m.items()}
)

# %% [markdown]
# ## Peak memory against the micro-batch size and against `k`

# %%
METHODS = ["accumulate", "microbatch", "full batch"]
SIZES = [16, 64, 256, 1024]  # the sweep over b, with k = K
B, KS = 64, [1, 2, 8, 32]  # the sweep over k
if FULL:
    SIZES, B = [64, 256, 1024, 4096], 1024

by_size = {name: [per_update(name, K, b) for b in SIZES] for name in METHODS}
by_k = {name: [per_update(name, k, B) for k in KS] for name in METHODS}

print(
    f"{'b':>6} {'method':>11} {'temp':>10} {'argument':>10} {'output':>10} "
    f"{'peak':>10}  (MiB, k={K})"
)
for i, b in enumerate(SIZES):
    for name, rows in by_size.items():
        r = {key: v / MiB for key, v in rows[i].items()}
        print(
            f"{b:6d} {name:>11} {r['temp']:10.2f} {r['argument']:10.2f} "
            f"{r['output']:10.2f} {r['peak']:10.2f}"
        )

# %%
fig, (ax_b, ax_k) = plt.subplots(1, 2, figsize=(12, 4.5))
styles = {
    "accumulate": ("C0", "o"),
    "microbatch": ("C1", "s"),
    "full batch": ("C2", "^"),
}
for name, (color, marker) in styles.items():
    for ax, xs, rows in [(ax_b, SIZES, by_size[name]), (ax_k, KS, by_k[name])]:
        ax.plot(
            xs,
            [r["peak"] / MiB for r in rows],
            "-",
            color=color,
            marker=marker,
            label=f"{name}: peak",
        )
        ax.plot(
            xs,
            [r["temp"] / MiB for r in rows],
            ":",
            color=color,
            marker=marker,
            alpha=0.5,
            label=f"{name}: temp",
        )
ax_b.set(xlabel="micro-batch size b", title=f"k = {K}: {K}·b examples per update")
ax_k.set(
    xlabel="micro-batches per update k", title=f"b = {B}: k·{B} examples per update"
)
for ax in (ax_b, ax_k):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_ylabel("MiB")
    ax.grid(True, which="both", alpha=0.3)
ax_b.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# What the plots show:
#
# * **full batch**: temporary memory (the activations kept for the
#   backward pass) grows linearly with the number of examples per update.
# * **microbatch**: temporary memory is that of one micro-batch plus one
#   gradient accumulator, whatever `k`; only the input batch (an argument)
#   grows with `k`.
# * **accumulate**: one call sees one micro-batch, so nothing grows with
#   `k`; the accumulator lives in the optimizer state (one extra copy of
#   the parameters).

# %%
temp_k = [r["temp"] for r in by_k["microbatch"]]
assert max(temp_k[1:]) <= 1.1 * temp_k[1], "microbatch temp memory must not grow with k"
full_temp = [r["temp"] for r in by_k["full batch"]]
assert full_temp[-1] > 4 * full_temp[1], "full-batch temp memory grows with the batch"
print(
    f"microbatch temp, k={KS[1]}..{KS[-1]}: "
    f"{[round(t / MiB, 2) for t in temp_k[1:]]} MiB"
)
print(
    f"full batch temp, same batches:  {[round(t / MiB, 2) for t in full_temp[1:]]} MiB"
)

# %% [markdown]
# ## What fits a given budget?
#
# `optax_accum.plan_microbatch` does this search for you: a binary
# search over micro-batch sizes, each one compiled ahead of time and never
# run, so there is no out-of-memory trial on the device. It returns the
# largest micro-batch size whose step fits the budget and the `k` that
# reaches the target batch size. On a TPU or GPU the default budget is the
# device's free memory; the CPU reports none, so the notebook picks one.

# %%
TARGET = 2**16 if FULL else 8192  # examples per optimizer update
BUDGET = None if FULL else 24 * MiB  # None: the device's free memory

step, state = accumulate_step(K)  # its memory does not depend on k
plan = optax_accum.plan_microbatch(
    step, params, state, example, TARGET, memory_budget=BUDGET
)
print(plan)
print(
    f"budget {plan.memory_budget / MiB:,.1f} MiB: "
    f"micro-batches of {plan.microbatch_size} "
    f"({plan.memory_bytes / MiB:,.1f} MiB), k = {plan.num_microbatches}, "
    f"found with {plan.num_compilations} compilations"
)
if plan.next_microbatch_size is not None:
    print(
        f"the next size up, {plan.next_microbatch_size}, "
        f"needs {plan.next_memory_bytes / MiB:,.1f} MiB"
    )

# %% [markdown]
# Check the plan against the measurement, and take one real update with it:

# %%
measured = memory("accumulate", K, plan.microbatch_size)["peak"]
assert measured <= plan.memory_budget, (measured, plan.memory_budget)
if plan.next_microbatch_size is not None:
    above = memory("accumulate", K, plan.next_microbatch_size)["peak"]
    assert above > plan.memory_budget, (above, plan.memory_budget)
whole = memory("microbatch", 1, TARGET)["peak"]
print(f"the full batch of {TARGET} would need {whole / MiB:,.1f} MiB")

step, state = accumulate_step(plan.num_microbatches)
p = jax.tree.map(jnp.copy, params)  # the step donates its inputs
for i in range(plan.num_microbatches):
    k_x, k_y = jax.random.split(jax.random.key(i))
    batch = {
        "x": jax.random.normal(k_x, (plan.microbatch_size, DIM)),
        "y": jax.random.randint(k_y, (plan.microbatch_size,), 0, CLASSES),
    }
    p, state = step(p, state, batch)
assert optax_accum.has_updated(state)
print(
    f"one update of {plan.effective_batch_size} examples "
    f"in {plan.num_microbatches} micro-steps"
)
