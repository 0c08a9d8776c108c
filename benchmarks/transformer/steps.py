# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The steps the transformer benchmark compares, one per mode.

``full`` (the whole batch, no accumulation), ``microbatch`` (the fused
step), ``scan`` (the same step written by hand with ``lax.scan``),
``accumulate`` and ``multisteps`` (``optax.MultiSteps``; k calls each). Every
step is ``step(params, opt_state, batch) -> (params, opt_state)``, AdamW.
``microbatch+offload`` and ``accumulate+offload`` keep AdamW's state in host
memory between updates (`optax_accum.offload`).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import optax_accum

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"f32": "float32", "bf16": "bfloat16"}
OFFLOAD = "+offload"


def _load_gpt():
    path = ROOT / "examples" / "gpt.py"
    module = sys.modules.get("gpt")
    if module is not None and getattr(module, "__file__", None) == str(path):
        return module
    spec = importlib.util.spec_from_file_location("gpt", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpt"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gpt = _load_gpt()


class Key(NamedTuple):
    """What a step is: its mode, remat, compute dtype, k and micro-batch."""

    mode: str
    remat: str
    dtype: str
    k: int
    micro: int

    @property
    def per_micro(self) -> bool:
        """Whether an update is k calls of one micro-batch each."""
        return self.mode.removesuffix(OFFLOAD) in ("accumulate", "multisteps")

    @property
    def donated(self) -> tuple[int, ...]:
        """The arguments the step donates: the params and the optimizer state,
        or, with the state in host memory, the params only (on one device JAX
        0.10 leaves the pairing of donated buffers to XLA, which can give a
        host buffer to a device output)."""
        return (0,) if self.mode.endswith(OFFLOAD) else (0, 1)

    @property
    def rows(self) -> int:
        """Sequences per call."""
        return self.micro if self.per_micro else self.k * self.micro


def tx() -> optax.GradientTransformation:
    return optax.adamw(3e-4, weight_decay=0.1)


def _inner(kind: str) -> optax.GradientTransformation:
    return optax_accum.offload(tx()) if kind.endswith(OFFLOAD) else tx()


def init_state(kind: str, params: Any) -> Any:
    """The optimizer state of a kind of step (``adamw``, ``accumulate``...)."""
    base, inner = kind.removesuffix(OFFLOAD), _inner(kind)
    if base == "accumulate":
        return optax_accum.accumulate(inner, 2).init(params)
    if base == "multisteps":
        return optax.MultiSteps(inner, 2).init(params)
    return inner.init(params)


def _hand_scan(vg: Callable, apply: Callable, k: int) -> Callable:
    def scan_step(p, s, b):
        split = jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, -1), b)

        def body(carry, i):
            acc, wsum = carry
            mb = jax.tree.map(lambda x: x[:, i], split)
            w = gpt.token_count(mb)
            g = vg(p, mb)[1]
            acc = jax.tree.map(lambda a, gi: a + w * gi, acc, g)
            return (acc, wsum + w), None

        zeros = jax.tree.map(jnp.zeros_like, p)
        (acc, wsum), _ = jax.lax.scan(
            body, (zeros, jnp.zeros([], jnp.float32)), jnp.arange(k)
        )
        return apply(p, s, jax.tree.map(lambda a: a / wsum, acc))

    return scan_step


def _k_call_step(loss: Callable, acc_tx: Any, weighted: bool) -> Callable:
    def step(p, s, b):
        g = jax.grad(loss)(p, b)
        extra = {"weight": gpt.token_count(b)} if weighted else {}
        u, s = acc_tx.update(g, s, p, **extra)
        return optax.apply_updates(p, u), s

    return step


def step_fn(key: Key, cfg: Any) -> tuple[Callable[..., Any], str]:
    """``(step(params, opt_state, batch) -> (params, opt_state), state kind)``."""
    loss = gpt.make_loss(cfg.replace(remat=key.remat, dtype=DTYPES[key.dtype]))
    vg = jax.value_and_grad(loss)
    offload = key.mode.endswith(OFFLOAD)
    adamw, k, suffix = _inner(key.mode), key.k, OFFLOAD if offload else ""

    def apply(params, opt_state, grads):
        updates, opt_state = adamw.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    if key.mode == "microbatch" + suffix:
        fused = optax_accum.microbatch(vg, k, weight_fn=gpt.token_count)
        step = lambda p, s, b: apply(p, s, fused(p, b)[1])
        return step, "adamw" + suffix
    if key.mode == "accumulate" + suffix:
        acc = optax_accum.accumulate(adamw, k)
        return _k_call_step(loss, acc, True), "accumulate" + suffix
    if key.mode == "full":
        return (lambda p, s, b: apply(p, s, vg(p, b)[1])), "adamw"
    if key.mode == "scan":
        return _hand_scan(vg, apply, k), "adamw"
    if key.mode == "multisteps":
        return _k_call_step(loss, optax.MultiSteps(adamw, k), False), "multisteps"
    raise ValueError(f"unknown mode {key.mode!r}")
