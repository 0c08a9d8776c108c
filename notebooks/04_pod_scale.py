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
# # `microbatch` on a pod: HSDP
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/optax-accum/optax_accum/blob/main/notebooks/04_pod_scale.ipynb)
#
# Hybrid sharded data parallelism (HSDP) over all the devices of the
# runtime (the 8 cores of a Colab TPU v2-8; 8 simulated CPU devices on a
# CPU), with gradient accumulation inside one jitted step. The 8 devices form
# a 2 x 4 mesh `("data", "fsdp")`: the batch rows are spread over all 8; each
# parameter is sharded 4 ways over `"fsdp"` (FSDP, ZeRO-3) and replicated
# over the 2 `"data"` groups. Gradients and optimizer state are sharded the
# same way: each device holds a quarter of each.
#
# `optax_accum.microbatch(fun, k)` splits the batch into `k` micro-batches
# without copying it and accumulates their gradients in a `lax.scan`. By
# default it runs in the *global view*: `fun` sees whole micro-batches, which
# is exact for any `fun` and any layout, but the compiler reduces the
# gradients across `"data"` inside the loop, once per micro-batch.
# `microbatch(fun, k, data_axes="data")` declares that `fun` treats rows
# independently (a mean over rows) and runs the loop in `shard_map` over
# `"data"`, each `"data"` group on its own rows: inside the loop only the FSDP layout's own collectives remain (weight gathers and
# gradient reductions within an `"fsdp"` group), and one reduction of the
# quarter-size accumulator crosses `"data"`, after the loop.
#
# This notebook shows the sharding, checks both against the full-batch
# gradients, sorts the collectives of the compiled programs by where they run
# and which devices they join, and trains for ten steps.

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
# ## An HSDP mesh, sharded parameters and a sharded batch
#
# `jax.make_mesh` builds an *Explicit* mesh: shardings are part of the array
# types (`jax.typeof(w)` shows them; `float32[32@fsdp,128]` is split over
# `"fsdp"` along its first axis), and `microbatch` reads them at trace time.
# Under an Explicit mesh the loss says where a weight is gathered:
# `reshard(w, P())` all-gathers it for the matmul, and in the backward pass
# the gradient is reduced back to `w`'s sharding.

# %%
import re

import numpy as np
import optax
from jax import numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.sharding import reshard

import optax_accum

N = jax.device_count()
K = 4  # micro-batches per step
PER_DEVICE = 256 if FULL else 8  # rows of one micro-batch on one device
BATCH = K * N * PER_DEVICE
DIM, HIDDEN, CLASSES = (512, 2048, 1000) if FULL else (32, 128, 10)

