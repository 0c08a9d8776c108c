# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""One process of the 2-process test in `test_multihost.py`, next to this file.

Run by `optax_accum.distributed.launch_local`: 2 processes x 2 CPU devices, gloo. Each
process feeds only its own rows of every batch. It trains the same MLP three
ways (`accumulate` in shard_map, `microbatch` under jit, the Flax nnx step),
compares each with the full-batch Adam trajectory computed here on one local
device, and writes the results to ``<out>/process_<i>.npz`` plus a line of
all-reduce counts from the compiled HLO.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import jax

# Both before any backend exists.
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_platforms", "cpu")

import numpy as np  # noqa: E402

# Run as a script, so only this folder is on sys.path: add the repository root
# for `tests.helpers`.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_accum  # noqa: E402
from optax_accum.distributed import ENV_COORDINATOR, ENV_PROCESS_ID  # noqa: E402
from tests.helpers import hlo as _hlo  # noqa: E402

NUM_PROCESSES = 2
D, H = 8, 16  # input features, hidden units
K = 4  # micro-batches per update
MICRO = 8  # rows per global micro-batch (2 per device)
UPDATES = 3
LR = 0.05


# ------------------------------------------------------------- setup, data


def join() -> int:
    """Joins the 2-process job; this process's index."""
    pid = int(os.environ[ENV_PROCESS_ID])
    optax_accum.distributed.initialize_distributed(
        coordinator_address=os.environ[ENV_COORDINATOR],
        num_processes=NUM_PROCESSES,
        process_id=pid,
        failure_timeout_s=30,
        initialization_timeout=30,
    )
    assert jax.process_count() == 2 and jax.device_count() == 4
    return pid


def data() -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """The whole (tiny) data set and the initial parameters, on every process."""
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(UPDATES * K * MICRO, D)).astype(np.float32)
    ys = np.sin(xs.sum(1, keepdims=True)).astype(np.float32)
    params0 = {
        "w1": (rng.normal(size=(D, H)) / np.sqrt(D)).astype(np.float32),
        "b1": np.zeros(H, np.float32),
        "w2": (rng.normal(size=(H, 1)) / np.sqrt(H)).astype(np.float32),
        "b2": np.zeros(1, np.float32),
    }
    return xs, ys, params0


def own_rows(mesh, global_rows: np.ndarray) -> jax.Array:
    """The global array of ``global_rows``, built from this process's rows."""
    rows_sharding = NamedSharding(mesh, P("d"))
    shape = global_rows.shape
    idx = rows_sharding.addressable_devices_indices_map(shape).values()
    lo = min(i[0].start or 0 for i in idx)
    hi = max(shape[0] if i[0].stop is None else i[0].stop for i in idx)
    local = global_rows[lo:hi]
    return jax.make_array_from_process_local_data(rows_sharding, local, shape)


def replicate(mesh, tree):
    replicated = NamedSharding(mesh, P())
    return jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(
            replicated, np.asarray(a), np.shape(a)
        ),
        tree,
    )


def update_rows(u: int) -> slice:
    return slice(u * K * MICRO, (u + 1) * K * MICRO)


def micro_rows(m: int) -> slice:
    return slice(m * MICRO, (m + 1) * MICRO)


def loss(p, batch):
    x, y = batch
    pred = jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return jnp.mean((pred - y) ** 2)


# ------------------------------------------------------------------- faces


def reference(xs, ys, params0):
    """Full-batch Adam on one local device, no collectives."""
    tx = optax.adam(LR)
    ref = jax.device_put(params0, jax.local_devices()[0])
    ref_state = tx.init(ref)

    @jax.jit
    def ref_step(p, s, x, y):
        u, s = tx.update(jax.grad(loss)(p, (x, y)), s, p)
        return optax.apply_updates(p, u), s

    for u in range(UPDATES):
        ref, ref_state = ref_step(
            ref, ref_state, xs[update_rows(u)], ys[update_rows(u)]
        )
    return ref


def accumulate_face(mesh, xs, ys, params0):
    """`accumulate` inside shard_map, one call per micro-batch."""
    acc = optax_accum.accumulate(optax.adam(LR), K, axis_name="d")
    specs = optax_accum.state_specs(jax.eval_shape(acc.init, params0), "d")

    def acc_step(p, s, x, y):
        g = jax.grad(loss)(jax.lax.pcast(p, "d", to="varying"), (x, y))
        upd, s = acc.update(g, s, p)
        return optax.apply_updates(p, upd), s

    init = jax.jit(jax.shard_map(acc.init, mesh=mesh, in_specs=P(), out_specs=specs))
    step = jax.jit(
        jax.shard_map(
            acc_step,
            mesh=mesh,
            in_specs=(P(), specs, P("d"), P("d")),
            out_specs=(P(), specs),
        )
    )
    p = replicate(mesh, params0)
    s = init(p)
    for m in range(UPDATES * K):
        p, s = step(
            p, s, own_rows(mesh, xs[micro_rows(m)]), own_rows(mesh, ys[micro_rows(m)])
        )
    one = (own_rows(mesh, xs[:MICRO]), own_rows(mesh, ys[:MICRO]))
    return p, _all_reduces(step.lower(p, s, *one).compile())


