# ---
# jupyter:
#   accelerator: TPU
#   colab:
#     name: 06_batch_size.ipynb
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
# # How big should my batch be?
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/optax-accum/optax_accum/blob/main/notebooks/06_batch_size.ipynb)
#
# Gradient accumulation makes any batch size affordable, so the question
# becomes which one to use. McCandlish et al., "An Empirical Model of
# Large-Batch Training" (2018, arXiv 1812.06162), answer it with the
# **gradient noise scale** $B_\text{simple} = \operatorname{tr}(\Sigma) /
# |G|^2$: the batch at which the gradient's noise is as large as its signal.
# Below it, doubling the batch nearly halves the steps to a given loss; far
# above it, a larger batch buys few steps and wastes examples.
#
# An accumulation window already holds what the estimate needs: `k`
# micro-batch gradients and their mean, two batch sizes at the same
# parameters. With `noise_scale_decay`, `optax_accum.accumulate` measures
# it for the price of one squared norm per micro-step. This notebook
#
# 1. measures $B_\text{simple}$ along training on the digits data set,
# 2. sweeps fixed batch sizes and finds where the steps-to-target curve
#    bends, to compare with the prediction, and
# 3. trains once with `adaptive_every_k`, which sets `k` from the estimate.

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
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from sklearn.datasets import load_digits

import optax_accum

BACKEND = jax.default_backend()
print(f"JAX {jax.__version__}, backend {BACKEND!r}, {jax.device_count()} device(s):")
for device in jax.devices():
    print("   ", device)

# %% [markdown]
# ## The task
#
# scikit-learn's 8x8 digits (bundled, no download) and a one-hidden-layer
# MLP trained with plain SGD, the optimizer the paper's model describes.
# Batches are drawn at random from the 1,797 images; the target is a
# training loss of 0.1, measured on a fixed set of 512 images.

# %%
x_all, y_all = load_digits(return_X_y=True)
X = jnp.asarray(x_all / 16.0, jnp.float32)
Y = jnp.asarray(y_all, jnp.int32)
N = len(X)
X_EVAL, Y_EVAL = X[:512], Y[:512]
TARGET = 0.1


def init_params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (64, 64)) / 8.0,
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, 10)) / 8.0,
        "b2": jnp.zeros(10),
    }


def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


grad_fn = jax.grad(loss_fn)


def sample(key, size):
    idx = jax.random.randint(key, (size,), 0, N)
    return X[idx], Y[idx]


# %% [markdown]
# ## 1. Measuring the noise scale along training
#
# `k = 8` micro-batches of `b = 8` images per update, SGD with learning rate
# 0.5. `noise_scale(state, microbatch_size=b)` reads the EMA (decay 0.95
# over windows) in examples.

# %%
b, k, LR = 8, 8, 0.5
tx = optax_accum.accumulate(optax.sgd(LR), k, noise_scale_decay=0.95)


def micro_step(carry, key):
    params, state = carry
    updates, state = tx.update(grad_fn(params, *sample(key, b)), state, params)
    return (optax.apply_updates(params, updates), state), None


def one_update(carry, key):
    carry, _ = jax.lax.scan(micro_step, carry, jax.random.split(key, k))
    params, state = carry
    ns = optax_accum.noise_scale(state, microbatch_size=b)
    return carry, (loss_fn(params, X_EVAL, Y_EVAL), ns.b_simple)


@jax.jit
def measure(key, updates=300):
    params = init_params()
    carry = (params, tx.init(params))
    return jax.lax.scan(one_update, carry, jax.random.split(key, updates))[1]


losses, b_simple = map(np.asarray, measure(jax.random.key(1)))
at_target = int(np.argmax(losses < TARGET))
B_START, B_TARGET = float(b_simple[9]), float(b_simple[at_target])
print(f"B_simple after 10 updates: {B_START:.0f} examples (loss {losses[9]:.2f})")
print(
    f"B_simple when the loss reaches {TARGET}: {B_TARGET:.0f} examples "
    f"(update {at_target + 1})"
)

# %%
fig, ax = plt.subplots(figsize=(7, 3.6))
ax.plot(np.arange(1, len(b_simple) + 1), b_simple, color="tab:blue")
ax.set_xlabel("update")
ax.set_ylabel("$B_{simple}$ (examples)", color="tab:blue")
ax2 = ax.twinx()
ax2.plot(np.arange(1, len(losses) + 1), losses, color="tab:gray", lw=1)
ax2.set_yscale("log")
ax2.set_ylabel("training loss", color="tab:gray")
ax.set_title("The noise scale grows as the loss falls")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 2. Where does a larger batch stop paying?
#
# For each batch size `B`, SGD runs from the same start with three learning
# rates (the best one counts, as in the paper) until the loss reaches the
# target. The paper's model says the steps needed follow
# $S = S_\text{min} (1 + B_\text{noise} / B)$: inversely proportional to `B`
# below $B_\text{noise}$, flat above it. We fit that curve and compare its
# bend with the measured $B_\text{simple}$.

# %%
BATCHES = np.array([4, 8, 16, 32, 64, 128, 256, 512])
LRS = jnp.array([0.25, 0.5, 1.0])
MAX_STEPS = 800


