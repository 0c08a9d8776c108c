# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Why "rtol 1e-5 for Adam" fails on a parameter whose true gradient is zero.

An attention key bias ``bk`` adds ``q . bk`` to every logit of a query, which
softmax ignores: its exact gradient is zero, and what autodiff returns is
float32 rounding noise (~1e-9). Adam divides the noise by the square root of
its own square, plus ``eps``; with ``eps = 1e-8`` that is an O(0.1 lr) step in
a direction the rounding decides. Any change in summation order (k
micro-batches instead of one large batch) redraws the noise, so ``bk`` differs
between the accumulated and the large-batch step by about ``0.1 lr``, for
`accumulate`, ``optax.MultiSteps`` and a hand-written loop alike, while every
other parameter agrees to ~1e-7. A larger ``eps`` (1e-6) shrinks the gap.

Run: ``python benchmarks/adam_zero_gradient.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import optax_accum

K, B, T, D, LR, STEPS = 4, 32, 8, 16, 1e-3, 5


def _params():
    keys = jax.random.split(jax.random.key(0), 4)
    return {
        "wq": jax.random.normal(keys[0], (D, D)) / D**0.5,
        "wk": jax.random.normal(keys[1], (D, D)) / D**0.5,
        "bk": jnp.zeros(D),
        "wo": jax.random.normal(keys[2], (D, 1)) / D**0.5,
    }


def _loss(p, x, y):
    q, k = x @ p["wq"], x @ p["wk"] + p["bk"]
    att = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / D**0.5, axis=-1)
    out = jnp.einsum("bts,bsd->btd", att, x) @ p["wo"]
    return jnp.mean((out[..., 0] - y) ** 2)


def _run(tx, micro: bool, x, y):
    params, state = _params(), tx.init(_params())
    grad = jax.jit(jax.grad(_loss))
    update = jax.jit(tx.update)
    for _ in range(STEPS):
        parts = [(x[i::K], y[i::K]) for i in range(K)] if micro else [(x, y)]
        for xb, yb in parts:
            u, state = update(grad(params, xb, yb), state, params)
        params = optax.apply_updates(params, u)
    return params


def _hand_loop(adam, x, y):
    params, state = _params(), adam.init(_params())
    grad = jax.jit(jax.grad(_loss))
    for _ in range(STEPS):
        gs = [grad(params, x[i::K], y[i::K]) for i in range(K)]
        g = jax.tree.map(lambda *a: sum(a) / K, *gs)
        u, state = adam.update(g, state, params)
        params = optax.apply_updates(params, u)
    return params


def main() -> None:
    kx, ky = jax.random.split(jax.random.key(1))
    x, y = jax.random.normal(kx, (B, T, D)), jax.random.normal(ky, (B, T))
    g = jax.grad(_loss)(_params(), x, y)
    print(
        f"|grad bk| max {float(jnp.max(jnp.abs(g['bk']))):.1e} (exact: 0), "
        f"|grad wq| max {float(jnp.max(jnp.abs(g['wq']))):.1e}"
    )
    for eps in (1e-8, 1e-6):
        adam = optax.adam(LR, eps=eps)
        large = _run(adam, False, x, y)
        rows = {
            "accumulate": _run(optax_accum.accumulate(adam, K), True, x, y),
            "optax.MultiSteps": _run(optax.MultiSteps(adam, K), True, x, y),
            "hand-written loop": _hand_loop(adam, x, y),
        }
        for name, p in rows.items():
            diff = {n: float(jnp.max(jnp.abs(p[n] - large[n]))) for n in p}
            rel = max(
                float(jnp.max(jnp.abs(p[n] - large[n]) / (jnp.abs(large[n]) + 1e-30)))
                for n in ("wq", "wk", "wo")
            )
            print(
                f"eps={eps:.0e} {name:18s} max|diff| bk {diff['bk']:.1e}, "
                f"wq/wk/wo rel {rel:.1e}"
            )


if __name__ == "__main__":
    main()