def microbatch_face(mesh, xs, ys, params0):
    """`microbatch` under jit, the whole update's batch sharded over 4 devices.

    Naming the data axis runs the device-local loop (the loss is a row mean).
    """
    tx = optax.adam(LR)
    vg = optax_accum.microbatch(jax.value_and_grad(loss), K, data_axes="d")

    @jax.jit
    def mb_step(p, s, x, y):
        _, g = vg(p, (x, y))
        upd, s = tx.update(g, s, p)
        return optax.apply_updates(p, upd), s

    def batch(u):
        return own_rows(mesh, xs[update_rows(u)]), own_rows(mesh, ys[update_rows(u)])

    with jax.set_mesh(mesh):
        p = replicate(mesh, params0)
        s = jax.jit(tx.init)(p)
        for u in range(UPDATES):
            p, s = mb_step(p, s, *batch(u))
        return p, _all_reduces(mb_step.lower(p, s, *batch(0)).compile())


def main(out_dir: str) -> None:
    pid = join()
    mesh = jax.make_mesh((4,), ("d",))
    xs, ys, params0 = data()
    results, counts = {"reference": reference(xs, ys, params0)}, {}
    results["accumulate"], counts["accumulate"] = accumulate_face(mesh, xs, ys, params0)
    results["microbatch"], counts["microbatch"] = microbatch_face(mesh, xs, ys, params0)
    # The Flax nnx train step (microbatch inside), same MLP and data.
    results["nnx"] = _nnx(mesh, params0, xs, ys)
    # HSDP: the data axis across the processes, FSDP within each.
    hsdp, hsdp_counts = _hsdp(params0, xs, ys)
    results.update(hsdp)
    counts.update(hsdp_counts)
    # Baselines for the cost table of docs/guides/many_processes.md (compiled
    # only, not run).
    counts.update(_baselines(mesh, params0, xs, ys))
    gather = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))
    flat = {
        f"{name}/{key}": np.asarray(
            (v if v.is_fully_replicated else gather(v)).addressable_data(0)
        )
        for name, tree in results.items()
        for key, v in tree.items()
    }
    np.savez(os.path.join(out_dir, f"process_{pid}.npz"), **flat)
    print("ALL_REDUCES " + json.dumps(counts), flush=True)
    print(f"process {pid}: done", flush=True)


# ----------------------------------------------------- HSDP, nnx, baselines


def _placed(compiled, keep) -> dict[str, int]:
    """The collectives ``keep`` accepts: where they run, and their bytes.

    ``every_call`` ones run on every call, ``in_cond`` ones only when a
    ``lax.cond`` branch is taken (the boundary), ``in_loop`` ones once per
    loop iteration; bytes are one call's worth of each.
    """
    comps, _ = _hlo.computations(compiled.as_text())
    loops = _hlo.reachable(comps, _hlo.while_bodies(comps))
    conds = _hlo.reachable(comps, _hlo.branch_roots(comps))
    out = {}
    for where, names in (
        ("every_call", set(comps) - loops - conds),
        ("in_cond", conds - loops),
        ("in_loop", loops),
    ):
        found = [c for c in _hlo.collectives(comps, names, 4) if keep(c)]
        out[where] = len(found)
        out[f"{where}_bytes"] = sum(c[2] for c in found)
    return out


def _all_reduces(compiled) -> dict[str, int]:
    return _placed(compiled, lambda c: c[0].startswith("all-reduce"))


