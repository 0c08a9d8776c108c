# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The fused step and the pipeline against their hand-written floors, per compiler.

Compiled, not run, for XLA:CPU, XLA:GPU (H100s) and XLA:TPU (a v5e chip or
2x2), without the GPU or TPU (`optax_accum._targets`, the ``compilers``
extra). Two tables:

1. **The fused step.** `microbatch_value_and_grad` plus AdamW on a 4-layer MLP
   512 wide, 64 rows a micro-batch, against a hand-written ``lax.scan`` that
   adds each micro-batch's gradients, at k = 2 and 8, on one device: temp
   and peak less the batch (flat in k when the step adds nothing per
   micro-batch).
2. **The pipeline.** GPipe, 1F1B and ZB-H1 (`optax_accum.pipeline`) against
   the hand-written floors of `pipeline_floors.py` on a 4-device stage axis
   (4 H100s, a TPU v5e 2x2; 4 CPU devices), width 1024, M = 8 micro-batches
   of 16 rows: temp, and the collective-permutes in each loop body.

`tests/compilers/` holds the same claims as tests. Run
``python benchmarks/bench_compiled_loops.py --out benchmarks/results`` (about
two minutes on 2 cores); without the extra only XLA:CPU's rows are made.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
if __name__ == "__main__":  # 8 CPU devices; imported (by a test), no change
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import harness  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_accum  # noqa: E402
from optax_accum import _targets  # noqa: E402
from tests.helpers import hlo  # noqa: E402
from tests.helpers.models import mlp_loss, mlp_params  # noqa: E402

MiB = 2**20
TX = optax.adamw(1e-3, weight_decay=0.1)
WIDE = (512,) * 5
ROWS = 64
SCHEDULES = {"gpipe": "gpipe", "1f1b": "one_f_one_b", "zb_h1": "zb_h1"}
STAGES, M, PIPE_WIDTH, PIPE_ROWS = 4, 8, 1024, 16
EXPLICIT = (AxisType.Explicit,)


def fused_step(k, loss=mlp_loss):
    """`microbatch_value_and_grad` and an AdamW update."""
    vg = optax_accum.microbatch_value_and_grad(loss, k, batch_argnums=(1, 2))

    def step(p, s, x, y):
        value, grads = vg(p, x, y)
        updates, s = TX.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    return step


