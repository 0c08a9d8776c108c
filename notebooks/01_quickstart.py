# ---
# jupyter:
#   accelerator: TPU
#   colab:
#     name: 01_quickstart.ipynb
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
# # optax_accum quickstart
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/optax-accum/optax_accum/blob/main/notebooks/01_quickstart.ipynb)
#
# `optax_accum.accumulate` wraps any optax optimizer so that it sees the
# mean gradient of `k` micro-batches as one step. This notebook shows
#
# 1. `accumulate` around an optax chain (clipping and AdamW),
# 2. that `k` accumulated micro-steps give the same parameters as one step on
#    the `k`-times larger batch, and
# 3. migrating from `optax.MultiSteps` by changing one import.

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

# %% [markdown]
# ## A small regression problem
#
# A two-layer MLP fitted to a noisy nonlinear target. Sizes depend on the
# backend: a few seconds on a laptop CPU, larger on a TPU or GPU.

# %%
import jax.numpy as jnp
import optax

import optax_accum

K = 4  # micro-batches per optimizer update
MICRO_BATCH = 512 if FULL else 32
NUM_UPDATES = 50 if FULL else 15
DIM, HIDDEN = (256, 1024) if FULL else (16, 64)

k_x, k_w, k_noise, k_init = jax.random.split(jax.random.key(0), 4)
num_examples = NUM_UPDATES * K * MICRO_BATCH
x = jax.random.normal(k_x, (num_examples, DIM))
w_true = jax.random.normal(k_w, (DIM,)) / jnp.sqrt(DIM)
y = jnp.sin(3 * x @ w_true) + 0.1 * jax.random.normal(k_noise, (num_examples,))


def init_params(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (DIM, HIDDEN)) / jnp.sqrt(DIM),
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN,)) / jnp.sqrt(HIDDEN),
    }


def loss_fn(params, x, y):
    hidden = jax.nn.gelu(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - y) ** 2)


def make_optimizer():
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(3e-3, weight_decay=1e-4),
    )


params0 = init_params(k_init)
print(f"{num_examples} examples, {K} micro-batches of {MICRO_BATCH} per update")

# %% [markdown]
# ## `accumulate` in an optax chain
#
# Wrap the whole chain: clipping and AdamW then see one accumulated gradient
# per update, so the clipping threshold, Adam's moment estimates, its step
# count and the weight decay all count optimizer steps, not micro-steps.
# On the `k - 1` hold steps the updates are exact zeros.

# %%
tx = optax_accum.accumulate(make_optimizer(), every_k=K)