# (n_data, n_fsdp): (2, 4) on 8 devices; n_fsdp is the largest divisor of N
# up to N / 2 that divides the sharded dimensions.
N_FSDP = max(
    d
    for d in range(1, max(N // 2, 1) + 1)
    if N % d == 0 and DIM % d == 0 and HIDDEN % d == 0
)
N_DATA = N // N_FSDP
mesh = jax.make_mesh((N_DATA, N_FSDP), ("data", "fsdp"))
jax.set_mesh(mesh)
print(mesh)

PARAMS = {"w1": P("fsdp", None), "b1": P("fsdp"), "w2": P("fsdp", None)}
ROWS = P(("data", "fsdp"))  # the batch rows over all devices


def loss_fn(params, batch):
    # Gather each weight (over "fsdp") where it is used.
    w1, b1, w2 = (reshard(params[name], P()) for name in ("w1", "b1", "w2"))
    hidden = jnp.tanh(batch["x"] @ w1 + b1)
    logits = hidden @ w2
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_batch(key):
    kx, ky = jax.random.split(key)
    return {
        "x": jax.device_put(jax.random.normal(kx, (BATCH, DIM)), ROWS),
        "y": jax.device_put(jax.random.randint(ky, (BATCH,), 0, CLASSES), ROWS),
    }


k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
params = {
    "w1": jax.random.normal(k1, (DIM, HIDDEN)) / np.sqrt(DIM),
    "b1": jnp.zeros(HIDDEN),
    "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) / np.sqrt(HIDDEN),
}
params = jax.device_put(params, PARAMS)
batch = make_batch(k3)
for name, w in params.items():
    print(f"{name}: {jax.typeof(w)}")
print("x:", jax.typeof(batch["x"]), " y:", jax.typeof(batch["y"]))
print("w1 (rows over 'fsdp', the same block on both 'data' groups):")
jax.debug.visualize_array_sharding(params["w1"])

# %% [markdown]
# `microbatch` splits the batch with a free reshape, `(B, ...) -> (B/k, k, ...)`:
# micro-batch `i` holds rows `i, i + k, i + 2k, ...`. Each micro-batch is
# therefore still spread over every device, and no device ever sits idle
# or receives another device's rows:

# %%
rows = jax.device_put(jnp.arange(BATCH), ROWS)  # each row's index in the batch
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
# ## The gradients equal the full-batch gradients, sharded like the parameters
#
# Both forms of `microbatch` against the full batch. With
# `data_axes="data"`, `"data"` is a *Manual* axis inside `fun` (annotations
# there must not name it), while `"fsdp"` keeps its Explicit sharding, so the
# loss's `reshard(w, P())` still gathers over `"fsdp"`. `data_axes` may only
# name axes that shard the batch but no parameter: naming `"fsdp"` raises a
# `ValueError`.

# %%
value_and_grad = jax.value_and_grad(loss_fn)
full_batch = jax.jit(value_and_grad)
global_view = jax.jit(optax_accum.microbatch(value_and_grad, K))
device_local = jax.jit(optax_accum.microbatch(value_and_grad, K, data_axes="data"))

loss, grads = full_batch(params, batch)
print(f"full batch:                    loss {float(loss):.6f}")
for name, fn in [
    ("microbatch (global view)", global_view),
    ('microbatch(data_axes="data")', device_local),
]:
    micro_loss, micro_grads = fn(params, batch)
    np.testing.assert_allclose(micro_loss, loss, rtol=1e-5)
    for leaf, g in micro_grads.items():
        np.testing.assert_allclose(g, grads[leaf], rtol=1e-5, atol=1e-7)
        assert g.sharding.is_equivalent_to(params[leaf].sharding, g.ndim), leaf
    print(f"{name:30} loss {float(micro_loss):.6f}, gradients equal")
print("gradients:", {leaf: str(jax.typeof(g)) for leaf, g in micro_grads.items()})

if N_FSDP > 1:
    try:
        optax_accum.microbatch(value_and_grad, K, data_axes=("data", "fsdp"))(
            params, batch
        )
    except ValueError as e:
        print('data_axes=("data", "fsdp"):', e)
    else:
        raise AssertionError("naming 'fsdp' must raise")

# %% [markdown]
# Each device holds 1 / `n_fsdp` of every parameter, of its gradient, and of
# adamw's two moments (the step count, a scalar, is replicated):

# %%
tx = optax.adamw(1e-3)
opt_state = tx.init(params)  # the moments follow the parameters' sharding


def nbytes(tree):
    # (global bytes, bytes on one device) of a tree's non-scalar arrays
    leaves = [x for x in jax.tree.leaves(tree) if x.ndim]
    total = sum(x.nbytes for x in leaves)
    per_device = sum(max(s.data.nbytes for s in x.addressable_shards) for x in leaves)
    return total, per_device


print(f"{'':12} {'bytes':>9} {'per device':>11}")
for name, tree in [
    ("params", params),
    ("gradients", micro_grads),
    ("adamw state", opt_state),
]:
    total, per_device = nbytes(tree)
    assert per_device * N_FSDP == total, name
    print(f"{name:12} {total:9,d} {per_device:11,d}  (1/{total // per_device})")

# %% [markdown]
# ## Where the collectives run
#
# A collective inside the `while` loop's body runs once per micro-batch; one
# outside it runs once per step. From the compiled HLO, each collective is
# sorted by where it runs and by whether its device groups span the `"data"`
# axis (the slow links between hosts or slices on a pod) or stay within an
# `"fsdp"` group. The SPMD program names devices by their position in
# `mesh.devices`; the replica groups come in several notations, all parsed
# below. The table gives, per program, each class's count and result
# size; the bytes per step that cross `"data"` (the loop's times `k`); and
# the compiled temporary memory per device.

# %%
COLLECTIVE = re.compile(
    r"\b(all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)"
    r"(?:-start)?\("
)
HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
CALLS = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
    r"=%?([\w.\-]+)"
)
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}"
)
GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
GROUPS_LIST = re.compile(r"(?:replica_groups|source_target_pairs)=\{(\{[^=]*?\})\}")
ARRAY = re.compile(r"\b(pred|[a-z]+)(\d*)\[([\d,]*)\]")