def scan_step(k, loss=mlp_loss):
    """The floor: a hand-written scan adding each micro-batch's gradients."""

    def step(p, s, x, y):
        views = [v.reshape(v.shape[0] // k, k, *v.shape[1:]) for v in (x, y)]

        def body(carry, i):
            acc, total = carry
            xi, yi = (lax.dynamic_index_in_dim(v, i, 1, keepdims=False) for v in views)
            value, grads = jax.value_and_grad(loss)(p, xi, yi)
            return (jax.tree.map(jnp.add, acc, grads), total + value), None

        zeros = (jax.tree.map(jnp.zeros_like, p), jnp.float32(0))
        (acc, total), _ = lax.scan(body, zeros, jnp.arange(k))
        updates, s = TX.update(jax.tree.map(lambda a: a / k, acc), s, p)
        return optax.apply_updates(p, updates), s, total / k

    return step


def fused_args(k, sizes=WIDE, rows=ROWS):
    params = jax.eval_shape(lambda: mlp_params(0, sizes))
    batch = [
        jax.ShapeDtypeStruct((rows * k, n), jnp.float32) for n in (sizes[0], sizes[-1])
    ]
    return params, jax.eval_shape(TX.init, params), *batch


def pipeline_fns(schedule, mesh):
    """``(library, floor)`` value-and-grad functions of ``schedule``."""
    import pipeline_floors as floors

    from optax_accum import pipeline as pl
    from tests.pipeline import models as md

    library = pl.value_and_grad(
        md.first_fn, md.stage_fn, md.loss_fn, M, schedule=schedule
    )
    return library, getattr(floors, SCHEDULES[schedule])(mesh, M)


def pipeline_args():
    from tests.pipeline import models as md

    return jax.eval_shape(lambda: md.make(STAGES, rows=PIPE_ROWS * M, width=PIPE_WIDTH))


def compile_on(target, fn, args, **kw):
    """`_targets.compile_for`, or for ``"cpu"`` the same on this machine's CPU
    devices (a ``jax.jit`` function keeps its own donation, as there):
    ``(optimized HLO, Memory, mesh)``."""
    if target != "cpu":
        compiled = _targets.compile_for(fn, *args, target=target, **kw)
        return compiled.as_text(), compiled.memory(), compiled.mesh
    import numpy as np

    names, shape = kw.get("axis_names", ("data",)), kw.get("mesh_shape") or (1,)
    devices = np.asarray(jax.devices("cpu")[: int(np.prod(shape))]).reshape(shape)
    mesh = Mesh(devices, names, axis_types=kw.get("axis_types"))
    specs = kw.get("specs") or (None,) * len(args)
    placed = [_targets._place(a, s, mesh) for a, s in zip(args, specs, strict=True)]
    jitted = _targets.jitted_with(fn, kw.get("donate_argnums", ()))
    program = jitted.trace(*placed).lower().compile()
    memory = _targets.Compiled(program, "cpu", "XLA:CPU", mesh).memory()
    return program.as_text(), memory, mesh


def _fused_rows(targets):
    rows = []
    for target in targets:
        for k in (2, 8):
            args = fused_args(k)
            batch = sum(a.size * 4 for a in args[2:])
            for form, make in (
                ("microbatch", fused_step),
                ("hand-written scan", scan_step),
            ):
                _, mem, _ = compile_on(target, make(k), args, donate_argnums=(0, 1))
                rows.append({"compiler": target, "k": k, "step": form, "temp": mem.temp,
                             "peak_less_batch": mem.peak - batch})  # fmt: skip
    return rows


def _permutes(text, mesh):
    comps, _ = hlo.computations(text)
    return [
        sum(op == "collective-permute" for op, _, _ in
            hlo.collectives(comps, hlo.reachable(comps, [b]), mesh.devices.size))
        for b in sorted(hlo.while_bodies(comps))
    ]  # fmt: skip


def _pipeline_rows(targets):
    rows = []
    kw = {"specs": ((None, P("stage"), None), None), "axis_names": ("stage",),
          "axis_types": EXPLICIT, "mesh_shape": (STAGES,)}  # fmt: skip
    for target in targets:
        if target == "cpu":
            mesh = Mesh(jax.devices("cpu")[:STAGES], ("stage",), axis_types=EXPLICIT)
        else:
            mesh = _targets.target_mesh(target, ("stage",), axis_types=EXPLICIT)
        for schedule in SCHEDULES:
            temps = {}
            for form, fn in zip(
                ("library", "floor"), pipeline_fns(schedule, mesh), strict=True
            ):
                with jax.set_mesh(mesh):
                    text, mem, _ = compile_on(target, fn, pipeline_args(), **kw)
                temps[form] = mem.temp
                if form == "library":
                    permutes = _permutes(text, mesh)
            rows.append({"compiler": target, "schedule": schedule, **temps,
                         "permutes_per_loop": permutes})  # fmt: skip
    return rows


def measure(quick: bool = False, rounds: int | None = None) -> dict:
    del quick, rounds  # compiled, not timed; already small
    one = ["cpu"] + [t for t in ("h100", "v5e") if _targets.available(t)]
    cpu = ["cpu"] if len(jax.devices("cpu")) >= STAGES else []  # run.py: maybe 1
    four = cpu + [t for t in ("h100x4", "v5e:2x2") if _targets.available(t)]
    return {
        "fused": _fused_rows(one),
        "pipeline": _pipeline_rows(four),
        "compilers": {t: _targets.compiler(t) for t in set(one + four) - {"cpu"}},
        "command": harness.report.command_line(),
    }


def markdown(data: dict) -> str:
    lines = [
        f"Made by `{data['command']}`. Compiled, not run; "
        + "; ".join(f"{t}: {c}" for t, c in sorted(data["compilers"].items()))
        + ". Ratios are against the hand-written floor in the same compiler.",
        "",
        "The fused step (`microbatch_value_and_grad` + AdamW, MLP 4 x 512, 64 "
        "rows a micro-batch, one device):",
        "",
        "| compiler | k | step | temp MiB | / scan | peak less batch MiB | / k = 2 |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    rows = {(r["compiler"], r["k"], r["step"]): r for r in data["fused"]}
    for (c, k, step), r in rows.items():
        scan = rows[c, k, "hand-written scan"]
        base = rows[c, 2, step]
        lines.append(
            f"| {c} | {k} | {step} | {r['temp'] / MiB:.2f} "
            f"| {r['temp'] / scan['temp']:.2f} "
            f"| {r['peak_less_batch'] / MiB:.2f} "
            f"| {r['peak_less_batch'] / base['peak_less_batch']:.2f} |"
        )
    lines += [
        "",
        f"The pipeline ({STAGES} stages, width {PIPE_WIDTH}, M = {M} micro-batches "
        f'of {PIPE_ROWS} rows; stage parameters placed `P("stage")`):',
        "",
        "| compiler | schedule | temp MiB library / floor | ratio "
        "| collective-permutes per loop body |",
        "|---|---|---:|---:|---|",
    ]
    for r in data["pipeline"]:
        lines.append(
            f"| {r['compiler']} | {r['schedule']} | {r['library'] / MiB:.2f} / "
            f"{r['floor'] / MiB:.2f} | {r['library'] / r['floor']:.2f} "
            f"| {', '.join(map(str, r['permutes_per_loop']))} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(harness.script_main("compiled_loops", __doc__, measure, markdown))
