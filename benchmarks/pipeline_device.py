# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The pipeline's machinery on one accelerator: every schedule at S = 1.

On a single device a stage axis of 1 is all that runs, so this measures what
that can show: the cost of each schedule's runner (its table loop, buffers,
dispatch and gradient sums) against plain ``jax.value_and_grad`` over the
same micro-batches (a hand-written ``lax.scan`` summing each micro-batch's
gradient, weighted by its share of the mask, which is what the pipeline's
global view computes). Step time as the median ratio of interleaved rounds,
and compiled temp and peak bytes from ``memory_analysis()``; the losses of
both sides are checked equal before anything is timed.

Model: the pipeline tests' staged MLP (``tests/pipeline/models.py``); with
``repeats`` r (circular, interleaved 1F1B) the one device holds r stages.
"""

from __future__ import annotations

import functools
from typing import Any

import harness
import numpy as np

SCHEDULES = (
    ("gpipe", 1),
    ("1f1b", 1),
    ("zb_h1", 1),
    ("circular", 2),
    ("interleaved_1f1b", 2),
)


def _reference(md: Any, m: int):
    """``jax.value_and_grad`` of the sequential model over the m strided
    micro-batches (micro-batch i is rows i, i + m, ...), each weighted by its
    share of the mask: the pipeline's global-view token mean."""
    import jax
    import jax.numpy as jnp

    def value_and_grad(params, batch):
        views = jax.tree.map(lambda a: a.reshape(-1, m, *a.shape[1:]), batch)
        total = jnp.maximum(jnp.sum(batch["mask"]), 1.0)

        def body(acc, i):
            mb = jax.tree.map(lambda a: a[:, i], views)
            share = jnp.sum(mb["mask"]) / total
            loss, g = jax.value_and_grad(md.sequential)(params, mb)
            return jax.tree.map(lambda s, x: s + share * x, acc, (loss, g)), None

        zero = jax.tree.map(jnp.zeros_like, (jnp.zeros(()), params))
        out, _ = jax.lax.scan(body, zero, jnp.arange(m))
        return out

    return jax.jit(value_and_grad)


def measure(config: dict[str, Any], log=print) -> dict[str, Any]:
    """Rows of (schedule, time vs plain, temp and peak bytes, both sides)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from optax_accum import pipeline as pl
    from tests.pipeline import models as md

    m, width, rows = config["m"], config["width"], config["rows"]
    mesh = jax.make_mesh((1,), ("stage",), devices=jax.devices()[:1])
    out = []
    for schedule, repeats in SCHEDULES:
        params, batch = md.make(repeats, rows=rows * m, width=width)
        with jax.set_mesh(mesh):
            fp, sp, lp = params
            params = (fp, jax.device_put(sp, NamedSharding(mesh, P("stage"))), lp)
            vg = pl.value_and_grad(
                md.first_fn, md.stage_fn, md.loss_fn, m,
                schedule=schedule, repeats=repeats,
            )  # fmt: skip
            piped = jax.jit(vg).lower(params, batch).compile()
        # The plain step takes the parameters unplaced (one device either way).
        host = jax.device_put(jax.device_get(params), jax.devices()[0])
        plain = _reference(md, m).lower(host, batch).compile()
        with jax.set_mesh(mesh):
            loss, _ = piped(params, batch)
        np.testing.assert_allclose(loss, plain(host, batch)[0], rtol=1e-4)
        with jax.set_mesh(mesh):
            times = harness.interleaved(
                {
                    "plain": functools.partial(plain, host, batch),
                    "pipeline": functools.partial(piped, params, batch),
                },
                config["rounds"],
            )
        r = harness.ratio(times, "pipeline", "plain")
        mp, mr = harness.compiled_memory(piped), harness.compiled_memory(plain)
        out.append({
            "schedule": schedule + (f" (r={repeats})" if repeats > 1 else ""),
            "time_vs_plain": r.median, "q25": r.q25, "q75": r.q75,
            "temp_bytes": mp["temp"], "plain_temp_bytes": mr["temp"],
            "peak_bytes": mp["peak"], "plain_peak_bytes": mr["peak"],
        })  # fmt: skip
        log(f"pipeline S=1 {schedule}: {r.median:.2f}x plain")
    return {
        "config": dict(config),
        "rows": out,
        "backend": jax.default_backend(),
        "compilations": 2 * len(out),
    }


def markdown(data: dict[str, Any]) -> str:
    c = data["config"]
    head = [
        "schedule", "time / plain (q25-q75)", "temp MiB", "plain temp MiB",
        "peak MiB", "plain peak MiB",
    ]  # fmt: skip
    mib = 2.0**20
    body = [
        [
            row["schedule"],
            f"{row['time_vs_plain']:.2f} ({row['q25']:.2f}-{row['q75']:.2f})",
            f"{row['temp_bytes'] / mib:.2f}",
            f"{row['plain_temp_bytes'] / mib:.2f}",
            f"{row['peak_bytes'] / mib:.2f}",
            f"{row['plain_peak_bytes'] / mib:.2f}",
        ]
        for row in data["rows"]
    ]
    lines = [
        f"S = 1 on one {data['backend']} device; width {c['width']}, "
        f"M = {c['m']} micro-batches of {c['rows']} rows, "
        f"median of {c['rounds']} interleaved rounds. Plain: `jax.value_and_grad` "
        "of the sequential model in a hand-written `lax.scan` over the same "
        "micro-batches.",
        "",
        *harness.table(head, body, "lrrrrr"),
    ]
    return "\n".join(lines)
