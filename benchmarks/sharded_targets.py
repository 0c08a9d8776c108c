# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The sharded table's memory compiled for XLA:CPU, 8 H100s and a TPU v5e 2x4.

`bench_sharded.py` times and compiles its variants on 8 CPU devices; this
script compiles the same steps (`sharded/variants.py`: the same MLP, 4 layers
512 wide, micro-batches of 256 rows, k = 4, Adam, Explicit meshes, donated
steps) for XLA:GPU on 8 H100s and XLA:TPU on a v5e 2x4 (8 chips), without
the devices (`optax_accum._targets`, the ``compilers`` extra), for each
layout (DP, FSDP, TP, HSDP): each step's temp memory, against its anchor in
the same compiler (``optax.MultiSteps`` for the k-call faces, the hand-written
``lax.scan`` for the one-call ones). Time stays CPU's (`sharded.md`): a
compile gives no time.

Run ``python benchmarks/sharded_targets.py`` (a few minutes on 2 cores); it
writes ``benchmarks/results/sharded_targets.md`` and ``.json``. Without the
extra only XLA:CPU's column is made.
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
from bench_compiled_loops import compile_on  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sharded.layouts import LAYOUTS, Layout, specs  # noqa: E402
from sharded.variants import k_call_variants, one_call_variants, with_adam  # noqa: E402

from optax_accum import _targets  # noqa: E402

WIDTH, DEPTH, ROWS, K = 512, 4, 256, 4
TARGETS = ("h100x8", "v5e:2x4")
MiB = 2**20


def _mesh(target: str, layout: Layout):
    types = (AxisType.Explicit,) * len(layout.axes)
    if target == "cpu":
        return jax.make_mesh(layout.shape, layout.axes, axis_types=types)
    return _targets.target_mesh(target, layout.axes, layout.shape, types)


def _args(layout: Layout, mesh, tx, rows: int) -> tuple[tuple, tuple]:
    """``(args, specs)``: parameters, the optimizer state, and a batch."""
    stored, _ = specs(layout, DEPTH)
    shape = {"w": (WIDTH, WIDTH), "b": (WIDTH,)}
    params = [
        {n: jax.ShapeDtypeStruct(shape[n], jnp.float32, sharding=NamedSharding(mesh, s))
         for n, s in layer.items()}
        for layer in stored
    ]  # fmt: skip
    with jax.set_mesh(mesh):
        state = jax.eval_shape(tx.init, params)
    state_specs = jax.tree.map(lambda a: getattr(a.sharding, "spec", P()), state)
    batch = jax.ShapeDtypeStruct((rows, WIDTH), jnp.float32)
    rows_spec = P(layout.batch)
    return (params, state, batch, batch), (stored, state_specs, rows_spec, rows_spec)


def _temp(target, layout, step, tx, rows) -> int | None:
    mesh = _mesh(target, layout)
    args, arg_specs = _args(layout, mesh, tx, rows)
    kw = {"specs": arg_specs, "axis_names": layout.axes, "mesh_shape": layout.shape,
          "axis_types": (AxisType.Explicit,) * len(layout.axes)}  # fmt: skip
    try:
        with jax.set_mesh(mesh):
            _, memory, _ = compile_on(target, step, args, **kw)
    except Exception as e:  # a step a compiler refuses: n/a in the table
        print(f"{target} {layout.name}: {type(e).__name__}: {str(e)[:200]}")
        return None
    return memory.temp


def _layout_rows(layout: Layout, targets) -> list[dict]:
    rows = []
    for name, (tx, step) in k_call_variants(layout, DEPTH, K).items():
        temps = {t: _temp(t, layout, step, tx, ROWS) for t in targets}
        anchor = "optax.MultiSteps"
        rows.append({"layout": layout.name, "variant": name, "anchor": anchor,
                     "temp": temps})  # fmt: skip
    adam = optax.adam(1e-3)
    for t in targets:  # the one-call variants build their loop on the mesh
        mesh = _mesh(t, layout)
        for name, fn in one_call_variants(layout, mesh, DEPTH, K).items():
            temp = _temp(t, layout, with_adam(fn), adam, ROWS * K)
            found = [r for r in rows if r["variant"] == name]
            if not found:
                found = [{"layout": layout.name, "variant": name,
                          "anchor": "hand-written scan", "temp": {}}]  # fmt: skip
                rows += found
            found[0]["temp"][t] = temp
    return rows


def measure() -> dict:
    targets = ["cpu"] + [t for t in TARGETS if _targets.available(t)]
    rows = [r for layout in LAYOUTS.values() for r in _layout_rows(layout, targets)]
    compilers = {t: _targets.compiler(t) for t in targets if t != "cpu"}
    return {"rows": rows, "targets": targets, "compilers": compilers,
            "command": harness.report.command_line()}  # fmt: skip


def markdown(data: dict) -> str:
    targets = data["targets"]
    lines = [
        "# The sharded table's memory on three compilers",
        "",
        f"`{data['command']}`: compiled, not run; "
        + "; ".join(f"{t}: {c}" for t, c in sorted(data["compilers"].items()))
        + f". MLP {DEPTH} x {WIDTH}, micro-batches of {ROWS} rows, k = {K}, Adam, "
        "Explicit meshes of 8 devices, donated steps. Temp per device, and its "
        "ratio to the anchor (`optax.MultiSteps` for the k-call faces, the "
        "hand-written `lax.scan` for the one-call ones) in the same compiler; "
        "n/a: the step does not compile there.",
        "",
        "| layout | variant | "
        + " | ".join(f"{t} MiB | ratio" for t in targets)
        + " |",
        "|---|---|" + "---:|---:|" * len(targets),
    ]
    for r in data["rows"]:
        anchor = next(
            a for a in data["rows"]
            if a["layout"] == r["layout"] and a["variant"] == r["anchor"]
        )  # fmt: skip
        cells = []
        for t in targets:
            temp, base = r["temp"].get(t), anchor["temp"].get(t)
            if temp is None:
                cells += ["n/a", ""]
                continue
            ratio = f"{temp / base:.2f}" if base else ""
            cells += [f"{temp / MiB:.2f}", ratio]
        lines.append(f"| {r['layout']} | {r['variant']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    data = measure()
    text = markdown(data)
    md = ROOT / "benchmarks" / "results" / "sharded_targets.md"
    harness.report.write_results(md, text, data, data["command"])
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
