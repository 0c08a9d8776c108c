# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`microbatch`'s options, checked once where they are given.

`options` validates every keyword of `microbatch` (declared once, in
`_keywords.Keywords`; the Flax helpers pass theirs through) at construction
and returns a frozen `Options` that the loop trusts. The checks of ``fun``'s
output and arguments, which can only run at trace time, are here too.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .. import _checks, _dtypes, _reduction
from .. import _noise_scale as ns
from .._reduction import Mean, Sum
from ._keywords import WeightFn, given

PARAM_GATHER = ("per_microbatch", "once", None)
AUX_ORDER = ("microbatch", "batch")


@dataclasses.dataclass(frozen=True)
class Options:
    """`microbatch`'s checked options (`Keywords` declares each as given)."""

    k: int
    batch_idx: tuple[int, ...]
    rng_idx: tuple[int, ...]
    has_aux: bool
    reduction: Mean | Sum
    weight_fn: WeightFn | None
    accumulator_dtype: Any
    axis_name: tuple | None
    data_axes: tuple[str, ...] | None
    param_gather: str | None
    decay: float | None
    stateful: bool
    # The loss face (`microbatch_value_and_grad`): ``fun`` is the loss and the
    # library differentiates it w.r.t. these arguments; None: ``fun`` is a
    # value-and-grad function, used as given.
    argnums: int | tuple[int, ...] | None = None
    # Which ``aux`` leaves hold the micro-batch's rows (device-local mode,
    # and ``aux_order="batch"``).
    aux_rows: Any = None
    # Whether row-wise ``aux`` leaves come back in the batch's row order
    # (``aux_order="batch"``) rather than stacked per micro-batch.
    aux_in_batch_order: bool = False
    # Micro-batches per trip of the loop: an int >= 1 or a bool (`_loop.trips`).
    unroll: int | bool = 1
    # Whether the library differentiates ``fun`` (the loss face): fixed here,
    # so the loop reads a field rather than coming back for a rule.
    differentiates: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "differentiates", self.argnums is not None)


@dataclasses.dataclass(frozen=True)
class Context:
    """Where a loop runs: the global view (``axes`` None), or per device of
    ``axes`` inside ``shard_map`` (``local``: the device-local mode, whose
    PRNG keys are also folded with the device index)."""

    axes: tuple | None = None
    local: bool = False


def options(
    num_microbatches: int,
    *,
    stateful: bool = False,
    argnums: int | Sequence[int] | None = None,
    face: str = "microbatch",
    **kwargs: Any,
) -> Options:
    """The `Keywords` in ``kwargs``, checked in ``face``'s names; ``argnums``:
    the loss face's, None for a value-and-grad ``fun``."""
    k = _checks.positive_int(num_microbatches, "num_microbatches")
    kw = given(kwargs, face)
    batch_idx = _checks.argnums(kw.batch_argnums, "batch_argnums")
    rng_idx = _checks.argnums(kw.rng_argnums, "rng_argnums")
    if not batch_idx:
        raise ValueError("`batch_argnums` must name at least one argument.")
    if set(batch_idx) & set(rng_idx):
        raise ValueError(
            f"`batch_argnums` ({kw.batch_argnums!r}) and `rng_argnums` "
            f"({kw.rng_argnums!r}) must not overlap."
        )
    strategy = _reduction.get(kw.reduction)
    _checks.callable_or_none(kw.weight_fn, "weight_fn")
    axes = _data_axes(kw.data_axes)
    if kw.axis_name is not None and axes is not None:
        raise ValueError(
            "Pass either `axis_name` (inside shard_map/pmap) or `data_axes`, "
            f"not both: got axis_name={kw.axis_name!r}, data_axes={kw.data_axes!r}."
        )
    decay = ns.check_options(
        kw.noise_scale_decay,
        False,
        kw.reduction,
        "num_microbatches",
        single=k == 1 and kw.axis_name is None,
    )
    in_batch_order = _checks.one_of(kw.aux_order, "aux_order", AUX_ORDER) == "batch"
    _check_aux_rows(kw.aux_rows, kw.has_aux, axes, in_batch_order)
    return Options(
        k=k,
        batch_idx=batch_idx,
        rng_idx=rng_idx,
        has_aux=bool(kw.has_aux),
        reduction=strategy,
        weight_fn=kw.weight_fn,
        accumulator_dtype=_dtypes.canonical(kw.accumulator_dtype),
        axis_name=None if kw.axis_name is None else _axes_tuple(kw.axis_name),
        data_axes=axes,
        param_gather=_param_gather(kw.param_gather),
        decay=decay,
        stateful=stateful,
        argnums=_loss_argnums(argnums, batch_idx, rng_idx),
        aux_rows=kw.aux_rows,
        aux_in_batch_order=in_batch_order,
        unroll=_unroll(kw.unroll),
    )


