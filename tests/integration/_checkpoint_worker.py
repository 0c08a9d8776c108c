# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""A training run that checkpoints with Orbax and resumes from its checkpoints.

    python _checkpoint_worker.py train DIR OUT --recipe {old,new} [--steps N]
    python _checkpoint_worker.py check DIR [--cpu-devices N]

``train`` trains a small MLP with ``accumulate(adam, 4)``, one call per
micro-batch, and saves every 3 micro-steps (most saves fall in the middle of
an accumulation window) with ``max_to_keep=2``, so every save from the third
on deletes an old step. It resumes from ``DIR`` if it holds a checkpoint and
writes the final parameters and optimizer state to ``OUT`` (.npz).
``--recipe new`` is the kill-safe recipe of ``docs/guides/checkpointing.md``,
its code cell run as the page shows it; ``--recipe old`` is the plain one:
``max_to_keep`` and ``latest_step()``.

``check`` prints one JSON line: for each step ``all_steps()`` lists, what a
fresh default `CheckpointManager` restoring it says (``"ok"`` or the error),
and what one manager says restoring all of them, oldest first; with the
devices the checkpoint was written on (``--cpu-devices``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re

import jax

jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import optax_accum  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "guides" / "checkpointing.md"
# A MyST code cell: its fence line, then its source up to the closing fence.
CODE_CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```$", re.S | re.M)
K, SAVE_EVERY, KEEP = 4, 3, 2
OPTIONS = {
    "save_interval_steps": SAVE_EVERY,
    "max_to_keep": KEEP,
    "enable_async_checkpointing": False,
}


def recipe() -> dict:
    """The docs recipe, run: the page's one code cell that defines
    ``checkpoint_manager``, exactly as the page shows it (no cell options,
    which would hide lines or change how it runs)."""
    cells = [
        code
        for code in CODE_CELL.findall(PAGE.read_text())
        if "def checkpoint_manager(" in code
    ]
    if len(cells) != 1:
        raise RuntimeError(
            f"{PAGE} must have exactly one code cell defining "
            f"`checkpoint_manager`, found {len(cells)}."
        )
    code = cells[0]
    if code.startswith((":", "---")):
        raise RuntimeError(f"The recipe's code cell in {PAGE} must have no options.")
    namespace: dict = {}
    exec(compile(code, str(PAGE), "exec"), namespace)
    return namespace


def batch(m: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(m)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(np.sin(x[:, :2]))


def loss_fn(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)


def train(directory: str, out: str, which: str, steps: int) -> None:
    tx = optax_accum.accumulate(optax.adam(1e-2), K)
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (8, 32)) / np.sqrt(8),
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(k2, (32, 2)) / np.sqrt(32),
    }
    state = {"params": params, "opt_state": tx.init(params)}

    @jax.jit
    def step(state, x, y):
        grads = jax.grad(loss_fn)(state["params"], x, y)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
        }

    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    if which == "new":
        r = recipe()
        manager = r["checkpoint_manager"](directory, **OPTIONS)
        start, restored = r["restore_latest"](manager, target)

        def save(m, state):
            r["save"](manager, m, state)

    else:
        manager = ocp.CheckpointManager(
            os.path.abspath(directory), options=ocp.CheckpointManagerOptions(**OPTIONS)
        )
        start, restored = manager.latest_step(), None
        if start is not None:
            restored = manager.restore(start, args=ocp.args.StandardRestore(target))

        def save(m, state):
            manager.save(m, args=ocp.args.StandardSave(state))

    if restored is not None:
        state = restored
    start = start or 0
    print(f"RESUMED_FROM {start} window position {start % K}", flush=True)
    for m in range(start, steps):
        state = step(state, *batch(m))
        save(m + 1, state)
        print(f"STEP {m + 1}", flush=True)
    manager.wait_until_finished()
    manager.close()
    np.savez(out, *[np.asarray(x) for x in jax.tree.leaves(state)])
    print("DONE", flush=True)


def _restore(manager: ocp.CheckpointManager, step: int) -> str:
    try:
        manager.restore(step, args=ocp.args.StandardRestore())
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return "ok"


def check(directory: str) -> None:
    directory = os.path.abspath(directory)

    def fresh() -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            directory, options=ocp.CheckpointManagerOptions(read_only=True)
        )

    steps = sorted(fresh().all_steps())
    each = {s: _restore(fresh(), s) for s in steps}
    one = fresh()
    in_turn = {s: _restore(one, s) for s in steps}
    trash = os.path.join(directory, "todelete")
    print(
        "CHECK "
        + json.dumps(
            {
                "steps": steps,
                "each": each,
                "in_turn": in_turn,
                "trash": sorted(os.listdir(trash)) if os.path.isdir(trash) else [],
            }
        ),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train")
    t.add_argument("dir")
    t.add_argument("out")
    t.add_argument("--recipe", choices=("old", "new"), required=True)
    t.add_argument("--steps", type=int, default=22)
    c = sub.add_parser("check")
    c.add_argument("dir")
    c.add_argument("--cpu-devices", type=int, default=1)
    args = ap.parse_args()
    if args.command == "train":
        train(args.dir, args.out, args.recipe, args.steps)
    else:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
        check(args.dir)


if __name__ == "__main__":
    main()
