# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`microbatch`: k micro-batches of a value-and-grad function in one `lax.scan`.

This module owns the public `microbatch` and `microbatch_with_state`, their
argument checks, the copy-free split of the batch, the scan that accumulates
values and gradients, and the per-micro-batch PRNG keys. The device-local loop,
which keeps gradients unreduced until one all-reduce after it, lives in
`_microbatch_sharding`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from . import _layout
from . import _noise_scale as ns
from ._microbatch_sharding import (
    batch_mesh,
    device_local,
    reduce_after_loop,
    reduce_single,
    to_varying,
)
from ._validation import (
    accumulator_dtype_for,
    canonical_accumulator_dtype,
    check_fun_output,
    check_no_nnx_modules,
    check_positive_int,
    check_reduction,
)

MeshAxes = str | tuple[str, ...]


class WeightFn(Protocol):
    """Weights one micro-batch: ``weight_fn(*micro_batch_args) -> scalar``.

    Called with the micro-batch slices of the ``batch_argnums`` arguments, in
    that order. Return, for example, the number of valid tokens.
    """

    def __call__(self, *micro_batch_args: Any) -> jax.typing.ArrayLike: ...


def _argnums(value: Any, name: str) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) else value
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(
            f"`{name}` must be an int or a tuple of ints, got {value!r}."
        ) from None
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise TypeError(f"`{name}` must be an int or a tuple of ints, got {value!r}.")
    if any(i < 0 for i in items):
        raise ValueError(f"`{name}` must be non-negative, got {value!r}.")
    if len(set(items)) != len(items):
        raise ValueError(f"`{name}` has repeated entries: {value!r}.")
    return items


def _mesh_axes(value: Any) -> MeshAxes | None:
    if value is None or value == "auto":
        return value
    axes = (value,) if isinstance(value, str) else tuple(value)
    if not axes or not all(isinstance(a, str) for a in axes):
        raise TypeError(
            '`mesh_axes` must be "auto", None, a mesh axis name or a tuple of '
            f"them, got {value!r}."
        )
    return axes