def _hsdp(params0, xs, ys):
    """``microbatch`` and ``accumulate`` on a (data=2 processes, fsdp=2) mesh.

    Weights are FSDP-sharded over "fsdp" and gathered in the loss; the batch
    rows are sharded over ("data", "fsdp"). Returns the trained parameters
    and, per face, the collectives that cross the data axis (count, bytes).
    """
    from jax.sharding import reshard

    mesh = jax.make_mesh((2, 2), ("data", "fsdp"))
    for i in range(2):  # the data axis is the process axis
        assert {d.process_index for d in mesh.devices[i]} == {i}
    specs = {"w1": P("fsdp", None), "b1": P(), "w2": P("fsdp", None), "b2": P()}
    rows = NamedSharding(mesh, P(("data", "fsdp")))

    def fsdp_loss(p, batch):
        return loss({k: reshard(v, P()) for k, v in p.items()}, batch)

    def place(tree):
        return {
            k: jax.make_array_from_callback(
                np.shape(v), NamedSharding(mesh, specs[k]), lambda i, v=v: v[i]
            )
            for k, v in tree.items()
        }

    def own(a):
        return jax.make_array_from_callback(a.shape, rows, lambda i: a[i])

    def crossing(compiled):
        return _placed(compiled, lambda c: _hlo.crosses(c[1], mesh, "data"))

    tx = optax.adam(LR)
    results, counts = {}, {}
    with jax.set_mesh(mesh):
        vg = optax_accum.microbatch(jax.value_and_grad(fsdp_loss), K, data_axes="data")

        @jax.jit
        def mb_step(p, s, x, y):
            _, g = vg(p, (x, y))
            upd, s = tx.update(g, s, p)
            return optax.apply_updates(p, upd), s

        p = place(params0)
        s = jax.jit(tx.init)(p)
        for u in range(UPDATES):
            r = update_rows(u)
            p, s = mb_step(p, s, own(xs[r]), own(ys[r]))
        results["hsdp_microbatch"] = p
        counts["hsdp_microbatch"] = crossing(
            mb_step.lower(
                p, s, own(xs[update_rows(0)]), own(ys[update_rows(0)])
            ).compile()
        )

        acc = optax_accum.accumulate(optax.adam(LR), K)

        @jax.jit
        def acc_step(p, s, x, y):
            upd, s = acc.update(jax.grad(fsdp_loss)(p, (x, y)), s, p)
            return optax.apply_updates(p, upd), s

        p = place(params0)
        s = jax.jit(acc.init)(p)
        for m in range(UPDATES * K):
            r = micro_rows(m)
            p, s = acc_step(p, s, own(xs[r]), own(ys[r]))
        assert s.accumulator["w1"].sharding.spec == specs["w1"]
        results["hsdp_accumulate"] = p
        counts["hsdp_accumulate"] = crossing(
            acc_step.lower(p, s, own(xs[:MICRO]), own(ys[:MICRO])).compile()
        )
    return results, counts


def _nnx(mesh, params0, xs, ys):
    from flax import nnx

    from optax_accum.flax import nnx_train_step

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.l1 = nnx.Linear(D, H, rngs=rngs)
            self.l2 = nnx.Linear(H, 1, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    with jax.set_mesh(mesh):
        model = MLP(nnx.Rngs(0))
        model.l1.kernel.set_value(replicate(mesh, params0["w1"]))
        model.l1.bias.set_value(replicate(mesh, params0["b1"]))
        model.l2.kernel.set_value(replicate(mesh, params0["w2"]))
        model.l2.bias.set_value(replicate(mesh, params0["b2"]))
        optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
        # Host-created leaves (Adam's count) become replicated global arrays.
        opt_state = nnx.state(optimizer)
        nnx.update(
            optimizer,
            jax.tree.map(
                lambda a: a if len(a.sharding.device_set) == 4 else replicate(mesh, a),
                opt_state,
            ),
        )

        def loss_fn(model, x, y):
            return jnp.mean((model(x) - y) ** 2)

        step = nnx.jit(nnx_train_step(loss_fn, K))
        for u in range(UPDATES):
            r = update_rows(u)
            step(model, optimizer, own_rows(mesh, xs[r]), own_rows(mesh, ys[r]))
    return {
        "w1": model.l1.kernel.get_value(),
        "b1": model.l1.bias.get_value(),
        "w2": model.l2.kernel.get_value(),
        "b2": model.l2.bias.get_value(),
    }


def _baselines(mesh, params0, xs, ys):
    """All-reduce counts of MultiSteps with a per-micro-step pmean and of plain DP."""
    ms = optax.MultiSteps(optax.adam(LR), K)
    tx = optax.adam(LR)

    def ms_step(p, s, x, y):
        g = jax.lax.pmean(
            jax.grad(loss)(jax.lax.pcast(p, "d", to="varying"), (x, y)), "d"
        )
        upd, s = ms.update(g, s, p)
        return optax.apply_updates(p, upd), s

    def dp_step(p, s, x, y):
        g = jax.lax.pmean(
            jax.grad(loss)(jax.lax.pcast(p, "d", to="varying"), (x, y)), "d"
        )
        upd, s = tx.update(g, s, p)
        return optax.apply_updates(p, upd), s

    p = jax.eval_shape(lambda: params0)
    x, y = own_rows(mesh, xs[:MICRO]), own_rows(mesh, ys[:MICRO])
    out = {}
    for name, fn, t in (
        ("multisteps_pmean", ms_step, ms),
        ("data_parallel", dp_step, tx),
    ):
        s = jax.eval_shape(t.init, params0)
        sm = jax.jit(
            jax.shard_map(
                fn, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")), out_specs=(P(), P())
            )
        )
        out[name] = _all_reduces(sm.lower(p, s, x, y).compile())
    return out


if __name__ == "__main__":
    main(sys.argv[1])
