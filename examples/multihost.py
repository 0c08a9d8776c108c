# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Multi-process training with gradient accumulation, the same on 1 or N hosts.

Trains a small MLP with `optax_accum.accumulate(optax.adam, k, axis_name=...)`
inside `jax.shard_map`, one call per micro-batch: each device accumulates its
own gradients and the devices all-reduce once per update, in the boundary
step. Each process loads only its own rows of every micro-batch. With
``--ckpt-dir``, every process takes part in Orbax checkpoints (also in the
middle of an accumulation window), and a restarted job resumes from the last
one to the same parameters, bit for bit.

The parts to copy, in order: 1. `setup` (join the job, make the mesh), 2.
`batch` (this process's rows as global arrays), 3. the model, 4. `make_step`
(`accumulate` in `jax.shard_map`), 5. `resume` and `save` (Orbax), 6. `train`.

    python examples/multihost.py                        # one process
    python examples/multihost.py --local-processes 2    # 2 processes, loopback
    python examples/multihost.py --distributed          # one per host: TPU pod
                                                        # slice, SLURM, ...

See docs/guides/many_processes.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
import optax_accum.distributed

D, H = 16, 64  # input features, hidden units


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--steps",
        type=lambda s: 4 if s == "small" else int(s),
        default=20,
        help='optimizer updates to train for ("small": 4)',
    )
    p.add_argument("--k", type=int, default=4, help="micro-batches per update")
    p.add_argument(
        "--micro-batch", type=int, default=64, help="rows per global micro-batch"
    )
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--ckpt-dir", help="Orbax checkpoint directory (resumes from it)")
    p.add_argument(
        "--save-every", type=int, default=3, help="checkpoint every N micro-steps"
    )
    p.add_argument("--out", help="write the final parameters here (.npz)")
    p.add_argument(
        "--local-processes", type=int, default=0, help="launch N processes here"
    )
    p.add_argument(
        "--launch-timeout",
        type=float,
        default=3600,
        help="with --local-processes: kill all processes after this many seconds",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="multi-host job: jax.distributed.initialize() auto-detects the rest",
    )
    p.add_argument(
        "--cpu-devices", type=int, default=2, help="CPU devices per process (CPU)"
    )
    p.add_argument(
        "--failure-timeout",
        type=int,
        default=60,
        help="seconds after which a dead or stuck peer fails the others",
    )
    p.add_argument(
        "--crash-at",
        type=int,
        help="fault drill: the last process kills itself (SIGKILL) after this "
        "micro-step",
    )
    return p.parse_args(argv)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """``--local-processes N``: this script, N times, as one JAX job."""
    forward, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--local-processes":
            skip = True
        elif not a.startswith("--local-processes="):
            forward.append(a)
    run = optax_accum.distributed.launch_local(
        [sys.executable, os.path.abspath(__file__), *forward],
        args.local_processes,
        cpu_devices_per_process=args.cpu_devices,
        timeout_s=args.launch_timeout,
        grace_s=args.failure_timeout + 30,
    )
    for i, (rc, t) in enumerate(zip(run.returncodes, run.exit_times, strict=True)):
        if i in run.killed:
            how = "hung, killed by the launcher"
        elif rc < 0:
            how = f"killed by {signal.Signals(-rc).name}"
        else:
            how = f"exit status {rc}"
        print(f"launcher: process {i}: {how} after {t:.1f} s")
    return 0 if run.ok else 1


# Orbax moves deleted steps here (`todelete_subdir`): one atomic rename, so a
# kill during a deletion never leaves a listed step that cannot be restored.
# The name is not a step number, so Orbax never lists it as a step.
TRASH = "todelete"


def empty_trash(directory: str) -> None:
    """Removes the steps Orbax moved aside (process 0 only, as Orbax deletes)."""
    trash = os.path.join(os.path.abspath(directory), TRASH)
    if jax.process_index() == 0 and os.path.isdir(trash):
        for entry in os.scandir(trash):  # entries only: Orbax may add one now
            shutil.rmtree(entry.path, ignore_errors=True)