def steps_to_target(batch, key):
    def run(lr):
        def step(carry, key):
            params, hit, t = carry
            grads = grad_fn(params, *sample(key, batch))
            params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
            done = loss_fn(params, X_EVAL, Y_EVAL) < TARGET
            hit = jnp.where((hit < 0) & done, t + 1, hit)
            return (params, hit, t + 1), None

        init = (init_params(), jnp.int32(-1), jnp.int32(0))
        keys = jax.random.split(key, MAX_STEPS)
        return jax.lax.scan(step, init, keys)[0][1]

    hits = jax.vmap(run)(LRS)
    return jnp.min(jnp.where(hits > 0, hits, MAX_STEPS + 1))


sweep = jax.jit(steps_to_target, static_argnums=0)
steps = np.array([int(sweep(int(B), jax.random.key(2))) for B in BATCHES])
for B, s in zip(BATCHES, steps, strict=True):
    print(f"batch {B:4d}: {s:4d} steps, {B * s:7,d} examples")

# %%
# Fit S = S_min (1 + B_noise / B): linear in 1/B.
reached = steps <= MAX_STEPS
slope, s_min = np.polyfit(1.0 / BATCHES[reached], steps[reached], 1)
B_NOISE = slope / s_min
print(f"fit: S_min = {s_min:.0f} steps, B_noise = {B_NOISE:.0f} examples")
print(
    f"measured B_simple: {B_START:.0f} early in training, {B_TARGET:.0f} "
    "at the target loss"
)

# %%
grid = np.geomspace(BATCHES[0], BATCHES[-1], 100)
fig, ax = plt.subplots(figsize=(7, 4))
ax.loglog(BATCHES[reached], steps[reached], "o", color="black", label="measured")
ax.loglog(
    grid,
    s_min * (1 + B_NOISE / grid),
    color="gray",
    label=f"fit, bend at $B_{{noise}}$ = {B_NOISE:.0f}",
)
ax.axvspan(
    min(B_START, B_TARGET),
    max(B_START, B_TARGET),
    color="tab:blue",
    alpha=0.15,
    label="$B_{simple}$ measured in training",
)
ax.set_xlabel("batch size B (examples)")
ax.set_ylabel(f"SGD steps to loss {TARGET}")
ax.set_title("Steps to target vs batch size")
ax.legend()
fig.tight_layout()
# How benchmarks/results/batch_size.png is made:
if os.environ.get("OPTAX_ACCUM_PLOT_DIR"):
    fig.savefig(os.path.join(os.environ["OPTAX_ACCUM_PLOT_DIR"], "batch_size.png"))
plt.show()

# %% [markdown]
# The bend and the measured noise scale land within a small factor of each
# other, which is the accuracy the paper reports for $B_\text{simple}$: it
# equals $B_\text{noise}$ when the Hessian is a multiple of the identity and
# overestimates it when the loss is ill-conditioned. It is a guide to the
# right order of magnitude, cheap enough to watch on every run.
#
# ## 3. Letting the noise scale choose k
#
# `adaptive_every_k(min_k, max_k)` sets each window's `k` to
# $\lceil B_\text{simple} / b \rceil$, clipped: the effective batch follows
# the noise scale as it grows. `k` lives in the optimizer state (traced: no
# recompilation; checkpointed with the rest). The learning rate follows the
# batch with `scale_learning_rate` on an `inject_hyperparams` optimizer,
# here the square-root rule from 0.25 at one micro-batch.

# %%
every_k = optax_accum.adaptive_every_k(2, 16)  # min_k >= 2 on one device
inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.25)
tx_adaptive = optax_accum.accumulate(inner, every_k, noise_scale_decay=0.95)


def adaptive_step(carry, key):
    params, state = carry
    k_now = optax_accum.noise_scale(state).k
    lr = optax_accum.scale_learning_rate(0.25, 1, k_now, rule="sqrt")
    state.inner_state.hyperparams["learning_rate"] = lr
    updates, state = tx_adaptive.update(grad_fn(params, *sample(key, b)), state, params)
    params = optax.apply_updates(params, updates)
    out = (optax_accum.has_updated(state), k_now, loss_fn(params, X_EVAL, Y_EVAL))
    return (params, state), out


@jax.jit
def train_adaptive(key, micro_steps=3000):
    params = init_params()
    carry = (params, tx_adaptive.init(params))
    keys = jax.random.split(key, micro_steps)
    return jax.lax.scan(adaptive_step, carry, keys)[1]


updated, ks, loss_trace = map(np.asarray, train_adaptive(jax.random.key(3)))
ks, loss_trace = ks[updated], loss_trace[updated]  # one entry per update
first = int(np.argmax(loss_trace < TARGET)) if (loss_trace < TARGET).any() else None
if first is not None:
    examples = int(b * ks[: first + 1].sum())
    print(
        f"adaptive k: loss {TARGET} after {first + 1} updates, {examples:,} examples; "
        f"k went {ks[0]} -> {ks[first]}"
    )
else:
    print(f"adaptive k: loss {loss_trace[-1]:.3f} after {len(ks)} updates")

fig, ax = plt.subplots(figsize=(7, 3))
ax.step(np.arange(1, len(ks) + 1), ks * b, where="post")
ax.set_xlabel("update")
ax.set_ylabel("effective batch k·b")
ax.set_title("adaptive_every_k grows the batch with the noise scale")
fig.tight_layout()
plt.show()

# %% [markdown]
# Compare with the fixed batches of part 2: starting small while the noise
# scale is small and growing the batch with it, the adaptive run needs about
# half the steps of the batch of 8 and a fraction of the examples of the
# largest batches, close to the best fixed batch without a sweep to find it.
