# ---
# jupyter:
#   accelerator: TPU
#   colab:
#     name: 02_token_weighting.ipynb
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
# # Exact token-weighted accumulation for padded sequences
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/optax-accum/optax_accum/blob/main/notebooks/02_token_weighting.ipynb)
#
# A language model's loss is a mean over *valid tokens*. When micro-batches
# hold different numbers of valid tokens (padded, variable-length
# sequences, bucketed by length), the plain mean of the micro-batch losses
# (mean-of-means, what `optax.MultiSteps` computes) is not the large-batch
# loss: it over-weights the tokens of short micro-batches.
#
# `optax_accum.accumulate` takes a `weight` per micro-batch. With the
# number of valid tokens as the weight, the accumulated gradient is exactly
# the large-batch token-mean gradient. This notebook trains a small Flax
# nnx character-level transformer three ways and plots how far each
# accumulated run drifts from the true large batch.

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
# ## Data: generated sentences, no download
#
# A tiny grammar generates sentences of very different lengths. Each
# update draws `K * MICRO_BATCH` of them, sorts them by length (bucketing,
# as length-aware data loaders do) and cuts them into `K` padded
# micro-batches, so the micro-batches hold very different token counts.

# %%
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx
from jax import numpy as jnp

import optax_accum

K = 4  # micro-batches per update
MICRO_BATCH = 32 if FULL else 8  # sequences per micro-batch
SEQ_LEN = 256 if FULL else 96
NUM_UPDATES = 100 if FULL else 20
D_MODEL, NUM_HEADS, NUM_LAYERS = (256, 8, 4) if FULL else (64, 4, 2)
PEAK_LR = 1e-3 if FULL else 3e-3

SUBJECTS = ["the cat", "a small dog", "my neighbour", "the old sailor", "a robot"]
VERBS = ["sees", "likes", "paints", "follows", "remembers", "builds", "sells"]
OBJECTS = ["a red boat", "the moon", "an apple", "the long river", "two birds"]
EXTRAS = [
    "at night",
    "in the garden",
    "because it is raining",
    "while the band plays a slow song",
    "near the station",
    "every morning",
]


def sentence(rng):
    clauses = []
    for _ in range(rng.choice([1, 1, 2, 3, 4])):
        words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
        words += rng.choice(EXTRAS, size=rng.integers(0, 3), replace=False).tolist()
        clauses.append(" ".join(words))
    return " and ".join(clauses) + "."


CHARS = sorted(set("".join(SUBJECTS + VERBS + OBJECTS + EXTRAS) + " ."))
PAD, BOS, EOS = 0, 1, 2
VOCAB = len(CHARS) + 3
STOI = {c: i + 3 for i, c in enumerate(CHARS)}


def encode(texts):
    # Inputs start with BOS, targets end with EOS; the mask marks valid tokens.
    shape = (len(texts), SEQ_LEN)
    tokens, targets = np.full(shape, PAD, np.int32), np.full(shape, PAD, np.int32)
    mask = np.zeros(shape, np.float32)
    for row, text in enumerate(texts):
        ids = ([BOS] + [STOI[c] for c in text] + [EOS])[: SEQ_LEN + 1]
        n = len(ids) - 1
        tokens[row, :n], targets[row, :n], mask[row, :n] = ids[:-1], ids[1:], 1
    return tokens, targets, mask


rng = np.random.default_rng(0)
updates = []  # per update: K micro-batches of (tokens, targets, mask)
for _ in range(NUM_UPDATES):
    texts = sorted((sentence(rng) for _ in range(K * MICRO_BATCH)), key=len)
    tokens, targets, mask = encode(texts)
    cuts = [slice(i * MICRO_BATCH, (i + 1) * MICRO_BATCH) for i in range(K)]
    updates.append([(tokens[c], targets[c], mask[c]) for c in cuts])

print("example:", repr(sentence(rng)))
print(
    "valid tokens per micro-batch in update 0:", [int(mb[2].sum()) for mb in updates[0]]
)


# %% [markdown]
# ## Model: a small causal transformer in Flax nnx


