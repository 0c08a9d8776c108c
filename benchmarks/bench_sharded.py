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
   under FSDP, ``param_gather="per_micro_batch"`` vs ``"once"``.
c. The collectives per update read from the compiled HLO (``tests/helpers/hlo.py``):
   those that cross the ``"data"`` axis and those that do not, per call / in
   the loop and at the boundary / after the loop; and the accumulator's bytes
   per device vs the parameters'.

Run: ``python benchmarks/bench_sharded.py [--quick] [--rounds N] [--out DIR]``
(``--layouts hsdp,tp`` for a subset). `measure` returns the results as data
(in a subprocess with 8 CPU devices when this process has fewer, or another
backend), `markdown` renders them, ``run(quick)`` returns the Markdown.
Importing this module changes no JAX setting; run as a script it asks for 8
CPU devices before JAX starts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding, reshard
from jax.sharding import PartitionSpec as P

import optax_accum

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.helpers import hlo as _hlo

CONFIGS = {
    False: {"width": 512, "depth": 4, "micro": 256, "k": 4, "rounds": 25},
    True: {"width": 64, "depth": 2, "micro": 32, "k": 4, "rounds": 1},
}


class Layout(NamedTuple):
    name: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    batch: tuple[str, ...]  # mesh axes that shard the batch rows
    pure: tuple[str, ...]  # batch axes that shard no parameter (pure DP)


LAYOUTS = {
    "dp": Layout("dp", (8,), ("data",), ("data",), ("data",)),
    "fsdp": Layout("fsdp", (8,), ("data",), ("data",), ()),
    "tp": Layout("tp", (4, 2), ("data", "model"), ("data",), ("data",)),
    "hsdp": Layout("hsdp", (2, 4), ("data", "fsdp"), ("data", "fsdp"), ("data",)),
}


def specs(layout: Layout, depth: int) -> tuple[list, list]:
    """Per layer: the stored (w, b) specs, and what the loss gathers them to."""
    stored, compute = [], []
    for i in range(depth):
        if layout.name == "dp":
            s = c = (P(), P())
        elif layout.name == "fsdp":
            s, c = (P("data", None), P("data")), (P(), P())
        elif layout.name == "hsdp":
            s, c = (P("fsdp", None), P("fsdp")), (P(), P())
        elif i % 2 == 0:  # tp: column-parallel, then row-parallel
            s = c = (P(None, "model"), P("model"))
        else:
            s = c = (P("model", None), P())
        stored.append({"w": s[0], "b": s[1]})
        compute.append({"w": c[0], "b": c[1]})
    return stored, compute


def make_mesh(layout: Layout):
    return jax.make_mesh(
        layout.shape, layout.axes, axis_types=(AxisType.Explicit,) * len(layout.axes)
    )


def make_loss(
    layout: Layout, depth: int, deferred: bool = False, manual: tuple = ()
) -> Callable:
    """The MLP's loss with the user's annotations for an Explicit ``layout``.

    ``deferred``: weights are gathered typed ``reduced`` over the batch axes
    (their gradients come back unreduced over the pure data axes).
    ``manual``: axes that are Manual where the loss runs (a shard_map body).
    """
    _, compute = specs(layout, depth)
    rows = tuple(a for a in layout.batch if a not in manual) or None

    def gather(x, spec):
        if deferred:
            spec = spec.update(reduced=frozenset(layout.batch))
        return reshard(x, spec)

    def loss(params, x, y):
        h = x
        for i, layer in enumerate(params):
            w = gather(layer["w"], compute[i]["w"])
            b = gather(layer["b"], compute[i]["b"])
            cols = compute[i]["w"][1] if len(compute[i]["w"]) > 1 else None
            h = jnp.matmul(h, w, out_sharding=P(rows, cols))
            if deferred:  # a reduced bias meets batch-sharded rows
                b = reshard(jnp.broadcast_to(b, h.shape), P(rows, cols))
            h = h + b
            if i < len(params) - 1:
                h = jnp.tanh(h)
        return jnp.mean((h - y) ** 2)

    return loss