@jax.jit
def micro_step(params, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


def micro_batches(update):
    start = update * K * MICRO_BATCH
    for i in range(K):
        lo = start + i * MICRO_BATCH
        yield x[lo : lo + MICRO_BATCH], y[lo : lo + MICRO_BATCH]


params, state = params0, tx.init(params0)
windows = []  # per update: (params, inner optimizer state) before, params after
for update in range(NUM_UPDATES):
    before = (params, state.inner_state)
    for i, (xb, yb) in enumerate(micro_batches(update)):
        params, state, loss = micro_step(params, state, xb, yb)
        if update == 0:
            print(
                f"micro-batch {i + 1}/{K}: loss {float(loss):.4f}, "
                f"updated={bool(optax_accum.has_updated(state))}"
            )
    windows.append((before, params))
updates = int(optax_accum.update_count(state))
print(f"optimizer updates: {updates}, final micro-batch loss {loss:.4f}")

# %% [markdown]
# ## Each update equals one large-batch step
#
# The reference: the same optimizer taking one step on all `K * MICRO_BATCH`
# examples of the window, from the same parameters and optimizer state.
# Every micro-batch has the same size and the loss is a mean, so the mean of
# the `K` micro-batch gradients is the large-batch gradient, and the two
# must agree to float32 rounding, for every one of the updates.

# %%
big_tx = make_optimizer()


@jax.jit
def big_step(params, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = big_tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


def relative_distance(a, b):
    # ‖a - b‖ / ‖b‖ over all leaves; float32 rounding is about 1e-7.
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    num = sum(jnp.sum((x - y) ** 2) for x, y in zip(a, b, strict=True))
    return float(jnp.sqrt(num / sum(jnp.sum(y**2) for y in b)))


size = K * MICRO_BATCH
distances = []
for update, ((params, inner_state), after) in enumerate(windows):
    window = slice(update * size, (update + 1) * size)
    expected, _, big_loss = big_step(params, inner_state, x[window], y[window])
    distances.append(relative_distance(after, expected))
    if update % 5 == 4:
        print(
            f"update {update + 1:3d}: large-batch loss {float(big_loss):.4f}, "
            f"relative distance to accumulate {distances[-1]:.1e}"
        )
assert max(distances) < 1e-5, max(distances)
print(f"accumulate(k={K}) == one large-batch step, for all {NUM_UPDATES} updates")


# %% [markdown]
# Two separate float32 runs, one accumulated and one on large batches, start
# out as close as this, then drift apart slowly, as any two runs that add the
# same numbers in a different order do: Adam divides by the gradient's RMS,
# which magnifies last-bit differences where a gradient is almost zero.
# Notebook 02 plots such trajectories.

# %% [markdown]
# ## Migrating from `optax.MultiSteps`
#
# `optax_accum.MultiSteps` takes the same arguments, has the same methods and
# optax's state fields (plus one of its own, after them, with a default), so
# migrating is one changed name:
#
# ```python
# opt = optax.MultiSteps(optimizer, every_k_schedule=K)        # before
# opt = optax_accum.MultiSteps(optimizer, every_k_schedule=K)  # after
# ```
#
# The inner optimizer then runs only on the boundary steps, inside one
# `lax.cond`; `optax.MultiSteps` runs it on every micro-step and keeps the
# result on the last one. Below, the same loop with either class:


# %%
def run_multisteps(multi_steps_cls, num_micro_steps):
    opt = multi_steps_cls(make_optimizer(), every_k_schedule=K)

    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, state = params0, opt.init(params0)
    for i in range(num_micro_steps):
        lo = i * MICRO_BATCH
        params, state = step(
            params, state, x[lo : lo + MICRO_BATCH], y[lo : lo + MICRO_BATCH]
        )
    return params, state, opt


steps = 3 * K + 1  # three updates and one micro-batch into the fourth window
optax_params, optax_state, _ = run_multisteps(optax.MultiSteps, steps)
ours_params, ours_state, ours = run_multisteps(optax_accum.MultiSteps, steps)

# optax's fields, in order; ours adds `acc_value` (the window's loss, `()`
# unless the optimizer reads `value`), with a default.
n = len(type(optax_state)._fields)
assert type(ours_state)._fields[:n] == type(optax_state)._fields
print("state fields:", type(ours_state)._fields)
assert relative_distance(ours_params, optax_params) < 1e-5
assert relative_distance(ours_state.acc_grads, optax_state.acc_grads) < 1e-5
print(
    f"gradient_step={int(ours_state.gradient_step)}, "
    f"mini_step={int(ours_state.mini_step)}"
)
print("optax.MultiSteps and optax_accum.MultiSteps agree")

# %% [markdown]
# Because the state fields and their meaning match, a state saved by
# `optax.MultiSteps`, even in the middle of a window, continues in
# `optax_accum.MultiSteps`:

# %%
restored = optax_accum.MultiStepsState(*optax_state)
grads = jax.grad(loss_fn)(optax_params, x[:MICRO_BATCH], y[:MICRO_BATCH])
_, from_optax = ours.update(grads, restored, optax_params)
_, from_ours = ours.update(grads, ours_state, ours_params)
assert int(from_optax.mini_step) == int(from_ours.mini_step) == 2
assert relative_distance(from_optax.acc_grads, from_ours.acc_grads) < 1e-5
assert relative_distance(from_optax.inner_opt_state, from_ours.inner_opt_state) < 1e-5
print(
    "resumed an optax.MultiSteps state mid-window:", int(from_optax.mini_step), "of", K
)

# %% [markdown]
# ## Next
#
# * [02_token_weighting](02_token_weighting.ipynb): exact token-weighted
#   accumulation for padded sequences, with a Flax nnx language model.
# * [03_memory](03_memory.ipynb): how much memory a micro-batch size needs.
# * [04_pod_scale](04_pod_scale.ipynb): `optax_accum.microbatch` on a
#   sharded mesh of 8 devices.
