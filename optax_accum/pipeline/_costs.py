# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`measure_costs`: a stage's (f, b, w), read from the compiled program.

The cost model of `bubble_fraction` needs the times of a forward (F), an
input gradient (B) and a weight gradient (W). Here they are the ops as the
runners compute them (`_loop`): F runs the stage once; B and W each call
the stage's ``jax.vjp`` function, kept from F with its residuals, for one
half of the cotangent (XLA drops the unused half). Each is compiled on its
own, and its cost is XLA's ``cost_analysis()`` FLOPs, or with ``timed`` the
median of a few timed calls; both are reported relative to F.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks


class Costs(NamedTuple):
    """A stage's op costs relative to its forward: ``(f, b, w)``, ``f`` = 1.

    ``b`` is the input gradient (B), ``w`` the weight gradient (W); a whole
    backward is ``b + w``. Pass it as ``bubble_fraction(..., costs=...)``.
    """

    f: float
    b: float
    w: float


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    return int(value)


def _flops(compiled: Any) -> float:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else {}
    return float((analysis or {}).get("flops", 0.0))


def _median_seconds(fns: list[Callable[[], Any]], rounds: int) -> list[float]:
    """Each of ``fns`` timed once per round, in turn (after one warm-up)."""
    for fn in fns:
        jax.block_until_ready(fn())
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _checked(params: Any, batch: Any, num_microbatches: Any, stage_layout: Any) -> int:
    """M, once ``params``, ``batch`` and ``stage_layout`` are what
    `measure_costs` takes (a ValueError naming the argument if not)."""
    if not isinstance(params, (tuple, list)) or len(params) != 3:
        raise ValueError(
            "`params` must be (first_params, stage_params, last_params), got "
            f"{type(params).__name__} of length "
            f"{len(params) if isinstance(params, (tuple, list)) else 'n/a'}."
        )
    m = _check_int("num_microbatches", num_microbatches)
    rows = {int(jnp.shape(v)[0]) for v in jax.tree.leaves(batch)}
    if len(rows) != 1 or next(iter(rows)) % m:
        raise ValueError(
            f"`num_microbatches`={m} must divide the rows of every `batch` "
            f"leaf; got rows {sorted(rows)}."
        )
    _checks.stage_layout(stage_layout)
    return m


def _composed(first_fn, stage, loss, params: tuple, sp0: Any, mb: Any) -> Any:
    """The type of ``h``, once the stage keeps it and the loss of the
    stage's output is a scalar (a ValueError if not)."""
    fp, _, lp = params
    h = jax.eval_shape(first_fn, fp, mb)
    y = jax.eval_shape(stage, sp0, h)
    if (y.shape, y.dtype) != (h.shape, h.dtype):
        raise ValueError(
            "`stage_fn` must keep h's shape and dtype: got "
            f"{y.shape} {y.dtype} from {h.shape} {h.dtype}."
        )
    out = jax.eval_shape(loss, lp, y)
    out = out[0] if isinstance(out, tuple) else out
    if getattr(out, "shape", None) != ():
        raise ValueError(
            f"`loss_fn` must return a scalar loss, got {getattr(out, 'shape', out)}."
        )
    return h