def init_params(width: int, depth: int) -> list:
    rng = np.random.default_rng(0)
    return [
        {
            "w": jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), "f4"),
            "b": jnp.asarray(rng.normal(size=(width,)) * 0.1, "f4"),
        }
        for _ in range(depth)
    ]


def place(layout: Layout, mesh, params: list) -> list:
    stored, _ = specs(layout, len(params))
    return jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, stored
    )


def per_device_bytes(tree: Any) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def temp_bytes(compiled) -> int:
    return compiled.memory_analysis().temp_size_in_bytes


def normalized_hlo(hlo: str) -> list[str]:
    """The instructions of a compiled program, without names and metadata:
    equal lists mean the same program."""
    lines = []
    for line in hlo.splitlines():
        line = re.sub(r"metadata=\{[^}]*\}|channel_id=\d+|stack_frame_id=\d+", "", line)
        line = re.sub(r"%[\w.\-]+", "%v", line).strip()
        if line.startswith(("%v", "ROOT %v")):
            lines.append(line)
    return sorted(lines)


# ---------------------------------------------------------------- collectives


_COUNTS = ("data", "data_bytes", "other", "other_bytes")


def _split(mesh, found: list) -> dict:
    """Counts and bytes of collectives that cross ``"data"`` and that do not."""
    cross = [c for c in found if _hlo.crosses(c[1], mesh, "data")]
    local = [c for c in found if not _hlo.crosses(c[1], mesh, "data")]
    return {
        "data": len(cross),
        "data_bytes": sum(c[2] for c in cross),
        "other": len(local),
        "other_bytes": sum(c[2] for c in local),
        "data_ops": sorted(c[0] for c in cross),
        "other_ops": sorted(c[0] for c in local),
    }


def step_collectives(hlo: str, mesh, k: int) -> dict:
    """A k-call step: collectives per call (outside any cond) and in the
    boundary branch (the branch with the most collectives; the others run on
    hold calls)."""
    comps, _ = _hlo.computations(hlo)
    roots = _hlo.branch_roots(comps)
    in_branches = _hlo.reachable(comps, roots)
    per_call = _split(mesh, _hlo.collectives(comps, set(comps) - in_branches, 8))
    branches = sorted(
        (
            _split(mesh, _hlo.collectives(comps, _hlo.reachable(comps, [r]), 8))
            for r in roots
        ),
        key=lambda s: s["data"] + s["other"],
    )
    zero = {**dict.fromkeys(_COUNTS, 0), "data_ops": [], "other_ops": []}
    boundary = branches[-1] if branches else zero
    hold = branches[0] if len(branches) > 1 else zero
    total = {
        key: per_call[key] * k + boundary[key] + hold[key] * (k - 1) for key in _COUNTS
    }
    return {"where": "per call", "inner": per_call, "outer": boundary, "total": total}


def loop_collectives(hlo: str, mesh, k: int) -> dict:
    """A one-call step with a loop: collectives in the loop and outside it."""
    comps, _ = _hlo.computations(hlo)
    body = _hlo.reachable(comps, _hlo.while_bodies(comps))
    inner = _split(mesh, _hlo.collectives(comps, body, 8))
    outer = _split(mesh, _hlo.collectives(comps, set(comps) - body, 8))
    total = {key: inner[key] * k + outer[key] for key in _COUNTS}
    return {"where": "in loop", "inner": inner, "outer": outer, "total": total}


# ------------------------------------------------------------------ variants


def k_call_variants(layout: Layout, depth: int, k: int) -> dict:
    """name -> (tx, step(p, s, x, y)): one micro-batch per jit call."""
    adam = optax.adam(1e-3)

    def make(tx, loss, defer):
        def step(p, s, x, y):
            q = optax_accum.defer_reduction(p, layout.batch) if defer else p
            g = jax.grad(loss)(q, x, y)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        return tx, jax.jit(step, donate_argnums=(0, 1))

    plain, deferred = make_loss(layout, depth), make_loss(layout, depth, True)
    out = {
        "optax.MultiSteps": make(
            optax.MultiSteps(adam, k).gradient_transformation(), plain, False
        ),
        "accumulate": make(optax_accum.accumulate(adam, k), plain, False),
    }
    if layout.pure:  # FSDP: no axis shards the batch but not the parameters
        out["accumulate + defer_reduction"] = make(
            optax_accum.accumulate(adam, k, data_axes=layout.batch), deferred, True
        )
    return out


