# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The privacy face: per-example memory and the cost of padding micro-batches.

Two questions, on a ReLU MLP, one process:

1. **Memory.** `privacy.clipped_value_and_grad` computes per-example gradients
   one micro-batch at a time. For a fixed logical batch, the compiled
   ``memory_analysis()`` temp bytes at micro-batch sizes 8, 32 and 128 should
   follow the micro-batch (``micro x parameter bytes`` of per-example
   gradients), not the logical batch (the last row: all of it in one
   micro-batch).
2. **Padding.** A DP step (clipped sums over micro-batches of 8, then
   ``dp_accumulate(adam, 1, ...)``) on 8 real micro-batches plus 0, 2 or 4
   all-padding ones (as Poisson sampling pads a logical batch to whole
   micro-batches). A skipped micro-batch costs no compute: the times should
   stay at about 1.0 of the step without padding, where the floor, a
   hand-written ``lax.scan`` that clips and masks every micro-batch, grows as
   (8 + p) / 8. Interleaved rounds, median ratios with their 25th-75th
   percentiles.
3. **Clearing.** `dp_accumulate` zeroes the window's sums in its boundary
   branch, so that no state leaf keeps the un-noised sum (issue 39). Against
   the same mechanism without the clear (``accumulate(chain(noise, adam),
   reduction="sum")``, the composition before it): one per-call window of
   ``k`` updates (a clipped micro-batch each) and the update alone, with the
   state donated, time ratios; and the compiled update's temp and peak
   bytes, with and without donation. The clear routes the accumulator
   through the ``lax.cond``: without donation that is a copy of it.

