# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Padding micro-batches cost no compute in the fused loop.

A micro-batch of weight 0 (all padding: its token count, the ``weight_fn``,
is 0) is skipped under `lax.cond` (issue 32, item 4). Time of one gradient
computation of k = 8 micro-batches of a token-weighted ReLU MLP, with 0, 2 and
4 (and all 8) of them all padding, on both faces (`microbatch` given
``jax.value_and_grad``, and the loss face `microbatch_value_and_grad`). The
compiled program is the same for every row; only the mask differs. Ratios
against 0 padding, one process, interleaved rounds, median with the 25th and
75th percentiles; the ideal is the share of real micro-batches. Run
``python benchmarks/bench_padding.py --out benchmarks/results/padding.md``.
"""

from __future__ import annotations

from functools import partial

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

CONFIGS: dict[str, dict[str, int]] = {
    "cpu": {"width": 512, "layers": 4, "micro": 64, "k": 8, "rounds": 9},
    "quick": {"width": 128, "layers": 3, "micro": 32, "k": 8, "rounds": 5},
}
PADDED = (0, 2, 4, 8)


def _loss(params, x, y, mask):
    for i, (w, b) in enumerate(params):
        x = x @ w + b
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    per_row = optax.softmax_cross_entropy_with_integer_labels(x, y)
    return jnp.sum(per_row * mask) / jnp.sum(mask)


def _tokens(x, y, mask):
    return jnp.sum(mask)


def _mask(cfg: dict, padded: int) -> jax.Array:
    """Micro-batch i holds rows i::k; the last ``padded`` are all padding."""
    m = np.ones((cfg["micro"], cfg["k"]), np.float32)
    m[:, cfg["k"] - padded :] = 0
    return jnp.asarray(m.reshape(-1))


def _face(name: str, k: int):
    kw = dict(batch_argnums=(1, 2, 3), weight_fn=_tokens)
    if name == "microbatch":
        return optax_accum.microbatch(jax.value_and_grad(_loss), k, **kw)
    return optax_accum.microbatch_value_and_grad(_loss, k, **kw)


def measure(quick: bool = False, rounds: int | None = None, config=None) -> dict:
    cfg = harness.cli.sizes(CONFIGS, quick, config, rounds=rounds)
    d, k = cfg["width"], cfg["k"]
    keys = jax.random.split(jax.random.key(0), cfg["layers"] + 1)
    params = [
        (jax.random.normal(kk, (d, d)) / np.sqrt(d), jnp.zeros(d)) for kk in keys[1:]
    ]
    rows = cfg["micro"] * k
    x = jax.random.normal(keys[0], (rows, d))
    y = jnp.zeros(rows, jnp.int32)
    out = {"config": cfg, "faces": {}}
    for face in ("microbatch", "microbatch_value_and_grad"):
        fun = jax.jit(_face(face, k)).lower(params, x, y, _mask(cfg, 0)).compile()
        variants = {n: partial(fun, params, x, y, _mask(cfg, n)) for n in PADDED}
        times = harness.interleaved(variants, cfg["rounds"])
        ratios = harness.ratios(times, 0)
        out["faces"][face] = [
            {
                "padded": n,
                "median_ms": 1e3 * harness.median(times[n]),
                "ratio": ratios[n]._asdict(),
                "ideal": (k - n) / k,
            }
            for n in PADDED
        ]
    return out


def markdown(data: dict) -> str:
    cfg = data["config"]
    env = harness.device_info()
    lines = [
        "# Padding micro-batches in the fused loop",
        "",
        f"k = {cfg['k']} micro-batches of {cfg['micro']} rows, a "
        f"{cfg['layers']}-layer ReLU MLP of width {cfg['width']}, token-weighted "
        f"(`weight_fn` counts the mask), on {env['device']} ({env['backend']}); "
        f"{cfg['rounds']} interleaved rounds, time ratios against no padding "
        "(median, 25th-75th percentiles). A micro-batch of weight 0 is skipped "
        "under `lax.cond`; the ideal ratio is the share of real micro-batches. "
        f"Made by `{harness.report.command_line()}`.",
        "",
    ]
    for face, rows in data["faces"].items():
        lines += [f"## `{face}`", ""]
        lines += harness.table(
            ["padding micro-batches", "median ms", "vs no padding", "ideal"],
            [
                [
                    f"{r['padded']} of {cfg['k']}",
                    f"{r['median_ms']:.2f}",
                    f"{r['ratio']['median']:.2f}x "
                    f"({r['ratio']['q25']:.2f}-{r['ratio']['q75']:.2f})",
                    f"{r['ideal']:.2f}x",
                ]
                for r in rows
            ],
            "lrrr",
        )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(harness.script_main("padding", __doc__, measure, markdown))
