# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Every library pipeline schedule against its hand-written floor.

Config: the tests' residual tanh stages (``tests/pipeline/models.py``),
``ROWS`` rows per micro-batch, a stage-4 mesh of CPU devices (8 CPU devices
set before JAX starts). For each width and M: the library's GPipe, 1F1B and
ZB-H1 (`optax_accum.pipeline.value_and_grad`), the hand-written floors of
the same schedules (`pipeline_floors`), the pipeline-free run (4 devices,
M/4 micro-batches each) and the sequential model, timed in one process in
interleaved rounds. The pipelines take the stage parameters placed one stage
per device (``P("stage")``), as a user keeps them, so no schedule gathers its
gradients to every device after the loop. Each time is a median ratio over
rounds (25th-75th percentiles in brackets); temp memory is
``memory_analysis()``'s. The op costs are
`optax_accum.pipeline.measure_costs` (compiled FLOPs).

Run: ``python benchmarks/bench_pipeline_floors.py [--quick] [--out DIR]``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import harness

STAGES = 4
ROWS = 16
PAIRS = (("gpipe", "gpipe"), ("1f1b", "one_f_one_b"), ("zb_h1", "zb_h1"))
# Two layers per device: circular and interleaved 1F1B (repeats 2, stacked
# (repeats, S) and placed P(None, "stage")) against the same 8-layer model
# as 4 two-layer stages: the library's GPipe and 1F1B and their floors.
REPEATS = 2
REPEATED = (("circular", "gpipe"), ("interleaved_1f1b", "1f1b"))


def two_layers(sp, h):
    """One device's stage of two layers (``sp`` leaves lead with 2)."""
    import jax

    from tests.pipeline import models as md

    for i in range(REPEATS):
        h = md.stage_fn(jax.tree.map(lambda v, i=i: v[i], sp), h)
    return h


def _compiled_and_timed(
    fns: dict, args: dict, batch: Any, rounds: int, out: dict[str, Any]
) -> dict[str, list[float]]:
    """Compile each ``fns[n]`` for ``(args[n], batch)``, put its temp bytes
    in ``out["temp_bytes"]`` and time them all in interleaved rounds."""
    import jax

    compiled = {n: jax.jit(f).lower(args[n], batch).compile() for n, f in fns.items()}
    for n, c in compiled.items():
        out["temp_bytes"][n] = int(c.memory_analysis().temp_size_in_bytes)
    return harness.interleaved(
        {n: (lambda c=c, n=n: c(args[n], batch)) for n, c in compiled.items()},
        rounds,
    )


def repeated(width: int, m: int, rounds: int) -> dict[str, Any]:
    """Circular and interleaved 1F1B against two-layer GPipe and 1F1B."""
    import jax
    import numpy as np
    import pipeline_floors as floors
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from optax_accum import pipeline as pl
    from tests.pipeline import models as md

    mesh = jax.make_mesh((STAGES,), ("stage",), devices=jax.devices()[:STAGES])
    (fp, sp, lp), batch = md.make(STAGES * REPEATS, rows=ROWS * m, width=width)
    batch["mask"] = np.ones_like(batch["mask"])
    # Layer j: stage j // 2's layer j % 2 in the two-layer model; [r, s] with
    # j = r·S + s in the repeated one. Both are the same 8 layers in order.
    by_device = jax.tree.map(lambda v: v.reshape(STAGES, REPEATS, *v.shape[1:]), sp)
    by_repeat = jax.tree.map(lambda v: v.reshape(REPEATS, STAGES, *v.shape[1:]), sp)
    fns, args = {}, {}
    for lib, base in REPEATED:
        fns[lib] = pl.value_and_grad(
            md.first_fn, md.stage_fn, md.loss_fn, m, schedule=lib,
            repeats=REPEATS, stage_layout="repeats_by_stage",
        )  # fmt: skip
        fns[base + " x2"] = pl.value_and_grad(
            md.first_fn, two_layers, md.loss_fn, m, schedule=base
        )
        floor = "one_f_one_b" if base == "1f1b" else base
        fns["floor " + base + " x2"] = getattr(floors, floor)(
            mesh, m, stage_fn=two_layers
        )
    out: dict[str, Any] = {"width": width, "M": m, "temp_bytes": {}}
    with jax.set_mesh(mesh):
        across = NamedSharding(mesh, P(None, "stage"))
        placed = {
            "repeats": (fp, jax.device_put(by_repeat, across), lp),
            "stages": (
                fp,
                jax.device_put(by_device, NamedSharding(mesh, P("stage"))),
                lp,
            ),
        }
        for n in fns:
            args[n] = placed["repeats" if n in dict(REPEATED) else "stages"]
        times = _compiled_and_timed(fns, args, batch, rounds, out)
    out["seconds"] = {n: harness.median(t) for n, t in times.items()}
    out["ratios"] = {}
    for lib, base in REPEATED:
        for other in (base + " x2", "floor " + base + " x2"):
            out["ratios"][f"{lib} / {other}"] = harness.ratio(
                times, lib, other
            )._asdict()
    return out


