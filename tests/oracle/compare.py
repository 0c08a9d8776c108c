# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Tolerances, and the comparison of a face's result with the model's.

Tolerance (relative, and absolute against the largest expected magnitude of
the array, so that cancellation to near 0 is judged on the array's scale):

    rtol = max(floor, 6 eps_out + eps_buffer (4 + 3 log2 k))

``eps_out`` is the gradients' dtype's unit roundoff (the micro-batch
gradient, the reduced gradient and the inner update each round once or twice
in it), ``eps_buffer`` the accumulator's (a running mean or a sum of k terms
gains about log2 k roundings, pairwise). Floors: float32 1e-5, float64
1e-12. So: bf16 with a float32 buffer 0.023; fp16 0.0029; a bf16 buffer at
k = 8 0.076 (at k = 1024 0.156: 20 bf16 ulps of 2**-7, which the running mean
meets and a plain bf16 sum, 49% off, does not); a float16 buffer at k = 8
0.0095. The noise statistics' EMAs are differences
of nearly equal squared norms: they get 100 times that (1e-3 in float32).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .cells import Cell
from .data import NP_DTYPES

EPS = {"f32": 2.0**-24, "bf16": 2.0**-8, "f16": 2.0**-11, "f64": 2.0**-53}
FLOOR = {"f32": 1e-5, "f64": 1e-12, "bf16": 0.0, "f16": 0.0}
BUFFER = {"promote": None, "none": "same", "f32": "f32"}


def buffer_eps(cell: Cell) -> float:
    if cell.acc == "none":
        return EPS[cell.dtype]
    if cell.acc == "f32":
        return EPS["f32"]
    return min(EPS[cell.dtype], EPS["f32"])  # promote: at least float32


def rtol(cell: Cell) -> float:
    k_terms = 4 + 3 * np.log2(max(cell.k, 1) + 1)
    tol = 6 * EPS[cell.dtype] + buffer_eps(cell) * k_terms
    return max(FLOOR[cell.dtype], float(tol))


def close(got: Any, want: Any, tol: float, what: str, scale: float = 0.0) -> None:
    """NaN where the model has NaN, infinities of the same sign, the rest
    within ``tol`` (relative, and absolute on the array's scale, or on
    ``scale`` if larger: the size of the terms that a sum cancelled)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, model {want.shape}"
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    assert (nan_g == nan_w).all(), (
        f"{what}: NaN where the model has none, or none where it has: "
        f"got {got}, model {want}"
    )
    inf_w = np.isinf(want)
    assert (got[inf_w] == want[inf_w]).all() and not np.isinf(got[~inf_w]).any(), (
        f"{what}: infinities differ: got {got}, model {want}"
    )
    fin = np.isfinite(want)
    if not fin.any():
        return
    scale = max(float(np.max(np.abs(want[fin]))), scale) or 1.0
    err = np.abs(got[fin] - want[fin])
    bound = tol * (scale + np.abs(want[fin]))
    worst = float(np.max(err / np.maximum(bound, 1e-300)))
    assert (err <= bound).all(), (
        f"{what}: {worst:.3g} x tolerance {tol:.3g}: got {got}, model {want}"
    )


def _rounded(cell: Cell, want: dict) -> dict:
    """The model's results in the gradients' dtype, where the face returns
    them: a sum that overflows it is the sum asked for."""
    dtype = NP_DTYPES[cell.dtype]
    cast = lambda x: np.asarray(x, np.float64).astype(dtype).astype(np.float64)
    if cell.stream:
        return {**want, "updates": cast(want["updates"])}
    steps = [
        {k: cast(v) if k in ("value", "grad", "params") else v for k, v in s.items()}
        for s in want["steps"]
    ]
    return {**want, "steps": steps}


def check(cell: Cell, got: dict, want: dict) -> None:
    tol = rtol(cell)
    with np.errstate(over="ignore"):
        want = _rounded(cell, want)
    if cell.stream:
        assert list(got["updated"]) == list(want["updated"]), (
            f"has_updated: got {got['updated'].astype(int)}, "
            f"model {want['updated'].astype(int)}"
        )
        close(got["updates"], want["updates"], tol, "updates")
        if want["num_skipped"] is not None:
            assert got["num_skipped"] == want["num_skipped"], (
                f"num_skipped: got {got['num_skipped']}, model {want['num_skipped']}"
            )
    else:
        for t, (g, w) in enumerate(zip(got["steps"], want["steps"], strict=True)):
            scale = np.nan_to_num(w["value_scale"])
            close(g["value"], w["value"], tol, f"call {t}: value", scale)
            for key in ("grad", "params"):
                if key in w:
                    close(g[key], w[key], tol, f"call {t}: {key}")
            if "aux" in w:
                ok = w["aux"]["defined"]
                for leaf in ("feat", "rows"):
                    close(
                        g["aux"][leaf][ok],
                        w["aux"][leaf][ok],
                        tol,
                        f"call {t}: aux {leaf}",
                    )
    if "noise" in want:
        _noise(got["noise"], want["noise"], tol)


def _noise(got: dict, want: dict, tol: float) -> None:
    for field, value in want.items():
        exact = field in ("windows", "b_small", "b_big")
        # The noise state is float32 whatever the gradients' dtype.
        t = max(tol, 1e-6) if exact else max(100 * tol, 1e-3)
        close(got[field], value, t, f"noise {field}")
