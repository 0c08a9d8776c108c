# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""A cell's inputs: rows whose per-micro-batch gradient the cell controls.

The loss of a micro-batch (rows ``c``, per-row weights ``m``, parameters
``w``) is the token mean ``sum_r m_r (c_r . w) / sum_r m_r`` (plus ``u . w``
for a key's uniform draw ``u`` with the ``rng`` option), so its gradient is
``sum_r m_r c_r / sum_r m_r (+ u)``, exactly, whatever ``w`` is. With
weights, a micro-batch weighs ``sum_r m_r`` (the token count). Values are
multiples of 1/8 and token counts eighths (exact in every dtype); one
micro-batch, the *bad* one, carries the pattern of the cell's ``weights``
(0, NaN or -1 on all its rows, or with ``bad_device`` on device 0's rows
only) and, with ``nan_grad``, NaN rows. In a stream it is the first call of
the second window, or with ``close`` the last call, which closes the window.

Rows of a call (`accumulate`) or of a batch (`microbatch`) are laid out as
the devices hold them: row ``r`` is on device ``r // (rows / devices)``, and
micro-batch ``i`` of a batch holds the rows ``r % k == i``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .cells import ROWS, Cell
from .model import Unit, admitted

NP_DTYPES = {
    "f32": np.float32,
    "bf16": ml_dtypes.bfloat16,
    "f16": np.float16,
    "f64": np.float64,
}
STEPS = 2  # calls of a fused face
CLIP = 0.6  # the `clip` option's value-and-grad fun clips its gradients here
MAX_NORM = 1.5  # skip_large_updates(MAX_NORM)


@dataclasses.dataclass
class Inputs:
    """``c`` (calls, rows, D) and ``m`` (calls, rows), float64 (exact in the
    cell's dtype); ``close`` (calls,) for the per-call faces; ``w0`` (D,)."""

    c: np.ndarray
    m: np.ndarray
    close: np.ndarray
    w0: np.ndarray
    bad: tuple[int, np.ndarray]  # (call, row mask) of the bad micro-batch


def calls(cell: Cell) -> int:
    return 2 * cell.k + 1 if cell.stream else STEPS


def rows(cell: Cell) -> int:
    per = ROWS * cell.devices
    return per if cell.stream else per * cell.k


def build(cell: Cell) -> Inputs:
    rng = np.random.default_rng(cell.seed)
    n, r, d = calls(cell), rows(cell), cell.dim
    base = np.resize(np.array([1.0, -0.5, 0.75]), d)
    c = base + rng.integers(-6, 7, size=(n, r, d)) / 8
    # Token counts in eighths: a sum of them stays small enough for Adam's
    # squared gradient in float16 (optax runs it in the parameters' dtype).
    m = rng.integers(1, 4, size=(n, r)) / 8
    if cell.magnitude == "large":
        c, m = c * 4096.0, m * 256.0
    m = m * {"heavy": 2.0**100, "light": 2.0**-100}.get(cell.magnitude, 1.0)
    if cell.stream:  # the first call of the second window, or the closing one
        bad = (n - 1 if cell.option == "close" else cell.k, np.ones(r, bool))
    else:
        bad = (0, np.arange(r) % cell.k == cell.k - 1)
    if cell.bad_device:
        bad = (bad[0], bad[1] & (np.arange(r) < r // cell.devices))
    t, mask = bad
    pattern = {"zeros": 0.0, "nan": np.nan, "negative": -1.0}.get(cell.weights)
    if pattern is not None:
        m[t, mask] = pattern
    if cell.nan_grad:
        c[t, mask] = np.nan
    if not cell.weighted:
        m = np.ones_like(m)
    close = np.zeros(n, bool)
    if cell.option == "close":
        close[-1] = True
    w0 = np.resize(np.array([0.5, -0.25, 1.0]), d)
    return Inputs(c, m, close, w0, bad)


def uniform(key: jax.Array, dim: int, dtype: str) -> np.ndarray:
    """The ``rng`` option's draw, as the loss makes it."""
    u = jax.random.uniform(key, (dim,), jnp.float32)
    return np.asarray(u).astype(NP_DTYPES[dtype]).astype(np.float64)


def step_key(cell: Cell, s: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(cell.seed), s)


def unit_keys(cell: Cell, s: int) -> dict[tuple[int, int], jax.Array]:
    """Micro-batch ``i`` on device ``d`` draws with ``fold_in(key, i)``, and
    in the device-local mode ``fold_in(that, d)`` (the documented keys); the
    pipeline's loss folds its stage index ``S · repeats`` in last."""
    key = step_key(cell, s)
    out = {}
    for i in range(cell.k):
        ki = jax.random.fold_in(key, i)
        for d in range(cell.devices):
            out[i, d] = jax.random.fold_in(ki, d) if cell.mode == "data_axes" else ki
            if cell.pipeline:  # then the stage: the loss is stage S · repeats
                out[i, d] = jax.random.fold_in(out[i, d], cell.num_stages)
    return out


def per_device(cell: Cell) -> bool:
    """Whether each device's part of a micro-batch is its own unit."""
    if cell.stream:
        return cell.mapped
    return cell.mapped or cell.mode == "data_axes"


def _unit(cell, c, m, w, u, share) -> Unit:
    total = m.sum()
    grad = (m @ c) / total if total != 0 else np.full(c.shape[1], np.nan)
    value = (m @ (c @ w)) / total if total != 0 else np.nan
    if u is not None:
        grad, value = grad + u, value + u @ w
    if cell.option == "clip":
        grad = np.clip(grad, -CLIP, CLIP)
    weight = float(total) if cell.weighted else share
    noise = admitted(weight) if (cell.weighted or cell.stream) else float(len(m))
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = (np.abs(m) @ np.abs(c @ w)) / abs(total)
    if u is not None:
        scale = scale + np.abs(u) @ np.abs(w)
    return Unit(grad, weight, noise, float(value), float(np.nan_to_num(scale)))


def units(cell: Cell, inputs: Inputs, t: int, w: np.ndarray) -> list[Unit]:
    """The model's units of call ``t`` at parameters ``w``: one per device
    (where weights are per device) for each micro-batch of the call."""
    c, m = inputs.c[t], inputs.m[t]
    n_rows = len(m)
    dev = np.arange(n_rows) // (n_rows // cell.devices)
    mb = np.zeros(n_rows, int) if cell.stream else np.arange(n_rows) % cell.k
    local = per_device(cell)
    # Unweighted, the device-local mode equals the global view: each device's
    # part of a micro-batch weighs 1 / devices.
    share = 1.0 / cell.devices if cell.mode == "data_axes" else 1.0
    keys = unit_keys(cell, t) if cell.option == "rng" else None
    out = []
    for i in range(1 if cell.stream else cell.k):
        for d in range(cell.devices if local else 1):
            sel = (mb == i) & ((dev == d) if local else True)
            u = None if keys is None else uniform(keys[i, d], cell.dim, cell.dtype)
            out.append(_unit(cell, c[sel], m[sel], w, u, share if local else 1.0))
    return out


def examples(cell: Cell, inputs: Inputs, t: int, w: np.ndarray):
    """The privacy face's rows of call ``t``: each row's gradient (its ``c``:
    the token-mean loss of one row is ``c . w``), loss, and whether it is a
    real example (weight > 0; padding has weight 0)."""
    c, m = inputs.c[t], inputs.m[t]
    return c, c @ w, m > 0