def hand_scan(layout: Layout, mesh, depth: int, k: int) -> Callable:
    """``grads(params, x, y)``: a hand-written scan with the library's pattern.

    Pure data-parallel axes: ``shard_map`` over them, the scan inside (FSDP /
    TP collectives stay Explicit, per micro-batch), one ``psum`` after. No pure
    axis (FSDP): the scan in the global view. Parameters sharded over the
    batch's axes pass an optimization barrier with the loop index, so their
    gathers stay per micro-batch.
    """
    barrier = layout.name in ("fsdp", "hsdp")
    manual = layout.pure
    loss = make_loss(layout, depth, manual=manual)

    def scan(params, x, y):
        xs = x.reshape(x.shape[0] // k, k, *x.shape[1:])
        ys = y.reshape(y.shape[0] // k, k, *y.shape[1:])

        def body(acc, i):
            p = lax.optimization_barrier((params, i))[0] if barrier else params
            g = jax.grad(loss)(p, xs[:, i], ys[:, i])
            return jax.tree.map(jnp.add, acc, g), None

        acc, _ = lax.scan(body, jax.tree.map(jnp.zeros_like, params), jnp.arange(k))
        return acc

    if not manual:
        return lambda params, x, y: jax.tree.map(lambda a: a / k, scan(params, x, y))

    n = int(np.prod([mesh.shape[a] for a in manual]))

    def local(params, x, y):
        params = lax.pcast(params, manual, to="varying")  # no psum in the loop
        acc = lax.psum(scan(params, x, y), manual)
        return jax.tree.map(lambda a: a / (k * n), acc)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(manual), P(manual)),
        out_specs=P(),
        axis_names=set(manual),
    )


def one_call_variants(layout: Layout, mesh, depth: int, k: int) -> dict:
    """name -> grads(params, x, y): the whole batch in one jit call."""

    def mb(**kw):
        manual = kw.get("data_axes") or ()
        manual = (manual,) if isinstance(manual, str) else manual
        vg = jax.value_and_grad(make_loss(layout, depth, manual=manual))
        fun = optax_accum.microbatch(vg, k, batch_argnums=(1, 2), **kw)
        return lambda p, x, y: fun(p, x, y)[1]

    out = {"microbatch (global view)": mb()}
    if layout.pure:
        out['microbatch data_axes="data"'] = mb(data_axes="data")
    if layout.name == "fsdp":
        out['microbatch param_gather="once"'] = mb(param_gather="once")
    out["hand-written scan"] = hand_scan(layout, mesh, depth, k)
    return out


