import math
import os
import re
import signal

from optax_accum.distributed import initialize_distributed

T = int(os.environ.get("FAILURE_TIMEOUT", "60"))
initialize_distributed(failure_timeout_s=T)  # first, before any JAX array

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

K, ROWS, D = 2, 8, 3  # micro-batches per update, rows per micro-batch, features
mesh = jax.make_mesh((jax.device_count(),), ("data",))
rows = NamedSharding(mesh, P("data"))


def data(m):
    """Micro-batch m, the same in every process (a stand-in for a loader)."""
    x = np.random.default_rng(m).normal(size=(ROWS, D)).astype(np.float32)
    return x, x @ np.array([1.0, -2.0, 0.5], np.float32)


def own_rows(a):
    """This process's half of a global micro-batch, as a global jax.Array."""
    half = len(a) // jax.process_count()
    mine = a[jax.process_index() * half : (jax.process_index() + 1) * half]
    return jax.make_array_from_process_local_data(rows, mine, a.shape)


def loss(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


tx = optax_accum.accumulate(optax.sgd(0.1), K, axis_name="data")
w = jax.device_put(jnp.zeros(D, jnp.float32), NamedSharding(mesh, P()))
specs = optax_accum.state_specs(jax.eval_shape(tx.init, w), "data")


def step(w, s, x, y):
    # Device-varying parameters: jax.grad adds no all-reduce per micro-step.
    g = jax.grad(loss)(jax.lax.pcast(w, "data", to="varying"), x, y)
    u, s = tx.update(g, s, w)  # no pmean: one all-reduce, at the boundary
    return optax.apply_updates(w, u), s


step = jax.jit(
    jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(), specs, P("data"), P("data")),
        out_specs=(P(), specs),
    )
)
init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
s = init(w)
for m in range(2 * K):  # two updates
    x, y = map(own_rows, data(m))
    w, s = step(w, s, x, y)
    if os.environ.get("CRASH_AT") == str(m) and jax.process_index() == 1:
        print(f"process 1: SIGKILL after micro-step {m}", flush=True)  # fault drill
        os.kill(os.getpid(), signal.SIGKILL)  # fault drill

# The same two updates on the full batch, in NumPy.
ref = np.zeros(D, np.float32)
for u in range(2):
    window = [data(u * K + i) for i in range(K)]
    xb, yb = (np.concatenate(z) for z in zip(*window, strict=True))
    ref -= 0.1 * 2 * xb.T @ (xb @ ref - yb) / len(xb)
mine = np.asarray(w.addressable_data(0))
np.testing.assert_allclose(mine, ref, rtol=1e-5)
print(
    f"process {jax.process_index()} of {jax.process_count()}, "
    f"{jax.local_device_count()} of {jax.device_count()} devices: "
    f"w = {mine.round(4)}, the full batch's to 1e-5"
)

if jax.process_index() == 0:
    print("XLA_FLAGS:", os.environ["XLA_FLAGS"])
    hlo = step.lower(w, s, x, y).compile().as_text()
    reduces = [line for line in hlo.splitlines() if " all-reduce(" in line]
    in_boundary = [line for line in reduces if "optax_accum/boundary" in line]
    shapes = re.findall(r"[fs]32\[([\d,]*)\]", reduces[0].split(" all-reduce(")[0])
    size = sum(4 * math.prod(int(n) for n in dims.split(",") if n) for dims in shapes)
    print(
        f"compiled step: {len(reduces)} all-reduce, {len(in_boundary)} of them "
        f"in the boundary branch, {size} bytes (N = {D} parameters)"
    )
    assert len(reduces) == len(in_boundary) == 1 and size == 4 * (D + 1)