def measure_costs(
    first_fn: Callable,
    stage_fn: Callable,
    loss_fn: Callable,
    params: tuple,
    batch: Any,
    num_microbatches: int = 1,
    *,
    timed: bool = False,
    rounds: int = 5,
    rng: jax.Array | None = None,
    stage_layout: str = "stacked",
) -> Costs:
    """The costs ``(f, b, w)`` of one stage's ops, as this pipeline runs them.

    Takes `value_and_grad`'s model and inputs. On micro-batch 0 (rows ``0,
    M, 2M, ...`` of ``batch``) it embeds with ``first_fn`` and compiles, for
    stage 0's parameters: F, the stage forward; B, the input cotangent from
    the stage's ``jax.vjp`` residuals; W, the weight gradient from the same
    residuals (ZB-H1's split; GPipe's and 1F1B's whole backward also
    recomputes the forward, so it costs ``f + b + w``). ``loss_fn`` checks
    that the model composes (a scalar loss of the stage's output).

    Args:
      first_fn: ``first_fn(first_params, microbatch) -> h``.
      stage_fn: ``stage_fn(stage_params, h) -> h`` (with ``rng``,
        ``stage_fn(stage_params, h, key)``).
      loss_fn: ``loss_fn(last_params, h, microbatch) -> loss`` (with
        ``rng``, a fourth argument ``key``); ``(loss, aux)`` is accepted.
      params: ``(first_params, stage_params, last_params)``, the stage
        leaves stacked over stages as for `value_and_grad`.
      batch: the whole batch (a pytree of arrays with a leading row axis).
      num_microbatches: M, for the size of one micro-batch.
      timed: also time each op: the costs are then the median seconds of
        ``rounds`` interleaved calls, relative to F's (on a loaded machine
        they are noisy; the FLOPs are not).
      rounds: the timed calls of each op.
      rng: a key, when ``stage_fn`` and ``loss_fn`` take one.
      stage_layout: ``"stacked"`` or ``"repeats_by_stage"``, as for
        `value_and_grad`.

    Returns:
      `Costs` ``(f, b, w)`` with ``f`` = 1.

    Raises:
      ValueError: ``params`` is not a 3-tuple, an unknown ``stage_layout``,
        ``num_microbatches`` or
        ``rounds`` is not a positive int, M does not divide the rows, the
        stage changes ``h``'s shape or dtype, the loss is not a scalar, or
        the compiled forward reports no FLOPs (a backend without a cost
        analysis: pass ``timed=True``).

    Examples:
      >>> import jax.numpy as jnp
      >>> from optax_accum import pipeline
      >>> first = lambda fp, b: b["x"] @ fp
      >>> stage = lambda sp, h: h @ sp
      >>> loss = lambda lp, h, b: jnp.mean(h @ lp)
      >>> params = (jnp.ones((4, 64)), jnp.ones((2, 64, 64)), jnp.ones((64,)))
      >>> costs = pipeline.measure_costs(
      ...     first, stage, loss, params, {"x": jnp.ones((32, 4))}, 2)
      >>> [round(c, 2) for c in costs]  # a matmul: B and W each cost F
      [1.0, 1.0, 1.0]
    """
    m = _checked(params, batch, num_microbatches, stage_layout)
    rounds = _check_int("rounds", rounds)
    fp, sp, _ = params
    first = (0, 0) if stage_layout == "repeats_by_stage" else (0,)
    sp0 = jax.tree.map(lambda v: v[first], sp)
    mb = jax.tree.map(lambda v: v[0::m], batch)
    keys = () if rng is None else (rng,)

    def stage(sp, x):
        return stage_fn(sp, x, *keys)

    def loss(lp, y):
        return loss_fn(lp, y, mb, *keys)

    h = _composed(first_fn, stage, loss, params, sp0, mb)
    x = jax.jit(first_fn)(fp, mb)
    _, vjp = jax.vjp(stage, sp0, x)
    ct = jnp.ones(h.shape, h.dtype)
    ops = (
        (jax.jit(stage), (sp0, x)),
        (jax.jit(lambda vjp, ct: vjp(ct)[1]), (vjp, ct)),  # B: the input's
        (jax.jit(lambda vjp, ct: vjp(ct)[0]), (vjp, ct)),  # W: the weights'
    )
    compiled = [fn.lower(*args).compile() for fn, args in ops]
    if timed:
        calls = [
            (lambda c=c, a=args: c(*a))
            for c, (_, args) in zip(compiled, ops, strict=True)
        ]
        f, b, w = _median_seconds(calls, rounds)
    else:
        f, b, w = (_flops(c) for c in compiled)
        if f <= 0:
            raise ValueError(
                "the compiled `stage_fn` reports no FLOPs on this backend; "
                "pass `timed=True` to time the ops instead."
            )
    return Costs(1.0, b / f, w / f)