def case(width: int, m: int, rounds: int) -> dict[str, Any]:
    import jax
    import numpy as np
    import pipeline_floors as floors
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from optax_accum import pipeline as pl
    from tests.pipeline import models as md

    mesh = jax.make_mesh((STAGES,), ("stage",), devices=jax.devices()[:STAGES])
    params, batch = md.make(STAGES, rows=ROWS * m, width=width)
    batch["mask"] = np.ones_like(batch["mask"])
    fns = {}
    # The pipelines take the stage parameters where a user keeps them, one
    # stage per device (P("stage")), so their gradients come back there; the
    # runs without a stage axis take them whole.
    whole = {"pipeline-free", "sequential"}
    for lib, floor in PAIRS:
        fns[lib] = pl.value_and_grad(
            md.first_fn, md.stage_fn, md.loss_fn, m, schedule=lib
        )
        fns["floor " + lib] = getattr(floors, floor)(mesh, m)
    fns["pipeline-free"] = floors.pipeline_free(mesh, m)
    fns["sequential"] = floors.sequential()
    out: dict[str, Any] = {"width": width, "M": m, "temp_bytes": {}}
    with jax.set_mesh(mesh):
        fp, sp, lp = params
        staged = (fp, jax.device_put(sp, NamedSharding(mesh, P("stage"))), lp)
        args = {n: params if n in whole else staged for n in fns}
        times = _compiled_and_timed(fns, args, batch, rounds, out)
    out["seconds"] = {n: harness.median(t) for n, t in times.items()}
    ratio = {}
    for lib, _ in PAIRS:
        ratio[lib + " / floor"] = harness.ratio(times, lib, "floor " + lib)._asdict()
        ratio[lib + " / pipeline-free"] = harness.ratio(
            times, lib, "pipeline-free"
        )._asdict()
    ratio["zb_h1 / 1f1b"] = harness.ratio(times, "zb_h1", "1f1b")._asdict()
    ratio["floor zb_h1 / floor 1f1b"] = harness.ratio(
        times, "floor zb_h1", "floor 1f1b"
    )._asdict()
    ratio["floor gpipe / sequential"] = harness.ratio(
        times, "floor gpipe", "sequential"
    )._asdict()
    ratio["pipeline-free / sequential"] = harness.ratio(
        times, "pipeline-free", "sequential"
    )._asdict()
    out["ratios"] = ratio
    out["costs"] = list(
        pl.measure_costs(md.first_fn, md.stage_fn, md.loss_fn, params, batch, m)
    )
    out["ticks"] = {
        lib: pl.schedule_table(lib, STAGES, m).num_ticks for lib, _ in PAIRS
    }
    out["time_bubble"] = {
        lib: pl.bubble_fraction(lib, STAGES, m, costs=out["costs"]) for lib, _ in PAIRS
    }
    return out


def measure(
    quick: bool = False, rounds: int | None = None, json: str | None = None
) -> dict[str, Any]:
    """The cases as data; in a process with fewer than 8 CPU devices, runs
    this script in a subprocess (``json``: where that one writes them)."""
    rounds = rounds or (3 if quick else 7)
    if harness.needs_cpu_devices(8):
        return harness.json_of_script(
            __file__, ["--rounds", str(rounds), *["--quick"] * quick]
        )
    widths, ms = ((128,), (8,)) if quick else ((512, 1024), (8, 32))
    data = {
        "run": "python benchmarks/bench_pipeline_floors.py"
        + (" --quick" if quick else "")
        + " --out benchmarks/results",
        "rounds": rounds,
        "rows_per_microbatch": ROWS,
        "cases": [case(w, m, rounds) for w in widths for m in ms],
        "repeated": [repeated(w, m, rounds) for w in widths for m in ms],
    }
    if json is not None:
        with open(json, "w") as f:
            f.write(__import__("json").dumps(data))
    return data


def _r(r: dict) -> str:
    return f"{r['median']:.2f} [{r['q25']:.2f}-{r['q75']:.2f}]"