def checkpoint_manager(directory: str, **options):
    """An Orbax `CheckpointManager` whose saves and deletions survive a SIGKILL.

    Deletions are renames into `TRASH`; the single-item layout is fixed up
    front, so no directory can change how restores read; the temporary
    directories of interrupted saves are removed at start-up. The recipe and
    why: docs/guides/checkpointing.md.
    """
    import orbax.checkpoint as ocp

    empty_trash(directory)
    return ocp.CheckpointManager(
        os.path.abspath(directory),
        item_handlers=ocp.StandardCheckpointHandler(),
        options=ocp.CheckpointManagerOptions(
            todelete_subdir=TRASH, cleanup_tmp_directories=True, **options
        ),
    )


def rows(start: int, stop: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``start:stop`` of an endless synthetic data set.

    A stand-in for a real loader: row ``i`` depends on ``i`` only, so each
    process reads just its own rows and any process count sees the same data.
    """
    i = np.arange(start, stop, dtype=np.float64)[:, None] + 1e4 * seed
    f = np.arange(1, D + 1, dtype=np.float64)
    x = (np.sin(i * 12.9898 + f * 78.233) * 43758.5453 % 1.0) * 2.0 - 1.0
    x = x.astype(np.float32)
    y = np.sin(x[:, :4].sum(1, keepdims=True)) + 0.1 * x[:, 4:5]
    return x, y.astype(np.float32)


# ------------------------------------------------------------ 1. setup


def setup(args: argparse.Namespace) -> Mesh:
    """Joins the job (several processes) and makes a data-parallel mesh."""
    launched = "OPTAX_ACCUM_PROCESS_ID" in os.environ  # set by launch_local
    if launched or args.distributed:
        optax_accum.distributed.initialize_distributed(
            failure_timeout_s=args.failure_timeout
        )
    else:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    log(
        f"{jax.process_count()} process(es), {jax.device_count()} devices, "
        f"mesh {dict(mesh.shape)}"
    )
    return mesh


def log(*args: object) -> None:
    """Prints on process 0 only."""
    if jax.process_index() == 0:
        print(*args)


# ------------------------------------------------------------- 2. data


def batch(mesh: Mesh, micro_batch: int, m: int) -> tuple[jax.Array, jax.Array]:
    """Micro-batch ``m`` as global arrays, built from this process's rows only."""
    data = NamedSharding(mesh, P("data"))
    shape = (micro_batch, D)
    idx = data.addressable_devices_indices_map(shape).values()
    lo = min(i[0].start or 0 for i in idx)
    hi = max(shape[0] if i[0].stop is None else i[0].stop for i in idx)
    x, y = rows(m * shape[0] + lo, m * shape[0] + hi)
    return (
        jax.make_array_from_process_local_data(data, x, shape),
        jax.make_array_from_process_local_data(data, y, (shape[0], 1)),
    )


# ------------------------------------------------------------ 3. model


def init_params() -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (D, H)) / np.sqrt(D),
        "b1": jnp.zeros(H),
        "w2": jax.random.normal(k2, (H, 1)) / np.sqrt(H),
        "b2": jnp.zeros(1),
    }


def loss_fn(p: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    pred = jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return jnp.mean((pred - y) ** 2)


# ------------------------------------------------------------- 4. step


def make_step(mesh: Mesh, lr: float, k: int):
    """``(params, opt_state, step)``: `accumulate` inside `jax.shard_map`.

    Each device accumulates its own gradients; the devices all-reduce once
    per update, in the boundary step.
    """
    tx = optax_accum.accumulate(optax.adam(lr), k, axis_name="data")
    params = jax.jit(init_params, out_shardings=NamedSharding(mesh, P()))()
    specs = optax_accum.state_specs(jax.eval_shape(tx.init, params), "data")

    def step(p, s, x, y):
        # Device-varying params: no gradient all-reduce per micro-step.
        p_local = jax.lax.pcast(p, "data", to="varying")
        loss, g = jax.value_and_grad(loss_fn)(p_local, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss[None]  # local loss, no psum

    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    step = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(), specs, P("data"), P("data")),
        out_specs=(P(), specs, P("data")),
    )
    return params, init(params), jax.jit(step, donate_argnums=(0, 1))


