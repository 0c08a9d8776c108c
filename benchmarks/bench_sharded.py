# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Sharded parameters: time, temp memory and collectives per layout.

Config: an MLP of ``depth`` dense layers ``width x width`` (tanh), MSE loss,
Adam, ``k`` micro-batches per update, on 8 CPU devices with Explicit meshes:

- ``dp``: 8-way data parallel, replicated parameters;
- ``fsdp``: 8 devices on ``"data"``, every parameter sharded over ``"data"``;
- ``tp``: ``(data=4, model=2)``, Megatron-style column/row-parallel layers;
- ``hsdp``: ``(data=2, fsdp=4)``, the batch over both, parameters over
  ``"fsdp"``.

Three parts, each a ratio measured in one process, interleaved, the median of
several rounds (absolute CPU times are noise):

a. ``accumulate`` (global view) and ``accumulate`` + ``defer_reduction`` vs
   ``optax.MultiSteps``: time per update (``k`` donated jit calls) and the
   compiled temp memory of one call.
b. ``microbatch`` under HSDP with ``data_axes="data"`` vs a hand-written
   ``lax.scan`` with the same collective pattern (``shard_map`` over
   ``"data"``, FSDP gathers per micro-batch, one ``psum`` after the loop); and
   under FSDP, ``param_gather="per_microbatch"`` vs ``"once"``.
c. The collectives per update read from the compiled HLO (``tests/helpers/hlo.py``):
   those that cross the ``"data"`` axis and those that do not, per call / in
   the loop and at the boundary / after the loop; and the accumulator's bytes
   per device vs the parameters'.

Run: ``python benchmarks/bench_sharded.py [--quick] [--rounds N] [--out DIR]``
(``--layouts hsdp,tp`` for a subset). `measure` returns the results as data
(in a subprocess with 8 CPU devices when this process has fewer, or another
backend), `markdown` renders them.
Importing this module changes no JAX setting; run as a script it asks for 8
CPU devices before JAX starts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded.collectives import loop_collectives, normalized_hlo, step_collectives
from sharded.layouts import (
    LAYOUTS,
    Layout,
    init_params,
    make_mesh,
    per_device_bytes,
    place,
    reference_loss,
    relative_error,
    temp_bytes,
)
from sharded.report import markdown
from sharded.variants import (
    k_call_grads,
    k_call_variants,
    one_call_variants,
    with_adam,
)

CONFIGS = {
    False: {"width": 512, "depth": 4, "micro": 256, "k": 4, "rounds": 25},
    True: {"width": 64, "depth": 2, "micro": 32, "k": 4, "rounds": 1},
}
# Each group of variants: its anchor, and the name its ratios go by.
ANCHORS = {
    "k_calls": ("optax.MultiSteps", "optax"),
    "one_call": ("hand-written scan", "scan"),
}


def _batch(rows: int, width: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=(rows, width)).astype("f4") for _ in range(2))


def _place_batch(layout: Layout, mesh, batch: tuple) -> tuple:
    return tuple(jax.device_put(a, NamedSharding(mesh, P(layout.batch))) for a in batch)


def _error(e: Exception) -> dict[str, str]:
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}


def _check_gradients(layout: Layout, mesh, cfg: dict, params, batches, whole):
    """Every variant's gradients against the unsharded reference: one
    micro-batch's for the k-call faces, the whole batch's for the one-call
    faces. Returns the errors and the one-call variants."""
    depth, k = cfg["depth"], cfg["k"]
    ref_grad = jax.jit(jax.grad(reference_loss))
    host = jax.device_get
    ref_micro = ref_grad(init_params(cfg["width"], depth), *host(batches[0]))
    ref_whole = ref_grad(init_params(cfg["width"], depth), *host(whole))
    errors = {}
    for defer in (False, True) if layout.pure else (False,):
        g = k_call_grads(layout, depth, defer)(params, *batches[0])
        errors["loss, deferred" if defer else "loss"] = relative_error(g, ref_micro)
    grads_fns = one_call_variants(layout, mesh, depth, k)
    for name, fn in grads_fns.items():
        errors[name] = relative_error(jax.jit(fn)(params, *whole), ref_whole)
    bad = {n: e for n, e in errors.items() if not e < 1e-4}
    if bad:
        raise AssertionError(f"{layout.name}: wrong gradients: {bad}")
    return errors, grads_fns


def _steps(compiled, state: Any, inputs: list) -> Callable[[], Any]:
    """One update: a call per input, carrying the state along."""
    cell = [state]

    def update():
        p, s = cell[0]
        for xb, yb in inputs:
            p, s = compiled(p, s, xb, yb)
        cell[0] = (p, s)
        return cell[0]

    return update


def _k_calls(layout: Layout, mesh, cfg: dict, params, batches) -> dict:
    """name -> entry (memory, collectives, ``update``) of the k-call faces."""
    out: dict[str, Any] = {}
    for name, (tx, step) in k_call_variants(layout, cfg["depth"], cfg["k"]).items():
        try:
            p = jax.tree.map(jnp.copy, params)
            s = jax.jit(tx.init)(p)
            compiled = step.lower(p, s, *batches[0]).compile()
        except Exception as e:  # e.g. optax.MultiSteps under Explicit
            out[name] = _error(e)
            continue
        acc = s.accumulator if hasattr(s, "accumulator") else s.acc_grads
        out[name] = {
            "temp": temp_bytes(compiled),
            "acc_bytes_per_device": per_device_bytes(acc),
            "collectives": step_collectives(compiled.as_text(), mesh, cfg["k"]),
            "update": _steps(compiled, (p, s), batches),
        }
    return out