def with_adam(grads_fn: Callable) -> Callable:
    """A donated jit step: ``grads_fn``'s gradients, then Adam."""
    adam = optax.adam(1e-3)

    def step(p, s, x, y):
        u, s = adam.update(grads_fn(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    return jax.jit(step, donate_argnums=(0, 1))


def reference_loss(params, x, y):
    """The MLP's loss, unsharded: the reference for every variant's gradients."""
    h = x
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jnp.tanh(h)
    return jnp.mean((h - y) ** 2)


def relative_error(got: Any, want: Any) -> float:
    got, want = jax.device_get(got), jax.device_get(want)
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    diff = max(np.max(np.abs(a - b)) for a, b in pairs)
    return float(diff / max(np.max(np.abs(b)) for b in jax.tree.leaves(want)))


def k_call_grads(layout: Layout, depth: int, defer: bool) -> Callable:
    """One micro-batch's gradient as a k-call variant computes it, reduced by
    ``accumulate(sgd(1), 1)`` (whose update is minus the gradient)."""
    loss = make_loss(layout, depth, deferred=defer)
    tx = optax_accum.accumulate(
        optax.sgd(1.0), 1, data_axes=layout.batch if defer else None
    )

    @jax.jit
    def grads(p, x, y):
        q = optax_accum.defer_reduction(p, layout.batch) if defer else p
        u, _ = tx.update(jax.grad(loss)(q, x, y), tx.init(p), p)
        return jax.tree.map(jnp.negative, u)

    return grads


# ------------------------------------------------------------------- running


def _batch(rows: int, width: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=(rows, width)).astype("f4") for _ in range(2))


def _place_batch(layout: Layout, mesh, batch: tuple) -> tuple:
    return tuple(jax.device_put(a, NamedSharding(mesh, P(layout.batch))) for a in batch)


def _median_ratios(times: dict, anchor: str) -> dict:
    """name -> (median, 25th, 75th percentile) of the per-round ratios."""
    out = {}
    for n, t in times.items():
        r = [a / b for a, b in zip(t, times[anchor], strict=True)]
        out[n] = (statistics.median(r), *np.percentile(r, [25, 75]).tolist())
    return out


def run_layout(layout: Layout, cfg: dict, rounds: int) -> dict:
    """Parts a and c (and b where the layout has it) for one layout."""
    width, depth, micro, k = cfg["width"], cfg["depth"], cfg["micro"], cfg["k"]
    mesh = make_mesh(layout)
    result: dict = {"layout": layout.name, "mesh": dict(mesh.shape)}
    params0 = init_params(width, depth)
    batches_np = [_batch(micro, width, i) for i in range(k)]
    whole_np = _batch(k * micro, width, 99)
    ref_grad = jax.jit(jax.grad(reference_loss))
    ref_micro, ref_whole = (
        ref_grad(params0, *batches_np[0]),
        ref_grad(params0, *whole_np),
    )
    errors = {}
    with jax.set_mesh(mesh):
        params = place(layout, mesh, params0)
        batches = [_place_batch(layout, mesh, b) for b in batches_np]
        whole = _place_batch(layout, mesh, whole_np)
        result["param_bytes_per_device"] = per_device_bytes(params)

        # Every variant computes the right gradients (one micro-batch's for the
        # k-call faces, the whole batch's for the one-call faces).
        for defer in (False, True) if layout.pure else (False,):
            g = k_call_grads(layout, depth, defer)(params, *batches[0])
            errors["loss, deferred" if defer else "loss"] = relative_error(g, ref_micro)
        grads_fns = one_call_variants(layout, mesh, depth, k)
        for name, fn in grads_fns.items():
            errors[name] = relative_error(jax.jit(fn)(params, *whole), ref_whole)
        result["max_relative_error_vs_reference"] = errors
        bad = {n: e for n, e in errors.items() if not e < 1e-4}
        if bad:
            raise AssertionError(f"{layout.name}: wrong gradients: {bad}")

        # k calls per update.
        multi: dict[str, Any] = {}
        for name, (tx, step) in k_call_variants(layout, depth, k).items():
            entry: dict[str, Any] = {}
            try:
                p = jax.tree.map(jnp.copy, params)
                s = jax.jit(tx.init)(p)
                compiled = step.lower(p, s, *batches[0]).compile()
            except Exception as e:  # e.g. optax.MultiSteps under Explicit
                entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                multi[name] = entry
                continue
            acc = s.accumulator if hasattr(s, "accumulator") else s.acc_grads
            entry.update(
                temp=temp_bytes(compiled),
                acc_bytes_per_device=per_device_bytes(acc),
                collectives=step_collectives(compiled.as_text(), mesh, k),
                state=(p, s),
                step=step,
            )
            multi[name] = entry

        one: dict[str, Any] = {}
        for name, grads_fn in grads_fns.items():
            step = with_adam(grads_fn)
            entry = {}
            try:
                p = jax.tree.map(jnp.copy, params)
                s = optax.adam(1e-3).init(p)
                compiled = step.lower(p, s, *whole).compile()
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                one[name] = entry
                continue
            entry.update(
                temp=temp_bytes(compiled),
                collectives=loop_collectives(compiled.as_text(), mesh, k),
                hlo=normalized_hlo(compiled.as_text()),
                state=(p, s),
                step=step,
            )
            one[name] = entry

        def time_multi(name):
            e = multi[name]
            p, s = e["state"]
            t0 = time.perf_counter()
            for xb, yb in batches:
                p, s = e["step"](p, s, xb, yb)
            jax.block_until_ready((p, s))
            e["state"] = (p, s)
            return time.perf_counter() - t0

        def time_one(name):
            e = one[name]
            p, s = e["state"]
            t0 = time.perf_counter()
            p, s = e["step"](p, s, *whole)
            jax.block_until_ready((p, s))
            e["state"] = (p, s)
            return time.perf_counter() - t0

        ok_multi = [n for n, e in multi.items() if "error" not in e]
        ok_one = [n for n, e in one.items() if "error" not in e]
        t_multi: dict[str, list] = {n: [] for n in ok_multi}
        t_one: dict[str, list] = {n: [] for n in ok_one}
        for r in range(rounds + 1):  # round 0 warms up
            for n in ok_multi:
                t = time_multi(n)
                if r:
                    t_multi[n].append(t)
            for n in ok_one:
                t = time_one(n)
                if r:
                    t_one[n].append(t)

    for group, times in ((multi, t_multi), (one, t_one)):
        for name, t in times.items():
            group[name]["time_s"] = statistics.median(t)
            del group[name]["state"], group[name]["step"]
        for e in group.values():
            e.pop("state", None)
            e.pop("step", None)
    if "optax.MultiSteps" in t_multi:
        for n, (ratio, lo, hi) in _median_ratios(t_multi, "optax.MultiSteps").items():
            multi[n]["time_vs_optax"] = ratio
            multi[n]["time_vs_optax_iqr"] = (lo, hi)
            multi[n]["temp_vs_optax"] = (
                multi[n]["temp"] / multi["optax.MultiSteps"]["temp"]
            )
    if "hand-written scan" in t_one:
        scan = one["hand-written scan"]
        for n, (ratio, lo, hi) in _median_ratios(t_one, "hand-written scan").items():
            one[n]["time_vs_scan"] = ratio
            one[n]["time_vs_scan_iqr"] = (lo, hi)
            one[n]["temp_vs_scan"] = one[n]["temp"] / scan["temp"]
            one[n]["same_program_as_scan"] = one[n]["hlo"] == scan["hlo"]
    for e in one.values():
        e.pop("hlo", None)
    result["k_calls"] = multi
    result["one_call"] = one
    return result


# ------------------------------------------------------------------- reports


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ratio(x: float | None, iqr: tuple | None = None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.2f}x" + (f" ({iqr[0]:.2f}-{iqr[1]:.2f})" if iqr else "")


def targets(results: list, cfg: dict) -> list[str]:
    """The thresholds the sharded layouts are held to, with the measured values."""
    lines = [
        f"#### Targets: {cfg['depth']}x{cfg['width']} MLP, k={cfg['k']}, Adam, "
        "8 devices",
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ]

    def row(what, value, ok):
        lines.append(f"| {what} | {value} | {'yes' if ok else '**no**'} |")

    by = {r["layout"]: r for r in results}
    for name in ("fsdp", "tp", "hsdp"):
        e = by.get(name, {}).get("k_calls", {}).get("accumulate")
        if not e or "time_vs_optax" not in e:
            continue
        lo, hi = e["time_vs_optax_iqr"]
        t, m = e["time_vs_optax"], e["temp_vs_optax"]
        row(
            f"{name}: `accumulate` time <= 1.0x optax.MultiSteps",
            f"{t:.2f}x (IQR {lo:.2f}-{hi:.2f})",
            t <= 1.0,
        )
        row(f"{name}: `accumulate` temp <= 1.0x optax.MultiSteps", f"{m:.2f}x", m <= 1)
    e = by.get("hsdp", {}).get("one_call", {}).get('microbatch data_axes="data"')
    if e and "time_vs_scan" in e:
        lo, hi = e["time_vs_scan_iqr"]
        same = e["same_program_as_scan"]
        note = " (the same compiled program)" if same else ""
        row(
            'hsdp: `microbatch(data_axes="data")` time <= 1.05x hand-written scan',
            f"{e['time_vs_scan']:.2f}x (IQR {lo:.2f}-{hi:.2f}){note}",
            e["time_vs_scan"] <= 1.05 or same,
        )
        row(
            'hsdp: `microbatch(data_axes="data")` temp <= 1.05x hand-written scan',
            f"{e['temp_vs_scan']:.2f}x{note}",
            e["temp_vs_scan"] <= 1.05,
        )
    for res in results:
        for name in ("accumulate + defer_reduction", 'microbatch data_axes="data"'):
            group = res["k_calls"] if name.startswith("acc") else res["one_call"]
            e = group.get(name)
            if not e or "collectives" not in e:
                continue
            n = e["collectives"]["inner"]["data"]
            where = "per call" if name.startswith("acc") else "in the loop"
            row(f"{res['layout']}: `{name}`, collectives {where} crossing data = 0",
                str(n), n == 0)  # fmt: skip
    return lines


def markdown(data: dict) -> str:
    """The Markdown report of `measure`'s result."""
    results, cfg, rounds = data["layouts"], data["config"], data["rounds"]
    width, depth, micro, k = cfg["width"], cfg["depth"], cfg["micro"], cfg["k"]
    n_params = depth * (width * width + width)
    lines = [
        f"Config: MLP {depth}x{width}x{width} ({n_params / 1e6:.2f}M params, "
        f"float32), micro-batch {micro} rows, k = {k}, Adam, 8 CPU devices, "
        f"Explicit meshes, donated jit steps; median of {rounds} interleaved "
        "rounds (IQR: 25th-75th percentile of the per-round ratios); temp = "
        "compiled `temp_size_in_bytes` per device.",
        "",
        *targets(results, cfg),
        "",
        "#### a. `accumulate` vs `optax.MultiSteps` (k jit calls per update)",
        "",
        "FSDP has no `defer_reduction` row: its only batch axis shards every "
        "parameter, so there is no pure data-parallel reduction to defer.",
        "",
        "| layout | variant | time / update | time vs optax.MultiSteps (IQR) "
        "| temp | temp vs optax.MultiSteps |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for res in results:
        for name, e in res["k_calls"].items():
            if "error" in e:
                lines.append(f"| {res['layout']} | {name} | fails: {e['error']} ||||")
                continue
            lines.append(
                f"| {res['layout']} | {name} | {e['time_s'] * 1e3:.1f} ms "
                f"| {_ratio(e.get('time_vs_optax'), e.get('time_vs_optax_iqr'))} "
                f"| {_fmt_bytes(e['temp'])} "
                f"| {_ratio(e.get('temp_vs_optax'))} |"
            )
    lines += [
        "",
        "#### b. `microbatch` vs a hand-written `lax.scan` (one jit call per update)",
        "",
        "| layout | variant | time / update | time vs scan (IQR) | temp | temp vs scan "
        "| same compiled program as the scan |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for res in results:
        for name, e in res["one_call"].items():
            if "error" in e:
                lines.append(f"| {res['layout']} | {name} | fails: {e['error']} |||||")
                continue
            lines.append(
                f"| {res['layout']} | {name} | {e['time_s'] * 1e3:.1f} ms "
                f"| {_ratio(e.get('time_vs_scan'), e.get('time_vs_scan_iqr'))} "
                f"| {_fmt_bytes(e['temp'])} | {_ratio(e.get('temp_vs_scan'))} "
                f"| {'yes' if e.get('same_program_as_scan') else 'no'} |"
            )
    lines += [
        "",
        "#### c. Collectives per update (compiled HLO)",
        "",
        "Counts are of the compiled program, after XLA combines collectives "
        "(one tuple all-reduce counts once); bytes are each result's size. The "
        "CPU backend emits no reduce-scatter: an FSDP gradient's reduction is "
        "an all-reduce of the full gradient then a slice (GPU/TPU pipelines "
        "rewrite that pair to a reduce-scatter), so FSDP byte counts here are "
        "the fsdp-axis size times what a reduce-scatter moves.",
        "",
        "k-call faces: *inner* = per call (x k), *outer* = in the boundary "
        "branch (once). One-call faces: *inner* = in the loop (x k), *outer* = "
        "outside it. *data* = groups that cross the `data` axis (HSDP/FSDP: "
        "also those over data x fsdp), *other* = groups within one data index "
        "(fsdp, model).",
        "",
        "| layout | variant | data: inner / outer | data per update (bytes) "
        "| other: inner / outer | other per update (bytes) "
        "| accumulator / params bytes per device |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        rows = {**res["k_calls"], **res["one_call"]}
        for name, e in rows.items():
            if "error" in e:
                continue
            c = e["collectives"]
            i, o, t = c["inner"], c["outer"], c["total"]
            acc = e.get("acc_bytes_per_device")
            acc_s = (
                f"{_fmt_bytes(acc)} / {_fmt_bytes(res['param_bytes_per_device'])}"
                if acc is not None
                else f"carry / {_fmt_bytes(res['param_bytes_per_device'])}"
            )
            lines.append(
                f"| {res['layout']} | {name} | {i['data']} / {o['data']} "
                f"| {t['data']} ({_fmt_bytes(t['data_bytes'])}) "
                f"| {i['other']} / {o['other']} "
                f"| {t['other']} ({_fmt_bytes(t['other_bytes'])}) | {acc_s} |"
            )
    return "\n".join(lines)


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
) -> dict:
    """Runs the benchmark; returns the config and per-layout results as data.

    Needs 8 CPU devices: in a process with fewer (or another backend), it runs
    this script in a subprocess and reads its JSON.
    """
    cfg = CONFIGS[quick]
    rounds = rounds or cfg["rounds"]
    log = log or (lambda _: None)
    if jax.default_backend() != "cpu" or jax.device_count() < 8:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "sharded.json")
            argv = ["--rounds", str(rounds), "--layouts", layouts, "--json", path]
            proc = subprocess.run(
                [sys.executable, __file__, *argv, *["--quick"] * quick],
                capture_output=True,
                text=True,
            )
            if proc.returncode:
                raise RuntimeError(
                    f"{os.path.basename(__file__)} failed in a subprocess "
                    f"(status {proc.returncode}):\n{proc.stderr[-4000:]}"
                )
            with open(path) as f:
                return json.load(f)
    results = []
    for name in layouts.split(","):
        t0 = time.perf_counter()
        results.append(run_layout(LAYOUTS[name], cfg, rounds))
        log(f"{name}: {time.perf_counter() - t0:.0f} s")
    return {
        "benchmark": "bench_sharded",
        "config": cfg,
        "rounds": rounds,
        "devices": jax.device_count(),
        "layouts": results,
    }


def write(data: dict, out: str) -> None:
    """Writes ``sharded.md`` and ``sharded.json`` into the folder ``out``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "sharded.md"), "w") as f:
        f.write(markdown(data) + "\n")
    with open(os.path.join(out, "sharded.json"), "w") as f:
        json.dump(data, f, indent=1)


def run(
    quick: bool = False,
    rounds: int | None = None,
    layouts: str = ",".join(LAYOUTS),
    out: str | None = None,
) -> str:
    """Runs the benchmark and returns the Markdown (written to ``out`` too)."""
    data = measure(quick, rounds, layouts)
    if out:
        write(data, out)
    return markdown(data)


def main(argv: list[str] | None = None) -> int:
    _force_cpu_devices()  # before anything starts JAX
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny config")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--out", default=None, help="directory for sharded.md and sharded.json"
    )
    parser.add_argument("--json", default=None, help="write only the data here")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args(argv)
    log = lambda line: print(f"[{line}]", file=sys.stderr, flush=True)
    data = measure(args.quick, args.rounds, args.layouts, log=log)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
        return 0
    if args.out:
        write(data, args.out)
    print(markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