``python benchmarks/bench_privacy.py [--quick] [--out benchmarks/results/privacy.md]``
"""

from __future__ import annotations

from typing import Any

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import optax_accum
from optax_accum import privacy
from optax_accum.privacy import _noise

CONFIGS: dict[str, dict[str, Any]] = {
    "cpu": {"width": 256, "layers": 3, "logical": 512, "real": 8, "rounds": 7},
    "quick": {"width": 64, "layers": 2, "logical": 128, "real": 4, "rounds": 5},
}
C, MICRO = 1.0, 8


def _params(width: int, layers: int) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(jax.random.key(0), layers)
    return [
        {
            "w": jax.random.normal(k, (width, width)) / np.sqrt(width),
            "b": jnp.zeros(width),
        }
        for k in keys
    ]


def _loss(params, x, y):
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return jnp.mean((x - y) ** 2)


def _data(rows: int, width: int):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)
    return x, y


def memory(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    params = _params(cfg["width"], cfg["layers"])
    n = cfg["logical"]
    x, y = _data(n, cfg["width"])
    param_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
    rows = []
    for micro in dict.fromkeys((8, 32, 128, n)):
        vg = privacy.clipped_value_and_grad(_loss, C, n // micro, batch_argnums=(1, 2))
        compiled = jax.jit(vg).lower(params, x, y).compile()
        mem = harness.compiled_memory(compiled)
        rows.append(
            {
                "micro": micro,
                "k": n // micro,
                "temp": mem["temp"],
                "per_example_grads": micro * param_bytes,
            }
        )
    return rows


def _floor(params, x, y, mask, k):
    """Clip and mask every micro-batch: no skipping."""

    def one(p, x, y):
        g = jax.grad(_loss)(p, x[None], y[None])
        norm = optax.tree.norm(g)
        return jax.tree.map(lambda a: a * jnp.minimum(1.0, C / norm), g)

    def body(acc, mb):
        x, y, m = mb
        g = jax.vmap(one, in_axes=(None, 0, 0))(params, x, y)
        g = jax.tree.map(
            lambda a: jnp.sum(jnp.where(m.reshape(-1, *[1] * (a.ndim - 1)), a, 0), 0),
            g,
        )
        return jax.tree.map(jnp.add, acc, g), None

    split = lambda a: jnp.swapaxes(a.reshape(a.shape[0] // k, k, *a.shape[1:]), 0, 1)
    zeros = jax.tree.map(jnp.zeros_like, params)
    return lax.scan(body, zeros, (split(x), split(y), split(mask)))[0]


def padding(cfg: dict[str, Any], rounds: int) -> list[dict[str, Any]]:
    params = _params(cfg["width"], cfg["layers"])
    real = cfg["real"]
    tx = privacy.dp_accumulate(
        optax.adam(1e-3), 1, l2_clip_norm=C, noise_multiplier=1.0,
        expected_batch_size=real * MICRO, key=jax.random.key(0),
    )  # fmt: skip
    state = tx.init(params)
    variants, pads = {}, (0, 2, 4)
    for p in pads:
        k = real + p
        x, y = _data(k * MICRO, cfg["width"])
        # micro-batch j holds rows j, j + k, ...: the last p are all padding
        mask = jnp.asarray(np.arange(k * MICRO) % k < real)
        vg = privacy.clipped_value_and_grad(
            lambda p_, x, y, m: _loss(p_, x, y), C, k, batch_argnums=(1, 2, 3),
            example_mask_fn=lambda x, y, m: m,
        )  # fmt: skip

        def ours(params, state, x, y, mask, vg=vg):
            u, state = tx.update(vg(params, x, y, mask)[1], state, params)
            return optax.apply_updates(params, u), state

        def floor(params, state, x, y, mask, k=k):
            u, state = tx.update(_floor(params, x, y, mask, k), state, params)
            return optax.apply_updates(params, u), state

        for name, fn in (("ours", ours), ("floor", floor)):
            f = jax.jit(fn)
            variants[name, p] = lambda f=f, x=x, y=y, mask=mask: f(
                params, state, x, y, mask
            )
    times = harness.interleaved(variants, rounds)
    rows = []
    for p in pads:
        rows.append(
            {
                "padding": p,
                "ours": harness.ratio(times, ("ours", p), ("ours", 0)),
                "floor": harness.ratio(times, ("floor", p), ("floor", 0)),
                "ours_vs_floor": harness.ratio(times, ("ours", p), ("floor", p)),
                "ours_ms": 1e3 * harness.median(times["ours", p]),
            }
        )
    return rows


CLEAR_K = 4


def _noised_sums(clear: bool, sigma: float, b: float):
    """`dp_accumulate` (the clear) or the composition without it."""
    key = jax.random.key(0)
    if clear:
        return privacy.dp_accumulate(
            optax.adam(1e-3), CLEAR_K, l2_clip_norm=C, noise_multiplier=sigma,
            expected_batch_size=b, key=key,
        )  # fmt: skip
    mechanism = _noise.add_noise(
        sigma * C, b, jax.random.key_data(key), jax.random.key_impl(key)
    )
    return optax_accum.accumulate(
        optax.chain(mechanism, optax.adam(1e-3)), CLEAR_K, reduction="sum"
    )


def clearing(cfg: dict[str, Any], rounds: int) -> list[dict[str, Any]]:
    params = _params(cfg["width"], cfg["layers"])
    x, y = _data(CLEAR_K * MICRO, cfg["width"])
    xs, ys = (jnp.split(a, CLEAR_K) for a in (x, y))
    vg = privacy.clipped_value_and_grad(_loss, C, 1, batch_argnums=(1, 2))
    grads = jax.jit(lambda p: vg(p, xs[0], ys[0])[1])(params)
    variants, mem = {}, {}
    for name in ("kept", "cleared"):
        tx = _noised_sums(name == "cleared", 1.0, CLEAR_K * MICRO)
        state = tx.init(params)

        def step(p, s, x, y, tx=tx):
            u, s = tx.update(vg(p, x, y)[1], s, p)
            return optax.apply_updates(p, u), s

        # The state is donated, as a training loop donates it.
        step = jax.jit(step, donate_argnums=1)
        update = jax.jit(lambda g, s, p, tx=tx: tx.update(g, s, p), donate_argnums=1)
        for donated, f in (("kept", jax.jit(update.__wrapped__)), ("donated", update)):
            mem[name, donated] = harness.compiled_memory(
                f.lower(grads, state, params).compile()
            )

        def window(s, step=step):
            p = params
            for x, y in zip(xs, ys, strict=True):
                p, s = step(p, s, x, y)
            return p, s

        def updates(s, update=update):
            for _ in range(CLEAR_K):
                u, s = update(grads, s, params)
            return u, s

        fresh = lambda state=state: jax.tree.map(jnp.copy, state)
        variants["window", name] = harness.Timed(window, fresh)
        variants["update", name] = harness.Timed(updates, fresh)
    times = harness.interleaved(variants, rounds)
    return [
        {
            "what": what,
            "ratio": harness.ratio(times, (what, "cleared"), (what, "kept")),
            "kept_ms": 1e3 * harness.median(times[what, "kept"]),
        }
        for what in ("window", "update")
    ] + [
        {
            "what": f"memory, state {donated}",
            "temp_kept": mem["kept", donated]["temp"],
            "temp_cleared": mem["cleared", donated]["temp"],
            "peak_kept": mem["kept", donated]["peak"],
            "peak_cleared": mem["cleared", donated]["peak"],
        }
        for donated in ("kept", "donated")
    ]


def measure(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    cfg = harness.cli.sizes(CONFIGS, quick, rounds=rounds)
    return {
        "config": cfg,
        "memory": memory(cfg),
        "padding": padding(cfg, cfg["rounds"]),
        "clearing": clearing(cfg, cfg["rounds"]),
    }


def _r(r) -> str:
    r = harness.Ratio(*r)
    return f"{r.median:.2f} ({r.q25:.2f}-{r.q75:.2f})"


def _clearing_markdown(rows: Any) -> list[str]:
    """The cost of dp_accumulate's clearing of the window's sums."""
    lines: list[str] = []
    lines += [
        "",
        f"## Clearing: the boundary zeroes the window's sums; {CLEAR_K} calls "
        f"per window, micro-batches of {MICRO}",
        "",
        "`dp_accumulate` against the same mechanism without the clear, the "
        f"state donated. window: {CLEAR_K} calls of (clip a micro-batch, "
        f"update); update: {CLEAR_K} updates alone, on a clipped sum.",
        "",
    ]
    lines += harness.table(
        ["timed", "time, cleared / kept", "kept ms"],
        [
            (r["what"], _r(r["ratio"]), f"{r['kept_ms']:.2f}")
            for r in rows
            if "ratio" in r
        ],
        "lrr",
    )
    lines += [
        "",
        "The compiled update's `memory_analysis()`, bytes:",
        "",
    ]
    lines += harness.table(
        ["update", "temp, kept", "temp, cleared", "peak, kept", "peak, cleared"],
        [
            (
                r["what"],
                f"{r['temp_kept']:,}",
                f"{r['temp_cleared']:,}",
                f"{r['peak_kept']:,}",
                f"{r['peak_cleared']:,}",
            )
            for r in rows
            if "temp_kept" in r
        ],
        "lrrrr",
    )
    return lines


def markdown(data: dict[str, Any]) -> str:
    cfg = data["config"]
    lines = [
        f"Made by `{harness.report.command_line()}` on "
        f"{harness.device_info()['device']} (absolute times are noise on a shared "
        "machine; the ratios are not).",
        "",
        f"MLP {cfg['layers']} x {cfg['width']}, float32; "
        f"{cfg['rounds']} interleaved rounds, median (25th-75th percentile).",
        "",
        f"## Memory: logical batch {cfg['logical']}, `clipped_value_and_grad`",
        "",
    ]
    lines += harness.table(
        ["micro-batch", "k", "temp MiB", "per-example gradients MiB (micro x params)"],
        [
            (
                r["micro"],
                r["k"],
                harness.mib(r["temp"]),
                harness.mib(r["per_example_grads"]),
            )
            for r in data["memory"]
        ],
        "rrrr",
    )
    lines += [
        "",
        f"## Padding: {cfg['real']} real micro-batches of {MICRO}, plus p all "
        "padding; one DP step (clip, dp_accumulate + adam)",
        "",
    ]
    lines += harness.table(
        [
            "p",
            "time / time(p=0), ours",
            "time / time(p=0), floor (no skip)",
            "ours / floor",
            "ours ms",
        ],
        [
            (
                r["padding"],
                _r(r["ours"]),
                _r(r["floor"]),
                _r(r["ours_vs_floor"]),
                f"{r['ours_ms']:.1f}",
            )
            for r in data["padding"]
        ],
        "rrrrr",
    )
    lines += _clearing_markdown(data.get("clearing", ()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(harness.script_main("privacy", __doc__, measure, markdown))