def computations(hlo):
    comps, name = {}, None
    for line in hlo.splitlines():
        header = HEADER.match(line)
        if header:
            name = header.group(1)
            comps[name] = []
        elif line.strip() == "}":
            name = None
        elif name is not None:
            comps[name].append(line.strip())
    return comps


def in_loops(comps):
    # The while bodies and every computation they call.
    todo = [
        body
        for lines in comps.values()
        for line in lines
        if " while(" in line
        for body in re.findall(r"body=%?([\w.\-]+)", line)
    ]
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            todo += CALLS.findall(line)
            for group in BRANCHES.findall(line):
                todo += [c.strip().lstrip("%") for c in group.split(",")]
    return seen


def iota(shape, dims, perm):
    # [shape]<=[dims]T(perm): iota over dims, transposed by perm, reshaped.
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return (ids.transpose(perm) if perm else ids).reshape(shape)


def groups(line):
    # The device groups of a collective: lists of positions in mesh.devices.
    def ints(s):
        return [int(v) for v in s.split(",")] if s else None

    m = GROUPS_MESH.search(line)  # mesh['axis_0'=4,...], device_ids=(...) {axes}
    if m:
        names = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        sizes = [int(n) for _, n in names]
        dims = ints(m.group(2)) or [int(np.prod(sizes))]
        ids = iota(sizes, dims, ints(m.group(3)))
        over = [i for i, (n, _) in enumerate(names) if f"'{n}'" in m.group(4)]
        rest = [i for i in range(len(names)) if i not in over]
        size = int(np.prod([sizes[i] for i in over]))
        return ids.transpose(rest + over).reshape(-1, size).tolist()
    m = GROUPS_IOTA.search(line)  # [2,4]<=[8] or [4,2]<=[2,4]T(1,0)
    if m:
        return iota(ints(m.group(1)), ints(m.group(2)), ints(m.group(3))).tolist()
    m = GROUPS_LIST.search(line)  # {{0,1},{2,3}}
    if m:
        return [ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return [list(range(N))]  # replica_groups={}: every device


def result_bytes(line):
    rest = line.split("=", 1)[1].strip()
    result = rest.split(")", 1)[0] if rest.startswith("(") else rest.split("(", 1)[0]
    return sum(
        int(np.prod([int(d) for d in dims.split(",") if d]))
        * (1 if kind == "pred" else int(bits or 8) // 8)
        for kind, bits, dims in ARRAY.findall(result)
    )


def crosses_data(device_groups):
    position = dict(enumerate(np.ndindex(mesh.devices.shape)))
    data = mesh.axis_names.index("data")
    return any(len({position[d][data] for d in g}) > 1 for g in device_groups)


def collectives(fn):
    # {(in loop, crosses "data"): [(op, result bytes), ...]} of fn's program.
    compiled = jax.jit(fn).lower(params, batch).compile()
    comps = computations(compiled.as_text())
    loop = in_loops(comps)
    found = {(i, c): [] for i in (True, False) for c in (True, False)}
    for name, lines in comps.items():
        for line in lines:
            m = COLLECTIVE.search(line)
            if m and "-done(" not in line:
                key = (name in loop, crosses_data(groups(line)))
                found[key].append((m.group(1), result_bytes(line)))
    return found, compiled.memory_analysis().temp_size_in_bytes


FULL_BATCH, GLOBAL = "full batch", "microbatch (global view)"
LOCAL, ONCE = 'data_axes="data"', '  param_gather="once"'
variants = {
    FULL_BATCH: value_and_grad,
    GLOBAL: optax_accum.microbatch(value_and_grad, K),
    LOCAL: optax_accum.microbatch(value_and_grad, K, data_axes="data"),
    ONCE: optax_accum.microbatch(
        value_and_grad, K, data_axes="data", param_gather="once"
    ),
}
results = {name: collectives(fn) for name, fn in variants.items()}


def cell(ops):
    return f"{len(ops)} / {sum(b for _, b in ops) / 1e3:.1f}" if ops else "-"


print("collectives, count / kB of results:")
print(f"{'':25} {'in the loop (each of k)':^25} {'outside the loop':^25}")
print(
    f"{'':25} {'across data':>12} {'within fsdp':>12} {'across data':>12} "
    f"{'within fsdp':>12} {'data kB/step':>13} {'temp kB':>8}"
)
data_per_step = {}
for name, (found, temp) in results.items():
    data_per_step[name] = sum(
        b * (K if loop else 1) for loop in (True, False) for _, b in found[loop, True]
    )
    cells = [
        cell(found[key])
        for key in [(True, True), (True, False), (False, True), (False, False)]
    ]
    print(
        f"{name:25}"
        + "".join(f" {c:>12}" for c in cells)
        + f" {data_per_step[name] / 1e3:13.1f} {temp / 1e3:8.1f}"
    )

# %% [markdown]
# * **full batch**: no loop; the weight gathers and one gradient reduction
#   across all devices.
# * **global view** (the default): the same collectives, once per
#   micro-batch: `k` times the traffic across `"data"`.
# * **`data_axes="data"`**: inside the loop, only the FSDP layout's own
#   collectives, within an `"fsdp"` group: the weight all-gathers (an
#   optimization barrier keeps them per micro-batch, so one gathered layer
#   is live at a time, as FSDP promises) and each micro-batch's gradient
#   reduction into the quarter-size accumulator. Across `"data"`, one
#   reduction of that accumulator after the loop. At the `shard_map`
#   boundary, XLA adds within-group all-gathers outside the loop (it re-lays
#   out the parameters, the batch and the gradients), once per step.
# * **`param_gather="once"`**: the gathers leave the loop (once per step),
#   and the whole gathered model stays in memory for the loop.
#
# (XLA:CPU writes a reduce-scatter as an all-reduce followed by a slice.)

# %%
local, once = results[LOCAL][0], results[ONCE][0]
assert local[True, True] == [], "no collective across 'data' inside the loop"
if N_FSDP > 1:
    assert any(op == "all-gather" for op, _ in local[True, False]), "FSDP gathers"
    assert not any(op == "all-gather" for op, _ in once[True, False])
    assert results[LOCAL][1] < results[ONCE][1], "one gathered layer at a time"
if N_DATA > 1:
    assert results[GLOBAL][0][True, True], "the global view reduces per micro-batch"
    assert data_per_step[LOCAL] < data_per_step[FULL_BATCH]
print(
    f'{LOCAL}: {data_per_step[LOCAL] / 1e3:.1f} kB per step across "data" '
    f"(global view: {data_per_step[GLOBAL] / 1e3:.1f} kB), none inside the loop"
)

# %% [markdown]
# ## A sharded training loop
#
# The micro-batched gradient goes straight into any optax optimizer; the
# updated parameters and adamw's moments keep the FSDP sharding. Ten steps,
# against the same ten steps on the full batch:


# %%
def make_step(grad_fn):
    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


micro_step = make_step(optax_accum.microbatch(value_and_grad, K, data_axes="data"))
large_step = make_step(value_and_grad)
p_micro, s_micro = params, tx.init(params)
p_large, s_large = params, tx.init(params)
for i in range(10):
    batch = make_batch(jax.random.key(100 + i))
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
for name, w in p_micro.items():
    assert w.sharding.is_equivalent_to(params[name].sharding, w.ndim), name
    mu = s_micro[0].mu[name]
    assert mu.sharding.is_equivalent_to(params[name].sharding, mu.ndim), name
print(f"after 10 steps: relative parameter distance {distance:.1e}")
print("updated w1:", jax.typeof(p_micro["w1"]))
print("adamw mu of w1:", jax.typeof(s_micro[0].mu["w1"]))
