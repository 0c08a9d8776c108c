# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The micro-batches of `microbatch`, and one call of ``fun`` on one of them.

The batch size, the copy-free micro-batch views, one micro-batch's arguments
(its rows, its PRNG keys), one call of a value-and-grad ``fun`` taken apart,
the loss face's own differentiation (the one place a weight may enter the
backward pass) and its forward pass alone (what a skipped weight-0
micro-batch still computes), and all k weights in one pass. The loop
that drives them is `_loop`'s.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .. import _checks, _compiler, _dtypes, _sharding, _weights
from .._loss_scale import ScaledGrads
from ._options import Context, Options, check_fun_output


class Call(NamedTuple):
    """One call of ``fun`` on one micro-batch."""

    value: Any
    grads: Any
    aux: Any
    state: Any
    scaled: ScaledGrads | None  # fun returned ScaledGrads (fp16 loss scaling)


def batch_size(args: list, opts: Options) -> int:
    """The batch size of the ``batch_argnums`` arguments, checked."""
    n = len(args)
    for i in (*opts.batch_idx, *opts.rng_idx):
        if i >= n:
            raise ValueError(
                f"argument index {i} (from `batch_argnums` or `rng_argnums`) "
                f"is out of range for {n} positional arguments."
            )
    sizes = {}
    for i in opts.batch_idx:
        for path, x in jax.tree_util.tree_leaves_with_path(args[i]):
            if jnp.ndim(x) == 0:
                raise ValueError(
                    f"batch argument {i} has a scalar leaf at "
                    f"{jax.tree_util.keystr(path)}: every batch leaf needs "
                    "a leading batch axis." + _parameters_hint(i, opts)
                )
            sizes[f"argument {i}{jax.tree_util.keystr(path)}"] = jnp.shape(x)[0]
    if not sizes:
        raise ValueError(f"the batch arguments {opts.batch_idx} have no array leaves.")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"batch leaves must share their leading size, got {sizes}.")
    size = next(iter(sizes.values()))
    if size % opts.k:
        raise ValueError(
            f"the batch size {size} is not divisible by `num_microbatches`={opts.k}."
        )
    return size


def _parameters_hint(i: int, opts: Options) -> str:
    """Names the likely mistake when batch argument ``i`` is the parameters."""
    if opts.differentiates:
        wrt = (opts.argnums,) if isinstance(opts.argnums, int) else opts.argnums
        if i not in wrt:
            return ""
    elif i != 0:
        return ""
    return (
        f" Argument {i} is the one differentiated (the parameters), so "
        "`batch_argnums` probably includes it by mistake: it must name the "
        "data arguments only, e.g. `batch_argnums=(1, 2)` for "
        "`loss(params, x, y)`."
    )


def note_unsplit(error: BaseException, args: list, opts: Options) -> None:
    """Adds a note to ``fun``'s error where an argument that is not split has
    the batch's leading size: most often a batch passed as two arguments,
    ``loss(params, x, y)``, with the default ``batch_argnums=1``."""
    try:
        size = batch_size(args, opts)
    except Exception:
        return
    split = (*opts.batch_idx, *opts.rng_idx)
    suspects = [
        (i, f"argument {i}{jax.tree_util.keystr(path)}, of shape {jnp.shape(x)},")
        for i, a in enumerate(args)
        if i not in split
        for path, x in jax.tree_util.tree_leaves_with_path(a)
        if getattr(x, "ndim", 0) > 0 and x.shape[0] == size
    ]
    if suspects:
        i, leaf = suspects[0]
        fix = tuple(sorted({*opts.batch_idx, i}))
        error.add_note(
            f"optax_accum: only the `batch_argnums`={opts.batch_idx} arguments "
            f"are split into {opts.k} micro-batches, but {leaf} also has the "
            f"batch's leading size {size} and reaches each micro-batch whole. "
            "If it is part of the batch (e.g. the labels of "
            f"`loss(params, x, y)`), pass `batch_argnums={fix}`."
        )