def markdown(data: dict[str, Any]) -> str:
    lines = [
        f"Made by `{data.get('run') or data.get('command')}`. "
        f"Stage-4 mesh of CPU devices, {data['rows_per_microbatch']} rows per "
        f"micro-batch; median of {data['rounds']} interleaved rounds "
        "[25th-75th percentile]. A floor is the hand-written `shard_map` of the "
        "same schedule (`benchmarks/pipeline_floors.py`); the pipeline-free run "
        "gives each of the 4 devices M/4 micro-batches of the whole model. "
        'Stage parameters placed `P("stage")`; ticks are the schedule\'s '
        "loop steps.",
        "",
    ]
    header = [
        "width",
        "M",
        "schedule",
        "time / floor",
        "time / pipeline-free",
        "temp MiB library / floor",
        "time bubble at measured costs",
    ]
    rows = []
    for c in data["cases"]:
        for lib, _ in PAIRS:
            t = c["temp_bytes"]
            rows.append(
                [
                    c["width"],
                    c["M"],
                    lib,
                    _r(c["ratios"][lib + " / floor"]),
                    _r(c["ratios"][lib + " / pipeline-free"]),
                    f"{harness.mib(t[lib])} / {harness.mib(t['floor ' + lib])}",
                    f"{c['time_bubble'][lib]:.3f}",
                ]
            )
    lines += harness.table(header, rows, "rrlrrrr")
    lines += _context_table(data["cases"])
    lines += _repeated_table(data.get("repeated", []))
    return "\n".join(lines) + "\n"


def _context_table(cases: list[dict[str, Any]]) -> list[str]:
    """ZB-H1 against 1F1B (library and floors), and the runs without a
    pipeline against the sequential model."""
    rows = []
    for c in cases:
        t = c["temp_bytes"]
        floors = c["ratios"].get("floor zb_h1 / floor 1f1b")
        temp = t["zb_h1"] / t["1f1b"], t["floor zb_h1"] / t["floor 1f1b"]
        rows.append(
            [
                c["width"],
                c["M"],
                _r(c["ratios"]["zb_h1 / 1f1b"]),
                _r(floors) if floors else "n/a",
                _ticks(c),
                "{:.2f} ({:.2f})".format(*temp),
                _r(c["ratios"]["floor gpipe / sequential"]),
                _r(c["ratios"]["pipeline-free / sequential"]),
                ", ".join(f"{x:.2f}" for x in c["costs"]),
            ]
        )
    header = [
        "width",
        "M",
        "time ZB-H1 / 1F1B",
        "time floor ZB-H1 / floor 1F1B",
        "ticks ZB-H1 / 1F1B",
        "temp ZB-H1 / 1F1B (floors)",
        "floor GPipe / sequential",
        "pipeline-free / sequential",
        "measured (f, b, w)",
    ]
    return ["", "Context:", "", *harness.table(header, rows, "rrrrrrrrr")]


def _ticks(case: dict[str, Any]) -> str:
    """ZB-H1's loop steps over 1F1B's (older results have none)."""
    ticks = case.get("ticks")
    if not ticks:
        return "-"
    return f"{ticks['zb_h1']} / {ticks['1f1b']} = {ticks['zb_h1'] / ticks['1f1b']:.2f}"


def _repeated_table(cases: list[dict[str, Any]]) -> list[str]:
    """Circular and interleaved 1F1B (2 layers per device) against GPipe and
    1F1B with two-layer stages, library and floor."""
    if not cases:
        return []
    rows = []
    for c in cases:
        t = c["temp_bytes"]
        for lib, base in REPEATED:
            rows.append(
                [
                    c["width"],
                    c["M"],
                    lib,
                    _r(c["ratios"][f"{lib} / {base} x2"]),
                    _r(c["ratios"][f"{lib} / floor {base} x2"]),
                    f"{harness.mib(t[lib])} / {harness.mib(t[base + ' x2'])} / "
                    f"{harness.mib(t['floor ' + base + ' x2'])}",
                ]
            )
    header = [
        "width",
        "M",
        "schedule (repeats 2)",
        "time / library's two-layer-stage base",
        "time / that base's floor",
        "temp MiB: it / base / floor",
    ]
    return [
        "",
        "Two layers per device (8 layers on 4 devices): circular and interleaved "
        "1F1B with `stage_layout='repeats_by_stage'` against GPipe (circular's "
        "base) and 1F1B (interleaved's) running the same 8 layers as 4 "
        "two-layer stages, library and hand-written floor:",
        "",
        *harness.table(header, rows, "rrlrrr"),
    ]


def main(argv: list[str] | None = None) -> int:
    import jax

    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        jax.config.update("jax_num_cpu_devices", 8)
    return harness.script_main(
        "pipeline_floors",
        __doc__,
        measure,
        markdown,
        argv,
        add_arguments=lambda p: p.add_argument("--json", default=None),
    )


if __name__ == "__main__":
    raise SystemExit(main())