# ------------------------------------------------- 5. checkpoint, resume


def resume(manager, params, opt_state, k: int) -> tuple[Any, Any, int]:
    """The latest checkpoint's params, state and micro-step, or the given ones."""
    import orbax.checkpoint as ocp

    latest = manager.latest_step()
    if latest is None:
        return params, opt_state, 0
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
        {"params": params, "opt_state": opt_state},
    )
    restored = manager.restore(latest, args=ocp.args.StandardRestore(target))
    log(f"resumed from micro-step {latest} (window position {latest % k})")
    return restored["params"], restored["opt_state"], latest


def save(manager, directory: str, m: int, params, opt_state) -> None:
    """Micro-step ``m``'s checkpoint, if the manager's interval says so."""
    import orbax.checkpoint as ocp

    state = {"params": params, "opt_state": opt_state}
    if manager.save(m, args=ocp.args.StandardSave(state)):
        empty_trash(directory)


# ------------------------------------------------------------ 6. train


def fault_drill(args: argparse.Namespace, m: int) -> None:
    """``--crash-at``: the last process kills itself after micro-step ``m``."""
    if args.crash_at == m and jax.process_index() == jax.process_count() - 1:
        print(
            f"process {jax.process_index()}: fault drill, SIGKILL after micro-step {m}"
        )
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def collective_failed(e: Exception, m: int, manager) -> None:
    """A peer died or hung: say how to resume, and exit at once."""
    last = manager.latest_step() if manager is not None else None
    print(
        f"process {jax.process_index()}: a collective failed at micro-step {m}: "
        f"{str(e).splitlines()[0]}\nAnother process has probably died or hung. "
        f"Restart all processes; training resumes from the last checkpoint "
        f"(micro-step {last}).",
        file=sys.stderr,
        flush=True,
    )
    # Skip the exit-time shutdown barrier, which would wait for the dead.
    os._exit(3)


def train(args: argparse.Namespace) -> None:
    mesh = setup(args)
    params, opt_state, step = make_step(mesh, args.lr, args.k)
    manager, start = None, 0
    if args.ckpt_dir:
        manager = checkpoint_manager(
            args.ckpt_dir,
            save_interval_steps=args.save_every,
            max_to_keep=2,
            enable_async_checkpointing=False,
        )
        params, opt_state, start = resume(manager, params, opt_state, args.k)
    times, m = [], start
    try:
        for m in range(start, args.steps * args.k):
            params, opt_state, loss = step(
                params, opt_state, *batch(mesh, args.micro_batch, m)
            )
            if manager is not None:
                save(manager, args.ckpt_dir, m + 1, params, opt_state)
            if (m + 1) % args.k == 0:
                local = np.mean([np.asarray(s.data) for s in loss.addressable_shards])
                jax.block_until_ready(params)
                times.append(time.perf_counter())
                log(f"update {(m + 1) // args.k}: local micro-batch loss {local:.4f}")
            fault_drill(args, m + 1)
    except jax.errors.JaxRuntimeError as e:
        collective_failed(e, m + 1, manager)
    if len(times) > 1:
        per_update = (times[-1] - times[0]) / (len(times) - 1)
        log(f"time per update: {1e3 * per_update:.2f} ms (after the first update)")
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    if args.out and jax.process_index() == 0:
        np.savez(
            args.out,
            **{k: np.asarray(v.addressable_data(0)) for k, v in params.items()},
        )
    log("done")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.local_processes:
        return launch(args, argv)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