def _loss_argnums(argnums: Any, batch_idx: tuple, rng_idx: tuple) -> Any:
    """The loss face's ``argnums`` (as `jax.value_and_grad` takes them: an int
    or a tuple, which shapes the gradients), disjoint from the batch and keys."""
    if argnums is None:
        return None
    idx = _checks.argnums(argnums, "argnums")
    if not idx:
        raise ValueError("`argnums` must name at least one argument.")
    clash = sorted(set(idx) & (set(batch_idx) | set(rng_idx)))
    if clash:
        raise ValueError(
            f"`argnums`={argnums!r} names argument(s) {clash}, which hold the "
            "batch or PRNG keys (`batch_argnums`, `rng_argnums`): the gradients "
            "accumulated over micro-batches are those of the parameters."
        )
    return argnums if isinstance(argnums, int) else idx


def _check_aux_rows(
    aux_rows: Any, has_aux: bool, data_axes: Any, in_batch_order: bool
) -> None:
    """``aux_rows`` declares the row-wise ``aux`` leaves that a device-local
    loop gathers over devices, or that ``aux_order="batch"`` reorders."""
    if aux_rows is None:
        return
    if not has_aux or (data_axes is None and not in_batch_order):
        order = "batch" if in_batch_order else "microbatch"
        raise ValueError(
            "`aux_rows` says which `aux` leaves the device-local loop gathers "
            'over devices or `aux_order="batch"` reorders; it needs '
            '`has_aux=True` and `data_axes` or `aux_order="batch"`, got '
            f"aux_rows={aux_rows!r}, has_aux={has_aux!r}, data_axes={data_axes!r}, "
            f"aux_order={order!r}."
        )
    for flag in jax.tree.leaves(aux_rows):
        if not isinstance(flag, bool):
            raise TypeError(
                "`aux_rows` must be a bool or a pytree prefix of `aux` with bool "
                f"leaves, got a leaf {flag!r}."
            )


def _unroll(value: Any) -> int | bool:
    """``unroll`` as `lax.scan` takes it: an int >= 1 or a bool."""
    if isinstance(value, bool):
        return value
    return _checks.positive_int(value, "unroll")


def _param_gather(value: Any) -> str | None:
    _checks.one_of(value, "param_gather", PARAM_GATHER)
    return value


def _axes_tuple(axis_name: Any) -> tuple:
    return (axis_name,) if not isinstance(axis_name, tuple | list) else tuple(axis_name)


def _data_axes(value: Any) -> tuple[str, ...] | None:
    return _checks.axis_names(value, "data_axes")


def check_callable(fun: Callable[..., Any]) -> None:
    if not callable(fun):
        raise TypeError(f"`fun` must be callable, got {fun!r}.")


def _describe(x: Any) -> str:
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of length {len(x)}"
    shape = getattr(x, "shape", None)
    if shape is not None:
        return f"an array of shape {tuple(shape)}"
    return f"a {type(x).__name__}"


