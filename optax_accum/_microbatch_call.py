# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The micro-batches of `microbatch`, and one call of ``fun`` on one of them.

The batch size, the copy-free micro-batch views, one micro-batch's arguments
(its rows, its PRNG keys), one call of ``fun`` taken apart, the same call with
the weight inside the backward pass, and all k weights in one pass. The loop
that drives them is `_microbatch_loop`'s.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import _compiler, _dtypes, _sharding, _weights
from ._loss_scale import ScaledGrads
from ._microbatch_options import Context, Options, check_fun_output


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
                    "a leading batch axis."
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


def views(args: list, opts: Options) -> dict[int, Any]:
    """Each batch argument as ``(B/k, k, ...)``: micro-batch ``i`` is column
    ``i`` (rows ``i, i+k, ...``), a free reshape that keeps the rows' sharding."""
    k = opts.k

    def view(x):
        x = _sharding.splittable(x, k)
        return x.reshape(x.shape[0] // k, k, *x.shape[1:])

    return {i: jax.tree.map(view, args[i]) for i in opts.batch_idx}


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


def call_scaled(fun, args: list, kwargs, state, opts: Options, seed) -> Call:
    """``fun``'s value differentiated with the cotangent ``seed``.

    The gradient of ``seed * value`` w.r.t. the first argument is computed
    here, so the scale sits inside the backward pass, before the compiler's
    reduction of the gradient over the data axes; ``fun``'s own gradients are
    dead code that XLA removes. Used where `backward_scalable` holds.
    """

    def value_of(first):
        out = call(fun, [first, *args[1:]], kwargs, state, opts)
        return out.value, (out.value, out.aux, out.state)

    _, vjp, (value, aux, new_state) = jax.vjp(value_of, args[0], has_aux=True)
    (grads,) = vjp(seed.astype(value.dtype))
    return Call(value, grads, aux, new_state, None)


def backward_scalable(args: list, shapes: Call, opts: Options, ctx: Context) -> bool:
    """Whether the weights can go inside the backward pass: the global view,
    ``fun`` a value-and-grad function of its first argument (gradients shaped
    like it, as ``jax.value_and_grad(loss)``'s are) and a float32 or float64
    value, at least as precise as the weights."""
    if opts.weight_fn is None or ctx.axes is not None or shapes.scaled is not None:
        return False
    if 0 in opts.batch_idx or 0 in opts.rng_idx:
        return False
    value_dtype = jnp.dtype(shapes.value.dtype)
    # The seed is cast to the value's dtype: it must hold the weights' precision.
    if value_dtype not in (
        jnp.float32,
        jnp.float64,
    ) or value_dtype != jnp.promote_types(
        value_dtype, _dtypes.weight_dtype(shapes.grads)
    ):
        return False
    first, grads = args[0], shapes.grads
    if jax.tree.structure(first) != jax.tree.structure(grads):
        return False
    return all(
        jnp.shape(p) == g.shape
        and jnp.result_type(p) == g.dtype
        and _dtypes.is_differentiable(g.dtype)
        for p, g in zip(jax.tree.leaves(first), jax.tree.leaves(grads), strict=True)
    )


def weights(batch_views: dict, opts: Options, dtype: Any) -> jax.Array:
    """All k micro-batches' weights in one vectorised pass, admitted: a NaN,
    infinite or negative weight weighs 0 (`_weights`' contract)."""

    def weight_of(*columns):
        w = opts.weight_fn(*columns)
        if jnp.ndim(w) != 0:
            raise ValueError(
                f"`weight_fn` must return a scalar, got shape {jnp.shape(w)}."
            )
        return jnp.asarray(w, dtype)

    columns = [batch_views[i] for i in opts.batch_idx]
    return _weights.admitted(jax.vmap(weight_of, in_axes=1)(*columns))
