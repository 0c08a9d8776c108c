# ---
# jupyter:
#   accelerator: TPU
#   colab:
#     name: 04_pod_scale.ipynb
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
# # `microbatch` on a sharded mesh
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/optax-accum/optax_accum/blob/main/notebooks/04_pod_scale.ipynb)
#
# Data parallelism over all the devices of the runtime (the 8 cores of a
# Colab TPU v2-8; 8 simulated CPU devices on a CPU), with gradient accumulation inside
# one jitted step. `optax_accum.microbatch` splits the batch into `k`
# micro-batches without copying it, keeps every micro-batch spread over
# all devices, accumulates gradients device-locally in a `lax.scan` and
# all-reduces them **once**, after the loop, not once per micro-batch.
#
# This notebook shows the sharding, checks that the gradients equal the
# full-batch gradients, and counts the all-reduces in the compiled HLO.

# %%
# On Colab this installs optax_accum. Where it already imports (a local
# checkout, CI) the cell does nothing and needs no network.
# (Plain Python rather than `%pip`, so that this source also runs as a script.)
import importlib.util
import subprocess
import sys

if importlib.util.find_spec("optax_accum") is None:
    url = "git+https://github.com/optax-accum/optax_accum"
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"optax_accum[examples] @ {url}"], check=True)

# %%
import glob
import os

import jax  # importing JAX does not start its backends; using it does


def accelerator_requested():
    # Decided from the environment: asking JAX (jax.devices()) would
    # initialise its backends, after which the device count is fixed.
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms:
        return platforms.split(",")[0].strip() != "cpu"
    if any(
        os.environ.get(v)
        for v in ["COLAB_TPU_ADDR", "TPU_NAME", "TPU_ACCELERATOR_TYPE", "COLAB_GPU"]
    ):
        return True
    return bool(
        glob.glob("/dev/accel*")
        or glob.glob("/dev/vfio/[0-9]*")
        or glob.glob("/dev/nvidia[0-9]*")
    )


if not accelerator_requested():
    # Must run before anything touches the backend (jax.devices(), any array).
    jax.config.update("jax_num_cpu_devices", 8)

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
# ## A mesh over all devices, and a sharded batch
#
# `jax.make_mesh` builds an *Explicit* mesh: shardings are part of the
# array types (`jax.typeof(x)` shows them), and `microbatch` reads them at
# trace time. The batch is sharded along its first axis over `"data"`;
# the parameters are replicated.

# %%
import re

import numpy as np
import optax
from jax import numpy as jnp
from jax.sharding import PartitionSpec as P

import optax_accum

N = jax.device_count()
K = 4  # micro-batches per step
PER_DEVICE = 256 if FULL else 8  # rows of one micro-batch on one device
BATCH = K * N * PER_DEVICE
DIM, HIDDEN, CLASSES = (512, 2048, 1000) if FULL else (32, 128, 10)

mesh = jax.make_mesh((N,), ("data",))
jax.set_mesh(mesh)
print(mesh)


def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
params = {
    "w1": jax.random.normal(k1, (DIM, HIDDEN)) / np.sqrt(DIM),
    "b1": jnp.zeros(HIDDEN),
    "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) / np.sqrt(HIDDEN),
}
params = jax.device_put(params, P())  # replicated
batch = {
    "x": jax.device_put(jax.random.normal(k3, (BATCH, DIM)), P("data")),
    "y": jax.device_put(jax.random.randint(k4, (BATCH,), 0, CLASSES), P("data")),
}
print(
    "x:",
    jax.typeof(batch["x"]),
    " y:",
    jax.typeof(batch["y"]),
    " w1:",
    jax.typeof(params["w1"]),
)
jax.debug.visualize_array_sharding(batch["x"])

# %% [markdown]
# `microbatch` splits the batch with a free reshape, `(B, ...) -> (B/k, k, ...)`:
# micro-batch `i` holds rows `i, i + k, i + 2k, ...`. Each micro-batch is
# therefore still spread over every device, and no device ever sits idle
# or receives another device's rows:

# %%
rows = jax.device_put(jnp.arange(BATCH), P("data"))  # each row's index in the batch
micro_batches = rows.reshape(BATCH // K, K)
print("micro-batch 0:", jax.typeof(micro_batches[:, 0]))
for device in range(min(N, 3)):
    own = np.asarray(rows.addressable_shards[device].data)
    mine = np.asarray(micro_batches[:, 0].addressable_shards[device].data)
    assert set(mine) <= set(own)  # a device computes on its own rows only
    print(
        f"device {device} holds rows {own[0]}..{own[-1]}; "
        f"its part of micro-batch 0: {mine}"
    )
print("...")

# %% [markdown]
# ## The gradients equal the full-batch gradients

# %%
full_batch = jax.jit(jax.value_and_grad(loss_fn))
accumulated = jax.jit(optax_accum.microbatch(jax.value_and_grad(loss_fn), K))

loss, grads = full_batch(params, batch)
micro_loss, micro_grads = accumulated(params, batch)
print(f"loss: full batch {float(loss):.6f}, {K} micro-batches {float(micro_loss):.6f}")
np.testing.assert_allclose(micro_loss, loss, rtol=1e-5)
jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
    micro_grads,
    grads,
)
print("gradients:", {name: str(jax.typeof(g)) for name, g in micro_grads.items()})
print(f"microbatch(k={K}) == full batch on {N} devices")