def views(args: list, opts: Options) -> dict[int, Any]:
    """Each batch argument as ``(B/k, k, ...)``: micro-batch ``i`` is column
    ``i`` (rows ``i, i+k, ...``), a free reshape that keeps the rows' sharding."""
    k = opts.k

    def view(x):
        x = _sharding.splittable(x, k)
        return x.reshape(x.shape[0] // k, k, *x.shape[1:])

    return {i: jax.tree.map(view, args[i]) for i in opts.batch_idx}


def pinned(args: list, opts: Options) -> bool:
    """Whether the arguments that are not the batch pass the optimization
    barrier of `microbatch_args`, keeping FSDP gathers per micro-batch (see
    `_compiler`): as ``param_gather`` says, else where the layout gathers some
    parameter over the batch's axes."""
    if opts.param_gather is not None:
        return opts.param_gather == "per_microbatch"
    batch = [args[i] for i in opts.batch_idx]
    others = [a for i, a in enumerate(args) if i not in opts.batch_idx]
    return _sharding.gathers_params(batch, others)


def gathered(args: list, opts: Options) -> list:
    """``args`` with, for ``param_gather="once"``, the arguments that are not
    the batch gathered over the batch's mesh axes before the loop
    (`_compiler.gather_once`): ``fun`` then gets the whole parameters, and
    XLA:GPU, which keeps a loop-invariant gather in the loop, gathers once."""
    if opts.param_gather != "once":
        return args
    axes = _sharding.row_axes([args[i] for i in opts.batch_idx])
    fixed = [j for j in range(len(args)) if j not in opts.batch_idx]
    if not axes or not fixed:
        return args
    margs = list(args)
    held = _compiler.gather_once([args[j] for j in fixed], sorted(axes))
    for j, x in zip(fixed, held, strict=True):
        margs[j] = x
    return margs


def microbatch_args(
    args: list, batch_views: dict, i: Any, opts: Options, ctx: Context, pin: bool
) -> list:
    """The positional arguments of micro-batch ``i``."""
    margs = list(args)
    if pin:
        fixed = [j for j in range(len(args)) if j not in opts.batch_idx]
        held = _compiler.pin_to_iteration([args[j] for j in fixed], i)
        for j, x in zip(fixed, held, strict=True):
            margs[j] = x
    for j in opts.batch_idx:
        margs[j] = jax.tree.map(
            lambda v: lax.dynamic_index_in_dim(v, i, 1, keepdims=False),
            batch_views[j],
        )
    device = lax.axis_index(ctx.axes) if ctx.local else None
    for j in opts.rng_idx:

        def fold(key):
            key = jax.random.fold_in(key, i)
            return key if device is None else jax.random.fold_in(key, device)

        margs[j] = jax.tree.map(fold, args[j])
    return margs


def call(fun: Any, args: list, kwargs: dict, state: Any, opts: Options) -> Call:
    """One call of ``fun``, its output checked and taken apart."""
    if opts.stateful:
        out, state = fun(*args, state=state, **kwargs)
    else:
        out = fun(*args, **kwargs)
    if isinstance(out, ScaledGrads):
        value, aux = out.value if opts.has_aux else (out.value, None)
        return Call(value, out.grads, aux, state, out)
    check_fun_output(out, opts.has_aux)
    (value, aux), grads = out if opts.has_aux else ((out[0], None), out[1])
    return Call(value, grads, aux, state, None)


def differentiate(loss, args: list, kwargs, state, opts: Options, seed=None) -> Call:
    """The loss face: ``loss`` differentiated here w.r.t. ``opts.argnums``.

    With ``seed`` (a micro-batch's weight multiplier) the backward pass
    starts from ``seed`` instead of 1, so the gradients come out weighted and
    the loop adds them with a plain add, before the compiler's reduction over
    the data axes. The library may do that because it owns this derivative.
    """
    idx = (opts.argnums,) if isinstance(opts.argnums, int) else opts.argnums
    _check_differentiable(args, idx)

    def value_of(*primals):
        full = list(args)
        for j, x in zip(idx, primals, strict=True):
            full[j] = x
        if opts.stateful:
            out, new_state = loss(*full, state=state, **kwargs)
        else:
            out, new_state = loss(*full, **kwargs), state
        value, aux = _value_and_aux(out, opts.has_aux)
        return value, (value, aux, new_state)

    _, vjp, (value, aux, new_state) = jax.vjp(
        value_of, *(args[j] for j in idx), has_aux=True
    )
    ct = jnp.ones_like(value) if seed is None else seed.astype(value.dtype)
    grads = vjp(ct)
    grads = grads[0] if isinstance(opts.argnums, int) else tuple(grads)
    return Call(value, grads, aux, new_state, None)


def forward(loss, args: list, kwargs, state, opts: Options) -> tuple:
    """The loss face's forward pass alone: ``(aux, new_state)``, what a
    skipped (weight-0) micro-batch still gives; no backward pass runs."""
    if opts.stateful:
        out, new_state = loss(*args, state=state, **kwargs)
    else:
        out, new_state = loss(*args, **kwargs), state
    return _value_and_aux(out, opts.has_aux)[1], new_state


def run(fun, args: list, kwargs, state, opts: Options, seed=None) -> Call:
    """One micro-batch through ``fun``: the loss face differentiates (with
    ``seed`` inside the backward pass); a value-and-grad ``fun`` is called."""
    if opts.differentiates:
        return differentiate(fun, args, kwargs, state, opts, seed)
    return call(fun, args, kwargs, state, opts)


def _value_and_aux(out: Any, has_aux: bool) -> tuple:
    """The loss's ``value`` (a real scalar, as `jax.grad` requires) and aux."""
    if has_aux:
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise TypeError(
                "with `has_aux=True` the loss must return (value, aux), got "
                f"{type(out).__name__}."
            )
        value, aux = out
    else:
        value, aux = out, None
    _checks.real_scalar_loss(value)
    return value, aux


def _check_differentiable(args: list, idx: tuple) -> None:
    """As `jax.grad`: the differentiated arguments hold floating leaves."""
    for j in idx:
        if j >= len(args):
            raise ValueError(
                f"`argnums` index {j} is out of range for {len(args)} positional "
                "arguments."
            )
        for path, x in jax.tree_util.tree_leaves_with_path(args[j]):
            if not hasattr(x, "dtype") and not isinstance(x, int | float | complex):
                raise TypeError(
                    f"argument {j}{jax.tree_util.keystr(path)} is a "
                    f"{type(x).__name__}, not an array: the loss face "
                    "differentiates w.r.t. `argnums`, whose leaves must be "
                    "arrays, as jax.grad requires. For an Equinox model, pass "
                    "`eqx.partition(model, eqx.is_array)`'s arrays, or use "
                    "`microbatch(eqx.filter_value_and_grad(loss), ...)`."
                )
            if not _dtypes.is_differentiable(jnp.result_type(x)):
                raise TypeError(
                    f"argument {j}{jax.tree_util.keystr(path)} has dtype "
                    f"{jnp.result_type(x)}: the loss face differentiates w.r.t. "
                    "`argnums`, whose leaves must be floating (or complex), as "
                    "jax.grad requires. Move integer leaves to another argument."
                )


def weights(batch_views: dict, opts: Options, dtype: Any) -> jax.Array:
    """All k micro-batches' weights in one vectorised pass, admitted: a NaN,
    infinite or negative weight weighs 0 (`_weights`' contract)."""

    def weight_of(*columns):
        return _weights.from_fn(opts.weight_fn(*columns), dtype)

    columns = [batch_views[i] for i in opts.batch_idx]
    return _weights.admitted(jax.vmap(weight_of, in_axes=1)(*columns))