def microbatch(
    fun: Callable[..., Any],
    num_micro_batches: int,
    *,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    reduction: str = "mean",
    weight_fn: WeightFn | None = None,
    accumulator_dtype: Any = None,
    axis_name: Any = None,
    rng_argnums: int | Sequence[int] = (),
    mesh_axes: MeshAxes | None = "auto",
    param_gather: str | None = None,
    noise_scale_decay: float | None = None,
) -> Callable[..., Any]:
    r"""Runs a value-and-grad function over micro-batches in one `lax.scan`.

    ``fun(params, batch, ...)`` returns ``(value, grads)``, or
    ``((value, aux), grads)`` with ``has_aux``; ``jax.value_and_grad(loss)`` is
    the typical ``fun``. The result has ``fun``'s signature. Every leaf of the
    ``batch_argnums`` arguments is split along axis 0 into ``num_micro_batches``
    micro-batches ``i = 0..k-1``; micro-batch ``i`` holds rows ``i, i+k,
    i+2k, ...``. That split is a free reshape ``(B, ...) -> (B/k, k, ...)``, so
    the batch is never copied, and each micro-batch keeps the batch's sharding
    (its rows are spread over all devices). It returns

    .. math::

        v = \frac{\sum_i w_i v_i}{\sum_i w_i}, \quad
        g = \frac{\sum_i w_i g_i}{\sum_i w_i} \quad (\text{mean}), \qquad
        v = \sum_i w_i v_i, \quad g = \sum_i w_i g_i \quad (\text{sum}),

    with ``w_i = weight_fn(*micro_batch_args)`` or 1. With the number of valid
    tokens as weight and a token-mean loss, the mean is the full-batch token
    mean exactly. ``aux`` comes back stacked along a new leading axis of length
    ``k``. With ``k = 1`` there is no loop: ``fun``'s result comes back as is
    (``aux`` gains its leading axis of length 1).

    **PRNG keys.** The arguments in ``rng_argnums`` (a key, or a pytree of keys
    such as Flax's ``{"dropout": key}``) reach micro-batch ``i`` as
    ``jax.random.fold_in(key, i)``, so each micro-batch draws its own dropout.

    **Sharding.** By default (``mesh_axes="auto"``, or ``None``) the loop
    runs in the global view, on any mesh and any parameter layout: ``fun``
    sees whole micro-batches, so its result is exactly the full batch's
    whatever it does with rows (means, sums, BatchNorm statistics), and the
    sharding annotations in ``fun`` keep their meaning. Buffers (the carry)
    have exactly the gradients' shardings: FSDP or tensor-parallel gradients
    accumulate sharded, never replicated. A micro-batch with fewer rows than
    the devices that shard the batch is computed on fewer devices. The cost:
    the compiler reduces data-parallel gradients inside the loop, once per
    micro-batch. Naming the mesh axes that shard the batch but not the
    parameters, ``mesh_axes="data"``, declares that ``fun`` treats rows
    independently (a mean over rows, or a ``w``-weighted mean with
    ``weight_fn`` a count): the loop then runs per device inside
    ``jax.shard_map`` over those axes, gradients stay local and one
    all-reduce follows the loop. ``fun`` then sees the device's part of each
    micro-batch, anything that couples rows (BatchNorm statistics) sees the
    device's rows only, keys are further folded with the device index, and
    inside ``fun`` the named axes are Manual (annotations must not name
    them; other axes, e.g. ``"fsdp"`` or ``"model"``, keep their sharding).
    ``aux`` leaves with the micro-batch's rows on axis 0 are gathered; other
    floating leaves are (weighted) averaged over devices, integer leaves
    summed. Under an Auto mesh, call it under ``jax.set_mesh``. Inside
    ``shard_map`` or ``pmap``, pass ``axis_name``: each device accumulates
    its own micro-batches and the weighted reduction over devices runs
    once, after the loop.

    **FSDP.** Parameters sharded over the batch's mesh axes (FSDP, HSDP) are
    gathered by ``fun`` per micro-batch, one layer at a time, as FSDP
    promises (``param_gather="per_micro_batch"``, the default under an
    Explicit mesh when a parameter is sharded so): the loop's inputs pass an
    optimization barrier, so XLA cannot hoist the gathers out of the loop
    and keep every gathered weight resident. ``param_gather="once"`` lets it:
    one gather per step, the whole gathered model in memory.

    Args:
      fun: a value-and-grad function, e.g. ``jax.value_and_grad(loss)``.
      num_micro_batches: ``k``, an int >= 1; it must divide the batch size.
      batch_argnums: positional argument(s) of ``fun`` holding the batch.
      has_aux: whether ``fun`` returns ``((value, aux), grads)``.
      reduction: ``"mean"`` (weighted mean) or ``"sum"`` (weighted sum).
      weight_fn: optional `WeightFn`; weights are float32 scalars.
      accumulator_dtype: floating (or complex) dtype of the gradient
        accumulator, ``"promote"`` (at least float32, of each gradient's
        kind), or ``None`` for each gradient's dtype (values accumulate in at
        least float32). Results come back in ``fun``'s dtypes.
      axis_name: inside ``shard_map`` or ``pmap``, the mapped axis (or axes) to
        reduce over once, after the loop.
      rng_argnums: positional argument(s) of ``fun`` holding PRNG keys.
      mesh_axes: ``"auto"`` or ``None`` (the global view), or the mesh axes
        to run the device-local loop over (see above).
      param_gather: ``"per_micro_batch"``, ``"once"`` or ``None`` (the
        former where parameters are sharded over the batch's Explicit mesh
        axes, else the latter). See FSDP above.
      noise_scale_decay: ``None``, or the EMA decay in (0, 1) of the gradient
        noise scale, measured from the k micro-batch gradients and their mean
        (see `accumulate` and `noise_scale`). The result then takes a keyword
        ``noise_scale`` (a `NoiseScaleState`, or ``None`` to start) and
        returns ``(result, noise_scale_state)``: the state is the tracker
        that carries the EMA across steps, and its ``last_grad_sq``,
        ``last_trace``, ``b_small`` and ``b_big`` are this step's statistics.
        Batch sizes count rows (examples), or the ``weight_fn`` weights.
        Needs ``reduction="mean"`` and ``num_micro_batches`` >= 2 (or several
        devices with ``axis_name``); on the device-local sharded loop the
        window sums take one extra scalar all-reduce.

    Returns:
      A function with ``fun``'s signature.

    Raises:
      ValueError: at construction for ``num_micro_batches`` < 1, an unknown
        ``reduction`` or conflicting arguments; at trace time for a batch size
        not divisible by ``num_micro_batches``, batch leaves with different
        leading sizes, or a non-scalar weight.
      TypeError: for a non-integer ``num_micro_batches``, a non-float
        ``accumulator_dtype`` or a non-callable ``fun`` or ``weight_fn``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax_accum
      >>> loss = lambda w, x: jnp.mean((x * w) ** 2)
      >>> fun = optax_accum.microbatch(jax.value_and_grad(loss), 4)
      >>> x = jnp.arange(8.0)
      >>> value, grad = fun(jnp.float32(1.0), x)
      >>> print(value, grad)
      17.5 35.0
      >>> print(*jax.value_and_grad(loss)(jnp.float32(1.0), x))  # full batch
      17.5 35.0
    """
    return _build(
        fun,
        num_micro_batches,
        batch_argnums=batch_argnums,
        has_aux=has_aux,
        reduction=reduction,
        weight_fn=weight_fn,
        accumulator_dtype=accumulator_dtype,
        axis_name=axis_name,
        rng_argnums=rng_argnums,
        mesh_axes=mesh_axes,
        param_gather=param_gather,
        noise_scale_decay=noise_scale_decay,
        stateful=False,
    )