def check_fun_output(out: Any, has_aux: bool) -> None:
    """Checks ``microbatch``'s ``fun`` returned ``(value, grads)`` as declared."""
    expected = "((value, aux), grads)" if has_aux else "(value, grads)"
    hint = ""
    if not (isinstance(out, tuple | list) and len(out) == 2):
        if getattr(out, "shape", None) == ():
            hint = (
                " It returned a scalar: pass a value-and-grad function, e.g. "
                "jax.value_and_grad(loss), not the loss."
            )
        else:
            hint = (
                " Gradients alone? Pass jax.value_and_grad(loss), not jax.grad(loss)."
            )
        raise TypeError(f"`fun` must return {expected}, got {_describe(out)}.{hint}")
    first = out[0]
    first_is_pair = isinstance(first, tuple | list) and len(first) == 2
    if has_aux and not first_is_pair:
        raise TypeError(
            f"`fun` must return ((value, aux), grads) with `has_aux=True`, but "
            f"its first output is {_describe(first)}, not a (value, aux) pair: "
            "pass has_aux=False, or use jax.value_and_grad(loss, has_aux=True)."
        )
    if not has_aux and first_is_pair:
        raise TypeError(
            "`fun` must return (value, grads) with `has_aux=False`, but its value "
            f"is {_describe(first)}: if `fun` returns ((value, aux), grads), pass "
            "has_aux=True."
        )


def check_no_nnx_modules(args: Any) -> None:
    """Flax nnx modules cannot cross `microbatch`'s scan as arguments."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return
    is_rngs = lambda x: isinstance(x, nnx.Rngs | nnx.RngStream)
    if any(is_rngs(x) for x in jax.tree.leaves(args, is_leaf=is_rngs)):
        raise TypeError(
            "`microbatch` got a flax.nnx Rngs as an argument; its counters are "
            "state, not a batch to slice. Pass a PRNG key (e.g. "
            "`rngs.dropout()`) and name it in `rng_argnums` (micro-batch i gets "
            "`fold_in(key, i)`), or use optax_accum.flax.nnx_train_step, which "
            "takes a call-time nnx.Rngs and threads its counters."
        )
    is_module = lambda x: isinstance(x, nnx.Module)
    if any(is_module(x) for x in jax.tree.leaves(args, is_leaf=is_module)):
        raise TypeError(
            "`microbatch` got a flax.nnx Module as an argument; nnx modules are "
            "mutable objects, not arrays, and cannot be sliced per micro-batch "
            "inside `lax.scan`. Use optax_accum.flax.nnx_train_step(loss_fn, k), "
            "which splits the model into arrays (and threads its state), or pass "
            "nnx.split(model)'s arrays to a function that merges them."
        )


def nnx_state_error(error: Exception) -> Exception | None:
    """A TypeError in `microbatch`'s name for Flax's ``TraceContextError``:
    ``fun`` changed an nnx Variable made outside the loop (BatchNorm running
    statistics in training mode, an Rngs counter), a change `microbatch`
    cannot carry out of its scan. None for any other error."""
    errors = sys.modules.get("flax.errors")
    trace_error = getattr(errors, "TraceContextError", None)
    if trace_error is None or not isinstance(error, trace_error):
        return None
    return TypeError(
        "`microbatch`'s `fun` changed a flax.nnx Variable made outside its loop "
        f"({error}): BatchNorm running statistics in training mode, or an "
        "Rngs counter of a model merged from `nnx.split` arrays. `microbatch` "
        "threads no model state through its micro-batches, and merging with "
        "`nnx.merge(..., copy=True)` would drop every change silently. Use "
        "optax_accum.flax.nnx_train_step(loss_fn, k), which threads BatchNorm "
        "statistics and Rngs counters as k small steps would; or let the "
        "optimizer accumulate (optax_accum.accumulate) with an ordinary step "
        "per micro-batch; or run such layers without state (BatchNorm with "
        "`use_running_average=True`, Dropout with a key in `rng_argnums`)."
    )