# %% [markdown]
# ## Counting all-reduces in the compiled HLO
#
# An all-reduce inside the `while` loop's body runs once per micro-batch;
# one outside it runs once per step. Three ways to compute the same
# gradient:
#
# * the full batch: the compiler all-reduces the gradients once;
# * `microbatch` (the default, device-local loop): the same single
#   all-reduce, after the loop, whatever `k`;
# * `microbatch(..., mesh_axes=None)`: the loop runs on whole, sharded
#   micro-batches and the compiler reduces every micro-batch's gradients:
#   `k` all-reduces per step, `k` times the traffic.

# %%
# The opcode, not an instruction name such as %all-reduce.3 or an operand.
ALL_REDUCE = re.compile(r"(?<![%\w.-])all-reduce(?:-start)?\(")


def all_reduce_counts(fn, *args):
    # (outside any loop, inside a while body) from the optimised HLO.
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    computations, name = {}, None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = line.removeprefix("ENTRY ").split()[0].lstrip("%")
            computations[name] = []
        elif name is not None:
            computations[name].append(line)
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    inside = outside = 0
    for name, lines in computations.items():
        count = sum(len(ALL_REDUCE.findall(line)) for line in lines)
        if name in bodies:
            inside += count
        else:
            outside += count
    return outside, inside


variants = {
    "full batch": jax.value_and_grad(loss_fn),
    f"microbatch(k={K})": optax_accum.microbatch(jax.value_and_grad(loss_fn), K),
    f"microbatch(k={K}, mesh_axes=None)": optax_accum.microbatch(
        jax.value_and_grad(loss_fn), K, mesh_axes=None
    ),
}
per_step = {}
print(f"{'':34} {'outside':>8} {'in loop':>8} {'per step':>9}")
for name, fn in variants.items():
    outside, inside = all_reduce_counts(fn, params, batch)
    per_step[name] = outside + K * inside
    print(f"{name:34} {outside:8d} {inside:8d} {per_step[name]:9d}")

# %%
ours = all_reduce_counts(
    optax_accum.microbatch(jax.value_and_grad(loss_fn), K), params, batch
)
assert ours[1] == 0, "microbatch must not all-reduce inside its loop"
assert per_step[f"microbatch(k={K})"] <= per_step["full batch"]
assert per_step[f"microbatch(k={K})"] <= per_step[f"microbatch(k={K}, mesh_axes=None)"]
print(
    f"microbatch: {per_step[f'microbatch(k={K})']} all-reduce(s) per step, "
    "like the full batch"
)

# %% [markdown]
# ## A sharded training loop
#
# The micro-batched gradient goes straight into any optax optimizer. Ten
# steps, against the same ten steps on the full batch:

# %%
tx = optax.adamw(1e-3)


def make_step(grad_fn):
    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


micro_step = make_step(optax_accum.microbatch(jax.value_and_grad(loss_fn), K))
large_step = make_step(jax.value_and_grad(loss_fn))
p_micro, s_micro = params, tx.init(params)
p_large, s_large = params, tx.init(params)
for i in range(10):
    keys = jax.random.split(jax.random.key(100 + i))
    batch = {
        "x": jax.device_put(jax.random.normal(keys[0], (BATCH, DIM)), P("data")),
        "y": jax.device_put(
            jax.random.randint(keys[1], (BATCH,), 0, CLASSES), P("data")
        ),
    }
    p_micro, s_micro, loss_micro = micro_step(p_micro, s_micro, batch)
    p_large, s_large, loss_large = large_step(p_large, s_large, batch)
    print(
        f"step {i + 1:2d}: loss {float(loss_micro):.5f} (microbatch), "
        f"{float(loss_large):.5f} (full batch)"
    )
a, b = jax.tree.leaves(p_micro), jax.tree.leaves(p_large)
distance = np.sqrt(
    sum(np.sum((x - y) ** 2) for x, y in zip(a, b, strict=True))
    / sum(np.sum(y**2) for y in b)
)
assert distance < 1e-5, distance
print(f"after 10 steps: relative parameter distance {distance:.1e}")
print("sharding of the updated w1:", jax.typeof(p_micro["w1"]))