def _one_call(mesh, k: int, grads_fns: dict, params, whole) -> dict:
    """name -> entry (memory, collectives, program, ``update``), one call each."""
    out: dict[str, Any] = {}
    for name, grads_fn in grads_fns.items():
        step = with_adam(grads_fn)
        try:
            p = jax.tree.map(jnp.copy, params)
            s = optax.adam(1e-3).init(p)
            compiled = step.lower(p, s, *whole).compile()
        except Exception as e:
            out[name] = _error(e)
            continue
        out[name] = {
            "temp": temp_bytes(compiled),
            "collectives": loop_collectives(compiled.as_text(), mesh, k),
            "hlo": normalized_hlo(compiled.as_text()),
            "update": _steps(compiled, (p, s), [whole]),
        }
    return out


def _compare(group: dict, times: dict, anchor: str, suffix: str) -> None:
    """Each entry's median time, and its time and temp against ``anchor``."""
    for name, t in times.items():
        group[name]["time_s"] = harness.median(t)
    if anchor not in times:
        return
    for name, r in harness.ratios(times, anchor).items():
        group[name][f"time_vs_{suffix}"] = r.median
        group[name][f"time_vs_{suffix}_iqr"] = (r.q25, r.q75)
        group[name][f"temp_vs_{suffix}"] = group[name]["temp"] / group[anchor]["temp"]
        if "hlo" in group[name]:
            group[name]["same_program_as_scan"] = (
                group[name]["hlo"] == group[anchor]["hlo"]
            )


def run_layout(layout: Layout, cfg: dict, rounds: int) -> dict:
    """Parts a and c (and b where the layout has it) for one layout."""
    mesh = make_mesh(layout)
    result: dict = {"layout": layout.name, "mesh": dict(mesh.shape)}
    batches_np = [_batch(cfg["micro"], cfg["width"], i) for i in range(cfg["k"])]
    with jax.set_mesh(mesh):
        params = place(layout, mesh, init_params(cfg["width"], cfg["depth"]))
        batches = [_place_batch(layout, mesh, b) for b in batches_np]
        whole = _place_batch(
            layout, mesh, _batch(cfg["k"] * cfg["micro"], cfg["width"], 99)
        )
        result["param_bytes_per_device"] = per_device_bytes(params)
        errors, grads_fns = _check_gradients(layout, mesh, cfg, params, batches, whole)
        result["max_relative_error_vs_reference"] = errors
        multi = _k_calls(layout, mesh, cfg, params, batches)
        one = _one_call(mesh, cfg["k"], grads_fns, params, whole)
        groups = {"k_calls": multi, "one_call": one}
        updates = {
            (g, n): e["update"]
            for g, group in groups.items()
            for n, e in group.items()
            if "update" in e
        }
        times = harness.interleaved(updates, rounds)
    for g, group in groups.items():
        own = {n: t for (gg, n), t in times.items() if gg == g}
        _compare(group, own, *ANCHORS[g])
        for e in group.values():
            e.pop("update", None)
            e.pop("hlo", None)
    return {**result, **groups}
    return result


def _in_subprocess(quick: bool, rounds: int, layouts: str) -> dict:
    """`measure` in a process with 8 CPU devices; its JSON."""
    argv = ["--rounds", str(rounds), "--layouts", layouts, *["--quick"] * quick]
    return harness.json_of_script(__file__, argv)


def _force_cpu_devices() -> bool:
    """Asks for 8 CPU devices; False if a JAX backend has already started."""
    try:
        jax.config.update("jax_num_cpu_devices", 8)
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        return False
    return True


def measure(
    quick: bool = False,
    rounds: int | None = None,
    layouts: str = ",".join(LAYOUTS),
    log: Callable[[str], None] | None = None,
    json_path: str | None = None,
) -> dict:
    """Runs the benchmark; returns the config and per-layout results as data.

    Needs 8 CPU devices: in a process with fewer (or another backend), it runs
    this script in a subprocess and reads its JSON. ``json_path``: also write
    the data there (what that subprocess does).
    """
    cfg = CONFIGS[quick]
    rounds = rounds or cfg["rounds"]
    log = log or (lambda _: None)
    if jax.default_backend() != "cpu" or harness.needs_cpu_devices(8):
        return _in_subprocess(quick, rounds, layouts)
    results = []
    for name in layouts.split(","):
        t0 = time.perf_counter()
        results.append(run_layout(LAYOUTS[name], cfg, rounds))
        log(f"{name}: {time.perf_counter() - t0:.0f} s")
    data = {
        "benchmark": "bench_sharded",
        "config": cfg,
        "rounds": rounds,
        "devices": jax.device_count(),
        "layouts": results,
    }
    if json_path:
        Path(json_path).write_text(json.dumps(harness.jsonable(data), indent=1))
    return data


def write(data: dict, out: str | Path) -> None:
    """Writes ``sharded.md`` and ``sharded.json`` into the folder ``out``."""
    harness.write_results(Path(out) / "sharded.md", markdown(data), data)


def _arguments(p) -> None:
    p.add_argument(
        "--json", dest="json_path", default=None, help="write only the data here"
    )
    p.add_argument("--layouts", default=",".join(LAYOUTS))


def main(argv: list[str] | None = None) -> int:
    _force_cpu_devices()  # before anything starts JAX
    return harness.script_main(
        "sharded", __doc__, measure, markdown, argv, _arguments, write
    )


if __name__ == "__main__":
    raise SystemExit(main())