# %%
class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm1 = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            NUM_HEADS, D_MODEL, decode=False, keep_rngs=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.up = nnx.Linear(D_MODEL, 4 * D_MODEL, rngs=rngs)
        self.down = nnx.Linear(4 * D_MODEL, D_MODEL, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attention(self.norm1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class CharLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D_MODEL, rngs=rngs)
        self.position = nnx.Param(
            0.02 * jax.random.normal(rngs.params(), (SEQ_LEN, D_MODEL))
        )
        self.blocks = nnx.List([Block(rngs) for _ in range(NUM_LAYERS)])
        self.norm = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.head = nnx.Linear(D_MODEL, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.position[...]
        mask = nnx.make_causal_mask(tokens)  # padding only follows valid tokens
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def loss_fn(model, tokens, targets, mask):
    # Token-mean cross-entropy of one (micro-)batch: padding does not count.
    logits = model(tokens)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(losses * mask) / jnp.sum(mask)


def new_model():
    return CharLM(nnx.Rngs(0))  # the same initial parameters for every run


num_params = sum(p.size for p in jax.tree.leaves(nnx.state(new_model(), nnx.Param)))
print(f"{num_params:,} parameters, vocabulary {VOCAB}, sequences of up to {SEQ_LEN}")


# %% [markdown]
# ## One accumulated gradient, two weightings
#
# `accumulate(optax.identity(), K)` emits the accumulated gradient itself
# on the `K`-th call. Weighting each micro-batch by its number of valid
# tokens reproduces the large-batch gradient; unit weights do not.


# %%
def concat(micro_batches):
    return tuple(np.concatenate(parts) for parts in zip(*micro_batches, strict=True))


gradient = nnx.jit(nnx.grad(loss_fn))
sum_gradients = optax_accum.accumulate(optax.identity(), every_k=K)


@nnx.jit
def add_micro_batch(model, state, tokens, targets, mask, weight):
    grads = nnx.grad(loss_fn)(model, tokens, targets, mask)
    return sum_gradients.update(grads, state, weight=weight)


def accumulated_gradient(model, micro_batches, token_weighted):
    state = sum_gradients.init(nnx.state(model, nnx.Param))
    for tokens, targets, mask in micro_batches:
        weight = jnp.float32(mask.sum() if token_weighted else 1.0)
        out, state = add_micro_batch(model, state, tokens, targets, mask, weight)
    assert optax_accum.has_updated(state)
    return out


@jax.jit
def relative_distance(a, b):
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    num = sum(jnp.sum((x - y) ** 2) for x, y in zip(a, b, strict=True))
    return jnp.sqrt(num / sum(jnp.sum(y**2) for y in b))


model = new_model()
large = gradient(model, *concat(updates[0]))
exact = accumulated_gradient(model, updates[0], token_weighted=True)
mean_of_means = accumulated_gradient(model, updates[0], token_weighted=False)
print(f"token-weighted: relative error {relative_distance(exact, large):.1e}")
print(f"mean-of-means:  relative error {relative_distance(mean_of_means, large):.1e}")
assert relative_distance(exact, large) < 1e-5
assert relative_distance(mean_of_means, large) > 1e-3

# %% [markdown]
# Inside one jitted step, `optax_accum.microbatch` loops over the `K`
# micro-batches itself (a `lax.scan`) and takes the same weights through
# `weight_fn`, which sees each micro-batch's slices of the batch arguments:

# %%
graphdef, state = nnx.split(model)


def pure_loss(state, tokens, targets, mask):
    return loss_fn(nnx.merge(graphdef, state), tokens, targets, mask)


fused = jax.jit(
    optax_accum.microbatch(
        jax.value_and_grad(pure_loss),
        K,
        batch_argnums=(1, 2, 3),
        weight_fn=lambda tokens, targets, mask: mask.sum(),
    )
)
_, fused_grads = fused(state, *concat(updates[0]))
fused_error = relative_distance(fused_grads, large)
print(f"microbatch with weight_fn: relative error {fused_error:.1e}")
assert fused_error < 1e-5


# %% [markdown]
# ## Training: large batch, token-weighted and mean-of-means
#
# Three runs from the same initial parameters on the same data. The
# accumulated runs use `nnx.Optimizer` with `accumulate`: its `update`
# forwards `weight=` to the transformation.


# %%
def make_optimizer():
    # The schedule counts optimizer updates: `accumulate` runs the inner
    # optimizer once per K micro-batches.
    learning_rate = optax.warmup_cosine_decay_schedule(
        PEAK_LR / 10, PEAK_LR, NUM_UPDATES // 10, decay_steps=NUM_UPDATES
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate))


@nnx.jit
def large_step(model, optimizer, tokens, targets, mask):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, targets, mask)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def micro_step(model, optimizer, tokens, targets, mask, weight):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, targets, mask)
    optimizer.update(model, grads, weight=weight)
    return loss