def microbatch_with_state(fun: Callable[..., Any], num_micro_batches: int, **kwargs):
    """`microbatch` that also threads a ``state`` through the micro-batches.

    ``fun(*args, state=state)`` returns ``(out, new_state)``; micro-batch ``i``
    sees the state micro-batch ``i - 1`` returned, as k small steps would (the
    Flax helpers thread BatchNorm statistics and Rngs counters this way). The
    result is called as ``f(*args, state=state)`` and returns
    ``(out, final_state)``. In the device-local sharded loop, each device
    threads its own state; floating leaves are then averaged over devices.
    Keyword arguments are `microbatch`'s.
    """
    return _build(fun, num_micro_batches, stateful=True, **kwargs)


def _build(
    fun: Callable[..., Any],
    num_micro_batches: int,
    *,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    reduction: str = "mean",
    weight_fn: WeightFn | None = None,
    accumulator_dtype: Any = None,
    axis_name: Any = None,
    rng_argnums: int | Sequence[int] = (),
    mesh_axes: MeshAxes | None = "auto",
    param_gather: str | None = None,
    noise_scale_decay: float | None = None,
    stateful: bool,
) -> Callable[..., Any]:
    if not callable(fun):
        raise TypeError(f"`fun` must be callable, got {fun!r}.")
    k = check_positive_int(num_micro_batches, "num_micro_batches")
    check_reduction(reduction)
    decay = ns.check_decay(noise_scale_decay)
    ns.check_engine_args(decay, None, reduction, "num_micro_batches")
    acc_dtype = canonical_accumulator_dtype(accumulator_dtype)
    batch_idx = _argnums(batch_argnums, "batch_argnums")
    rng_idx = _argnums(rng_argnums, "rng_argnums")
    if not batch_idx:
        raise ValueError("`batch_argnums` must name at least one argument.")
    if set(batch_idx) & set(rng_idx):
        raise ValueError(
            f"`batch_argnums` ({batch_argnums!r}) and `rng_argnums` "
            f"({rng_argnums!r}) must not overlap."
        )
    if weight_fn is not None and not callable(weight_fn):
        raise TypeError(f"`weight_fn` must be callable or None, got {weight_fn!r}.")
    axes_mode = _mesh_axes(mesh_axes)
    if param_gather not in (None, "per_micro_batch", "once"):
        raise ValueError(
            '`param_gather` must be "per_micro_batch", "once" or None, got '
            f"{param_gather!r}."
        )
    if axis_name is not None and isinstance(axes_mode, tuple):
        raise ValueError(
            "Pass either `axis_name` (inside shard_map/pmap) or `mesh_axes`, "
            f"not both: got axis_name={axis_name!r}, mesh_axes={mesh_axes!r}."
        )
    user_axes = None if axis_name is None else _layout.axes_of(axis_name)
    mean = reduction == "mean"
    # Weighted means use a running mean: it stays at the gradients' scale,
    # so fp16 accumulators do not overflow with token-count weights.
    weighted = weight_fn is not None

    def split_batch(args: list) -> tuple[list, int]:
        n = len(args)
        for i in (*batch_idx, *rng_idx):
            if i >= n:
                raise ValueError(
                    f"argument index {i} (from `batch_argnums` or `rng_argnums`) "
                    f"is out of range for {n} positional arguments."
                )
        sizes = {}
        for i in batch_idx:
            for path, x in jax.tree_util.tree_leaves_with_path(args[i]):
                if jnp.ndim(x) == 0:
                    raise ValueError(
                        f"batch argument {i} has a scalar leaf at "
                        f"{jax.tree_util.keystr(path)}: every batch leaf needs "
                        "a leading batch axis."
                    )
                sizes[f"argument {i}{jax.tree_util.keystr(path)}"] = jnp.shape(x)[0]
        if not sizes:
            raise ValueError(f"the batch arguments {batch_idx} have no array leaves.")
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"batch leaves must share their leading size, got {sizes}."
            )
        size = next(iter(sizes.values()))
        if size % k:
            raise ValueError(
                f"the batch size {size} is not divisible by `num_micro_batches`={k}."
            )
        return args, size

    def weight_of(margs: list) -> jax.Array:
        w = weight_fn(*(margs[i] for i in batch_idx))
        if jnp.ndim(w) != 0:
            raise ValueError(
                f"`weight_fn` must return a scalar, got shape {jnp.shape(w)}."
            )
        return jnp.asarray(w, jnp.float32)

    def call(args: list, kwargs: dict, state: Any) -> tuple:
        if stateful:
            out, state = fun(*args, state=state, **kwargs)
        else:
            out = fun(*args, **kwargs)
        check_fun_output(out, has_aux)
        (value, aux), grads = out if has_aux else ((out[0], None), out[1])
        return value, grads, aux, state

    def run(args, kwargs, axes: tuple | None, unit: float, local: bool, state):
        """The scan. ``axes``: mesh axes to reduce over after it, if any."""
        views = {
            i: jax.tree.map(
                lambda x: _layout.splittable(x, k).reshape(
                    x.shape[0] // k, k, *x.shape[1:]
                ),
                args[i],
            )
            for i in batch_idx
        }
        barrier = gather_per_micro_batch(args)
        device = lax.axis_index(axes) if local else None

        def micro_args(i: jax.Array) -> list:
            margs = list(args)
            if barrier:
                # Tie the other inputs to the loop index: work on them (the
                # FSDP all-gathers) cannot be hoisted out of the loop.
                fixed = [j for j in range(len(args)) if j not in batch_idx]
                held, _ = lax.optimization_barrier(([args[j] for j in fixed], i))
                for j, x in zip(fixed, held, strict=True):
                    margs[j] = x
            for j in batch_idx:
                margs[j] = jax.tree.map(
                    lambda v: lax.dynamic_index_in_dim(v, i, 1, keepdims=False),
                    views[j],
                )
            for j in rng_idx:

                def fold(key):
                    key = jax.random.fold_in(key, i)
                    return key if device is None else jax.random.fold_in(key, device)

                margs[j] = jax.tree.map(fold, args[j])
            return margs

        def one(i: jax.Array, state: Any) -> tuple:
            margs = micro_args(i)
            if decay is not None:
                state, sums = state
            value, grads, aux, state = call(margs, kwargs, state)
            w = weight_of(margs) if weighted else jnp.float32(unit)
            if decay is not None:
                # Noise-scale units: rows (as fun sees them), or the weights.
                w_ns = w if weighted else jnp.float32(rows_of(margs))
                state = state, ns.window_sums(grads, w_ns, sums)
            return value, grads, aux, w, state

        shapes = jax.eval_shape(one, jnp.int32(0), state)
        v_shape, g_shape = shapes[0], shapes[1]

        def zeros(s, dtype):
            z = _layout.zeros_for(s, dtype)
            vary = tuple(getattr(s.manual_axis_type, "varying", ()) or ())
            return lax.pcast(z, vary, to="varying") if vary else z

        def v_dtype(s):
            return jnp.promote_types(s.dtype, jnp.float32)

        def g_dtype(s):
            return accumulator_dtype_for(s.dtype, acc_dtype)

        init = (
            jax.tree.map(lambda s: zeros(s, v_dtype(s)), v_shape),
            jax.tree.map(lambda s: zeros(s, g_dtype(s)), g_shape),
            zeros(shapes[3], jnp.float32),
            state,
        )

        def body(carry, i):
            acc_v, acc_g, w_sum, state = carry
            value, grads, aux, w, state = one(i, state)
            w_new = w_sum + w
            coef = jnp.where(w_new > 0, w / jnp.where(w_new > 0, w_new, 1.0), 0.0)

            def add(a, x):
                x = x.astype(a.dtype)
                if not weighted:
                    return a + x
                if mean:
                    new = a + coef.astype(a.dtype) * (x - a)
                else:
                    new = a + w.astype(a.dtype) * x
                # Weight 0 contributes nothing, even a 0/0 = NaN token mean of
                # an all-padding micro-batch (0 * NaN would be NaN): select.
                return jnp.where(w > 0, new, a)

            acc_v = jax.tree.map(add, acc_v, value)
            acc_g = jax.tree.map(add, acc_g, grads)
            return (acc_v, acc_g, w_new, state), (aux, w)

        (acc_v, acc_g, w_sum, state), (aux, ws) = lax.scan(
            body, init, jnp.arange(k, dtype=jnp.int32)
        )

        if axes is None:
            if not weighted and mean:
                acc_v, acc_g = jax.tree.map(lambda a: a / k, (acc_v, acc_g))
        else:
            acc_v, acc_g = reduce_after_loop(
                acc_v, acc_g, w_sum, axes, k=k, unit=unit, weighted=weighted, mean=mean
            )

        if decay is not None:
            state, (sq, n, total, _) = state
            sums = sq, n, total
            if local:
                # The device-local loop's state is averaged over the devices
                # after it (one pmean per leaf): scaled by N, that is the sum.
                sums = tuple(x * lax.axis_size(axes) for x in sums)
            elif axes is not None:
                sums = lax.psum(sums, axes)
            state = state, (*sums, ns.squared_norm(acc_g))
        value = jax.tree.map(lambda a, s: a.astype(s.dtype), acc_v, v_shape)
        grads = jax.tree.map(lambda a, s: a.astype(s.dtype), acc_g, g_shape)
        return value, grads, aux, ws, state

    def gather_per_micro_batch(args: list) -> bool:
        if param_gather is not None:
            return param_gather == "per_micro_batch"
        batch_axes = _layout.row_axes([args[i] for i in batch_idx])
        others = [a for i, a in enumerate(args) if i not in batch_idx]
        return bool(batch_axes and _layout.sharded_over(others, sorted(batch_axes)))

    def pack(value, grads, aux, state):
        out = ((value, aux), grads) if has_aux else (value, grads)
        return (out, state) if stateful or decay is not None else out

    def rows_of(margs: list) -> int:
        return jnp.shape(jax.tree.leaves(margs[batch_idx[0]])[0])[0]

    def single(args: list, kwargs: dict, state: Any):
        """k = 1: no loop; with ``axis_name`` the one weighted reduction."""
        if decay is not None:
            state, _ = state
        value, grads, aux, state = call(args, kwargs, state)
        aux = jax.tree.map(lambda a: jnp.expand_dims(a, 0), aux)
        if user_axes is not None or decay is not None:
            w = weight_of(args) if weighted else jnp.float32(1.0)
        if decay is not None:
            w_ns = w if weighted else jnp.float32(rows_of(args))
            sums = ns.window_sums(grads, w_ns)[:3]
        if user_axes is not None:
            value, grads = reduce_single((value, grads), w, user_axes, mean)
            if decay is not None:
                sums = lax.psum(sums, user_axes)
        if decay is not None:
            state = state, (*sums, ns.squared_norm(grads))
        return pack(value, grads, aux, state)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        check_no_nnx_modules((args, kwargs))
        if decay is None:
            return body(*args, **kwargs)
        tracker = kwargs.pop("noise_scale", None)
        if tracker is None:
            tracker = ns.init((), None)
        # The window sums ride along with the threaded state.
        kwargs["state"] = (kwargs.pop("state", None), ns.zero_stats())
        out, (state, stats) = body(*args, **kwargs)
        if stateful:
            out = out, state
        return out, ns.close(tracker, jnp.bool_(True), stats, decay, None, 1)

    def body(*args: Any, **kwargs: Any) -> Any:
        threads = stateful or decay is not None
        state = kwargs.pop("state", None) if threads else None
        args, size = split_batch(list(args))
        if user_axes is not None:
            # Invariant inputs would get their cotangents psum-ed inside `fun`.
            args = [
                a if i in batch_idx else to_varying(a, user_axes)
                for i, a in enumerate(args)
            ]
            kwargs, state = to_varying((kwargs, state), user_axes)
        if k == 1:
            return single(args, kwargs, state)
        if user_axes is not None:
            value, grads, aux, _, state = run(
                args, kwargs, user_axes, 1.0, False, state
            )
            return pack(value, grads, aux, state)
        if isinstance(axes_mode, tuple):
            found = batch_mesh(args, kwargs, state, batch_idx, axes_mode, mesh_axes)
            value, grads, aux, state = device_local(
                run, args, kwargs, state, *found, size, k, batch_idx, has_aux
            )
            return pack(value, grads, aux, state)
        mesh = _layout.batch_mesh_of([args[i] for i in batch_idx])
        if mesh is not None:  # the global view on an Explicit mesh
            others = [a for i, a in enumerate(args) if i not in batch_idx]
            others, kwargs, state = _layout.onto_mesh((others, kwargs, state), mesh)
            it = iter(others)
            args = [a if i in batch_idx else next(it) for i, a in enumerate(args)]
        value, grads, aux, _, state = run(args, kwargs, None, 1.0, False, state)
        return pack(value, grads, aux, state)

    return wrapped
