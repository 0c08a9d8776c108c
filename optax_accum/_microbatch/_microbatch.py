# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`microbatch`: k micro-batches of a value-and-grad function in one `lax.scan`.

This module owns the public face: `microbatch` (and `microbatch_with_state`,
which the Flax helpers use), which checks its options once (`_options`)
and returns a function with ``fun``'s signature. Calling it picks where the
loop runs (the global view, per device of ``axis_name`` or of ``data_axes``)
and packs the result; the loop is `_loop`'s, the device-local mode
`_local`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .. import _noise_scale as ns
from .. import _sharding
from .._loss_scale import ScaledGrads
from .._typing import Unpack
from . import _order
from ._call import batch_size, note_unsplit
from ._keywords import MicrobatchKeywords, takes_keywords
from ._local import device_local
from ._loop import Loop, scan
from ._options import (
    Context,
    Options,
    check_callable,
    check_no_nnx_modules,
    nnx_state_error,
    options,
)


@takes_keywords
def microbatch(
    fun: Callable[..., Any],
    num_microbatches: int,
    **kwargs: Unpack[MicrobatchKeywords],
) -> Callable[..., Any]:
    r"""Runs a value-and-grad function over micro-batches in one `lax.scan`.

    ``fun(params, batch, ...)`` returns ``(value, grads)``, or
    ``((value, aux), grads)`` with ``has_aux``; ``jax.value_and_grad(loss)`` is
    the typical ``fun``. The result has ``fun``'s signature. Every leaf of the
    ``batch_argnums`` arguments is split along axis 0 into ``num_microbatches``
    micro-batches ``i = 0..k-1``; micro-batch ``i`` holds rows ``i, i+k,
    i+2k, ...``. That split is a free reshape ``(B, ...) -> (B/k, k, ...)``, so
    the batch is never copied, and each micro-batch keeps the batch's sharding
    (its rows are spread over all devices). It returns

    .. math::

        v = \frac{\sum_i w_i v_i}{\sum_i w_i}, \quad
        g = \frac{\sum_i w_i g_i}{\sum_i w_i} \quad (\text{mean}), \qquad
        v = \sum_i w_i v_i, \quad g = \sum_i w_i g_i \quad (\text{sum}),

    with ``w_i = weight_fn(*microbatch_args)`` or 1. With the number of valid
    tokens as weight and a token-mean loss, the mean is the full-batch token
    mean exactly. ``aux`` comes back stacked along a new leading axis of length
    ``k``; with ``aux_order="batch"`` its row-wise leaves (per-example logits,
    say) come back as ``(B, ...)`` in the batch's own row order, as ``fun`` on
    the whole batch would return them. Every ``k`` has these semantics,
    ``k = 1`` included (weights, reduction and all; one micro-batch runs as
    straight-line code, so it costs what ``fun`` costs).

    **Weights** follow `accumulate`'s contract: a weight of 0 contributes
    nothing (even a NaN token mean), a NaN, infinite or negative weight
    rejects its micro-batch (the others are averaged as if it were absent; on
    one device it changes only that device's contribution), and sums are
    normalised by the largest weight, so they cannot overflow. All k weights
    are computed before the loop, in one vectorised pass over the
    micro-batches. ``fun``'s gradients are used as it returns them (clipped,
    projected, whatever ``fun`` does): each is cast to the buffer's precision
    and then weighted, after ``fun``. In the token-weighted global view an
    accelerator's compiler then reduces the gradients over the data axes
    inside the loop, once per micro-batch; `microbatch_value_and_grad`, which
    takes the loss and differentiates it itself, applies the weights inside
    the backward pass and keeps that reduction out of the loop.

    **Padding costs no compute.** Off a mesh, a micro-batch of weight 0 (all
    padding) is skipped under `lax.cond`, as ``optax.microbatching`` skips
    past its real micro-batches: with 4 of 8 micro-batches padding a step
    takes about half the time (``benchmarks/results/padding.md``). Results
    are unchanged, and so are its ``aux`` row and the threaded state:
    `microbatch_value_and_grad` (and the Flax steps) run its forward pass
    alone for them, and a value-and-grad ``fun`` with ``has_aux``, a state or
    `ScaledGrads` is computed in full, since only a whole call gives those.
    On a mesh (under ``jax.set_mesh`` or with an Explicit batch) every
    micro-batch is computed, so that the compiler can move the gradients'
    reduction over devices out of the loop.

    **Unrolling.** ``unroll`` is ``lax.scan``'s: micro-batches per trip of
    the loop (``True``: all k, straight-line code). It changes no result.
    The loop (1) keeps memory and compile time flat in k; unrolling lets the
    compiler overlap micro-batches, at up to k times the temporary memory
    (``benchmarks/results/conv.md``). ``k = 1`` always runs without a loop.
    On the CPU, convolutions in the loop are laid out for XLA's fast
    kernels, as XLA does only outside loops, so a conv net's loop costs what
    the same micro-batches unrolled cost.

    **fp16 loss scaling.** ``fun`` may return `ScaledGrads` (from
    `scaled_value_and_grad`): the result is then a `ScaledGrads` of the whole
    step, as the large batch would give it: the mean value and gradients,
    ``finite`` true only if every micro-batch's gradients are (on every
    device), and the loss scale adjusted as for one step (by the first
    micro-batch that overflowed, if any). Skip the update when not
    ``finite``.

    **PRNG keys.** The arguments in ``rng_argnums`` (a key, or a pytree of keys
    such as Flax's ``{"dropout": key}``) reach micro-batch ``i`` as
    ``jax.random.fold_in(key, i)``, so each micro-batch draws its own dropout.

    **Sharding.** By default (``data_axes=None``) the loop
    runs in the global view, on any mesh and parameter layout that ``fun``
    runs on (on an Explicit mesh, a gather may need ``out_sharding``, as for
    ``jax.value_and_grad``; see the microbatch guide): ``fun``
    sees whole micro-batches, so its result is exactly the full batch's
    whatever it does with rows (means, sums, BatchNorm statistics), and the
    sharding annotations in ``fun`` keep their meaning. Buffers (the carry)
    have exactly the gradients' shardings: FSDP or tensor-parallel gradients
    accumulate sharded, never replicated. A micro-batch with fewer rows than
    the devices that shard the batch is computed on fewer devices. The cost:
    the compiler reduces data-parallel gradients inside the loop, once per
    micro-batch (on an accelerator the compiler can move that reduction out
    of the loop; see **Weights**). Naming the mesh axes that shard the batch
    but not the parameters, ``data_axes="data"``, declares that ``fun`` treats rows
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
    summed; which leaves hold rows is declared with ``aux_rows``, never
    guessed from a shape. Under an Auto mesh, call it under ``jax.set_mesh``. Inside
    ``shard_map`` or ``pmap``, pass ``axis_name``: each device accumulates
    its own micro-batches and the weighted reduction over devices runs
    once, after the loop.

    **FSDP.** Parameters sharded over the batch's mesh axes (FSDP, HSDP) are
    gathered by ``fun`` per micro-batch, one layer at a time, as FSDP
    promises (``param_gather="per_microbatch"``, the default under an
    Explicit mesh when a parameter is sharded so): the loop's inputs pass an
    optimization barrier, so XLA cannot hoist the gathers out of the loop
    and keep every gathered weight resident. ``param_gather="once"`` gathers
    them before the loop instead (XLA:GPU would keep the gather in the loop
    by itself): one gather per step, the whole gathered model in memory, and
    each micro-batch's gradients resharded like the parameters. ``fun`` then
    receives every argument sharded over the batch's axes gathered: a loss
    that gathers its own shards (a ``shard_map`` over them) keeps the default.

    Args:
      fun: a value-and-grad function, e.g. ``jax.value_and_grad(loss)``.
      num_microbatches: ``k``, an int >= 1; it must divide the batch size.
      {keywords}

    Returns:
      A function with ``fun``'s signature.

    Raises:
      ValueError: at construction for ``num_microbatches`` < 1, an unknown
        ``reduction`` or conflicting arguments; at trace time for a batch size
        not divisible by ``num_microbatches``, batch leaves with different
        leading sizes, or a non-scalar weight.
      TypeError: for a non-integer ``num_microbatches``, a non-float
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
    check_callable(fun)
    opts = options(num_microbatches, **kwargs)
    return _microbatched(fun, opts)


def microbatch_with_state(
    fun: Callable[..., Any], num_microbatches: int, **kwargs: Any
) -> Callable[..., Any]:
    """`microbatch` that also threads a ``state`` through the micro-batches.

    ``fun(*args, state=state)`` returns ``(out, new_state)``; micro-batch ``i``
    sees the state micro-batch ``i - 1`` returned, as k small steps would (the
    Flax helpers thread BatchNorm statistics and Rngs counters this way). The
    result is called as ``f(*args, state=state)`` and returns
    ``(out, final_state)``. In the device-local sharded loop, each device
    threads its own state; floating leaves are then averaged over devices.
    Keyword arguments are `microbatch`'s.
    """
    check_callable(fun)
    opts = options(
        num_microbatches, stateful=True, face="microbatch_with_state", **kwargs
    )
    return _microbatched(fun, opts)


def _microbatched(fun: Callable[..., Any], opts: Options) -> Callable[..., Any]:
    """The function `microbatch` returns; ``fun``'s name and docs, but no
    ``__wrapped__`` (tools that follow it, such as Equinox's, would find
    ``fun``'s own wrappers and misread the result)."""

    def microbatched(*args: Any, **kwargs: Any) -> Any:
        check_no_nnx_modules((args, kwargs))
        tracker = kwargs.pop("noise_scale", None) if opts.decay is not None else None
        state = kwargs.pop("state", None) if opts.stateful else None
        with jax.named_scope("optax_accum/microbatch"):
            try:
                out = _run(fun, opts, list(args), kwargs, state)
            except Exception as e:
                refused = nnx_state_error(e)
                if refused is not None:
                    raise refused from e
                note_unsplit(e, list(args), opts)
                raise
        result = _pack(out, opts)
        if opts.stateful:
            result = result, out.state
        if opts.decay is None:
            return result
        tracker = ns.init((), None) if tracker is None else tracker
        # A step the caller skips (fp16 overflow) is not observed.
        observed = jnp.bool_(True) if out.scaled is None else out.scaled.finite
        return result, ns.close(tracker, observed, out.noise, opts.decay, None, 1)

    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        if hasattr(fun, attr):
            setattr(microbatched, attr, getattr(fun, attr))
    return microbatched


def _run(fun, opts: Options, args: list, kwargs: dict, state: Any) -> Loop:
    """Where the loop runs: per device of ``axis_name`` (inside the user's
    ``shard_map``/``pmap``), of ``data_axes``, or in the global view; with
    ``aux_order="batch"``, row-wise ``aux`` leaves in the batch's order."""
    out = _where(fun, opts, args, kwargs, state)
    if not (opts.has_aux and opts.aux_in_batch_order) or opts.data_axes is not None:
        return out  # the device-local mode orders its own rows
    rows = batch_size(args, opts) // opts.k
    flags = _order.row_flags(out.aux, opts.aux_rows, rows)
    return out._replace(aux=_order.in_batch_order(out.aux, flags, opts.k))


def _where(fun, opts: Options, args: list, kwargs: dict, state: Any) -> Loop:
    size = batch_size(args, opts)
    if opts.axis_name is not None:
        # Invariant inputs would get their cotangents psum-ed inside `fun`.
        args = [
            a if i in opts.batch_idx else _sharding.to_varying(a, opts.axis_name)
            for i, a in enumerate(args)
        ]
        kwargs, state = _sharding.to_varying((kwargs, state), opts.axis_name)
        return scan(fun, args, kwargs, state, opts, Context(opts.axis_name))
    if opts.data_axes is not None:
        return device_local(fun, args, kwargs, state, opts, size)
    mesh = _sharding.batch_mesh_of([args[i] for i in opts.batch_idx])
    if mesh is not None:  # the global view on an Explicit mesh
        others = [a for i, a in enumerate(args) if i not in opts.batch_idx]
        others, kwargs, state = _sharding.onto_mesh((others, kwargs, state), mesh)
        it = iter(others)
        args = [a if i in opts.batch_idx else next(it) for i, a in enumerate(args)]
    return scan(fun, args, kwargs, state, opts, Context())


def _pack(out: Loop, opts: Options) -> Any:
    """``fun``'s output structure: ``(value, grads)``, ``((value, aux),
    grads)``, or a `ScaledGrads` of the whole step."""
    value = (out.value, out.aux) if opts.has_aux else out.value
    if out.scaled is not None:
        return ScaledGrads(value, out.grads, out.scaled.loss_scale, out.scaled.finite)
    return (value, out.grads)