def new_run(tx):
    model = new_model()
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


# One transformation for both accumulated runs (it holds no state), so
# micro_step compiles once.
accumulated_tx = optax_accum.accumulate(make_optimizer(), every_k=K)
runs = {
    "large batch": new_run(make_optimizer()),
    "token-weighted": new_run(accumulated_tx),
    "mean-of-means": new_run(accumulated_tx),
}

history = {name: {"loss": [], "distance": []} for name in runs}
for micro_batches in updates:
    model, optimizer = runs["large batch"]
    history["large batch"]["loss"].append(
        float(large_step(model, optimizer, *concat(micro_batches)))
    )
    for name in ["token-weighted", "mean-of-means"]:
        model, optimizer = runs[name]
        losses, tokens = [], []
        for batch in micro_batches:
            num_tokens = batch[2].sum()
            weight = num_tokens if name == "token-weighted" else 1.0
            losses.append(
                float(micro_step(model, optimizer, *batch, jnp.float32(weight)))
            )
            tokens.append(num_tokens)
        # The large-batch loss of this run's parameters: a token-weighted mean.
        history[name]["loss"].append(np.average(losses, weights=tokens))
    reference = nnx.state(runs["large batch"][0], nnx.Param)
    for name in runs:
        history[name]["distance"].append(
            float(relative_distance(nnx.state(runs[name][0], nnx.Param), reference))
        )

for name, h in history.items():
    print(
        f"{name:>15}: final loss {h['loss'][-1]:.4f}, "
        f"distance to the large batch {h['distance'][-1]:.1e}"
    )

# %%
steps = np.arange(1, NUM_UPDATES + 1)
fig, (ax_dist, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
for name, style in [("token-weighted", "-"), ("mean-of-means", "--")]:
    ax_dist.semilogy(steps, history[name]["distance"], style, label=name)
    gap = np.abs(np.subtract(history[name]["loss"], history["large batch"]["loss"]))
    ax_loss.semilogy(steps, np.maximum(gap, 1e-9), style, label=name)
ax_dist.set(
    xlabel="update",
    ylabel="‖θ - θ_large‖ / ‖θ_large‖",
    title="Parameter distance to the large batch",
)
ax_loss.set(
    xlabel="update", ylabel="|loss - loss_large|", title="Loss gap to the large batch"
)
for ax in (ax_dist, ax_loss):
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# The token-weighted run follows the large batch up to float32 rounding:
# the two sum the same per-token gradients in a different order. Adam
# divides by the gradient's running RMS, which magnifies those last-bit
# differences where a gradient is close to zero, so the distance grows
# slowly, but it stays orders of magnitude below the bias of mean-of-means.

# %%
exact_drift = max(history["token-weighted"]["distance"])
biased_drift = history["mean-of-means"]["distance"][-1]
print(f"token-weighted stays within {exact_drift:.1e} of the large batch")
print(
    f"mean-of-means ends {biased_drift:.1e} away, "
    f"{biased_drift / exact_drift:,.0f}x further"
)
assert exact_drift < 1e-3
assert biased_drift > 30 * exact_drift

# %% [markdown]
# **Takeaway.** Pass `weight=num_valid_tokens` to `update` whenever a
# micro-batch's loss is a mean over a variable number of items (tokens,
# unmasked pixels, non-padded examples). It costs nothing and makes the
# accumulated step the large-batch step.
