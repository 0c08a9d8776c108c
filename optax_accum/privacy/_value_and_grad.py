# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`clipped_value_and_grad`: the sum of per-example clipped gradients.

The data path, one `lax.scan` step per micro-batch:

    the micro-batch's rows -> mask -> (all padding: zeros, no compute) ->
    vmap(value_and_grad) per example -> clip each to C -> masked sum ->
    add to the window's buffer.

Per-example gradients exist for one micro-batch at a time, so their memory is
bounded by the micro-batch, not the batch. The sums run in the core's
``"promote"`` accumulator dtypes (float32 for bf16 and fp16 parameters).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from .. import _checks, _dtypes, _sharding
from . import _checks as _privacy_checks
from ._clip import clip


def clipped_value_and_grad(
    loss: Callable[..., Any],
    l2_clip_norm: float,
    num_microbatches: int = 1,
    *,
    batch_argnums: int | Sequence[int] = 1,
    shared_argnums: int | Sequence[int] = (),
    has_aux: bool = False,
    example_mask_fn: Callable[..., jax.typing.ArrayLike] | None = None,
) -> Callable[..., Any]:
    r"""The mean loss and the sum of per-example gradients, each clipped to C.

    .. math::

        \text{value} = \frac{1}{|E|} \sum_{e \in E} \ell_e, \qquad
        \text{grads} = \sum_{e \in E} g_e \min\Bigl(1, \frac{C}{\|g_e\|_2}\Bigr)

    over the real examples :math:`E` (the rows ``example_mask_fn`` marks), with
    :math:`g_e` the gradient of example ``e``'s loss w.r.t. ``params`` and its
    norm taken over the whole pytree. Adding or removing one example changes
    ``grads`` by at most ``l2_clip_norm`` in L2: the sensitivity a Gaussian
    mechanism needs (`dp_accumulate` adds the noise).

    Each example is one row of the batch arguments, and ``loss`` sees it as a
    batch of one (its leading axis kept, as ``jax_privacy.clipping.clipped_grad``
    does by default), so the loss written for a batch serves as it is. The
    rows are split into ``num_microbatches`` micro-batches (micro-batch ``i``
    is rows ``i, i + k, ...``, as `microbatch` splits them, which keeps a
    sharded batch's rows on their devices) and computed one after another in a
    ``lax.scan``: per-example gradients then take memory for one micro-batch.
    A micro-batch whose rows are all padding is skipped under ``lax.cond``: it
    costs no compute and contributes exactly zero.

    Non-finite entries of an example's gradient are set to 0 before clipping
    (as ``jax_privacy``'s ``nan_safe``), so one bad example cannot turn the sum
    into NaN. A padding row contributes exactly zero whatever its values.
    Only ``grads`` has bounded sensitivity: ``value`` (which also reveals the
    number of real examples) and ``aux`` are not private.

    Inside ``shard_map``, each device clips and sums its own rows (the
    parameters are made to vary over the batch's axes before the
    differentiation, so no per-example gradient is summed over devices before
    its clip); pass ``axis_name`` to `dp_accumulate`, which reduces the sums.
    A parameter split over another manual axis (tensor parallelism: ``w``
    placed ``P("model")``, the forward summing over ``"model"``) is a shard
    of each example's gradient: its squares are summed over that axis, so
    every device clips by the whole gradient's norm, not its shard's.

    Args:
      loss: ``loss(params, *args) -> value`` (``(value, aux)`` with
        ``has_aux``): a real floating scalar for a batch of one example.
      l2_clip_norm: ``C``, the L2 norm each example's gradient is clipped to,
        a finite number > 0.
      num_microbatches: ``k``, an int >= 1 that divides the number of rows.
      batch_argnums: the positional argument(s) of ``loss`` that hold the
        examples, one per row along their leading axis (``params`` is
        argument 0 and cannot be one). The other arguments reach every
        example as they are; for per-example randomness (dropout), pass a
        key per row as a batch argument (``jax.random.split(key, rows)``).
        One of them with a leading axis as long as the rows (the labels of
        ``loss(params, x, y)`` with the default ``batch_argnums=1``) is
        refused: every example would see all of its rows, and one changed
        row would move every example's gradient (issue 39).
      shared_argnums: the positional argument(s) that every example sees
        whole although their leading axis is as long as the rows (a table
        that happens to have as many rows as the batch). Declared, never
        guessed: nothing in ``shared_argnums`` may be in ``batch_argnums``.
      has_aux: whether ``loss`` returns ``(value, aux)``. ``aux`` comes back
        per example, stacked along a leading axis in the rows' order, with
        zeros for padding rows. Nothing bounds its sensitivity.
      example_mask_fn: optional ``example_mask_fn(*microbatch_args) ->
        bool[rows]``, called with one micro-batch's batch arguments (in
        ``batch_argnums``' order): True for a real example, False for
        padding. Default: every row is real.

    Returns:
      ``f(params, *args) -> (value, grads)`` (``((value, aux), grads)`` with
      ``has_aux``): ``value`` the mean loss over the real examples (0 when
      there are none) in at least float32, ``grads`` the sum of their clipped
      gradients, with ``params``' structure, in at least float32.

    Raises:
      ValueError: at construction, for ``l2_clip_norm`` <= 0 or not finite,
        ``num_microbatches`` < 1, ``batch_argnums`` or ``shared_argnums``
        naming argument 0, or an argument in both; at trace time, for batch
        arguments whose leading axes differ or are not divisible by
        ``num_microbatches``, a ``batch_argnums`` index out of range, an
        argument outside ``batch_argnums`` and ``shared_argnums`` with a
        leading axis as long as the rows, or a mask that is not one boolean
        per row.
      TypeError: at construction, for a ``loss`` or ``example_mask_fn`` that
        is not callable, or a non-number ``l2_clip_norm`` or
        ``num_microbatches``; at trace time, for a loss that is not a real
        floating scalar, or ``params`` with integer leaves.

    Examples:
      >>> import jax.numpy as jnp
      >>> from optax_accum import privacy
      >>> loss = lambda w, x: jnp.mean((x - w) ** 2) / 2  # gradient w - x
      >>> vg = privacy.clipped_value_and_grad(loss, l2_clip_norm=1.0)
      >>> value, grads = vg(jnp.float32(0.0), jnp.array([0.5, -3.0, 4.0]))
      >>> float(grads)  # -0.5 + 1 - 1 (the last two clipped to norm 1)
      -0.5
      >>> mask = lambda x: x != 4.0  # the last row is padding
      >>> vg = privacy.clipped_value_and_grad(loss, 1.0, example_mask_fn=mask)
      >>> float(vg(jnp.float32(0.0), jnp.array([0.5, -3.0, 4.0]))[1])
      0.5
    """
    if not callable(loss):
        raise TypeError(f"`loss` must be callable, got {loss!r}.")
    c = _privacy_checks.clip_norm(l2_clip_norm)
    k = _checks.positive_int(num_microbatches, "num_microbatches")
    idx = _checks.argnums(batch_argnums, "batch_argnums")
    if 0 in idx:
        raise ValueError(
            "`batch_argnums` must not include 0: argument 0 is the parameters, "
            f"which are differentiated, got batch_argnums={batch_argnums!r}."
        )
    shared = _checks.argnums(shared_argnums, "shared_argnums")
    if 0 in shared or set(shared) & set(idx):
        raise ValueError(
            "`shared_argnums` must not include 0 (the parameters) nor an "
            f"argument of `batch_argnums`={batch_argnums!r}, got "
            f"shared_argnums={shared_argnums!r}."
        )
    _checks.callable_or_none(example_mask_fn, "example_mask_fn")
    if not isinstance(has_aux, bool):
        raise TypeError(f"`has_aux` must be a bool, got {has_aux!r}.")
    run = functools.partial(_clipped, loss, c, k, idx, shared, has_aux, example_mask_fn)
    return functools.wraps(loss)(run) if hasattr(loss, "__name__") else run


def _clipped(loss, c, k, idx, shared, has_aux, mask_fn, params, *args):
    with jax.named_scope("optax_accum/clipped_value_and_grad"):
        full = (params, *args)
        for j in idx:
            if j >= len(full):
                raise ValueError(
                    f"`batch_argnums` index {j} is out of range for "
                    f"{len(full)} positional arguments."
                )
        _check_params(params)
        batch = [full[j] for j in idx]
        rows = _rows(batch, k)
        _check_unsplit(full, idx, shared, rows)
        split = jax.tree.map(functools.partial(_split, k=k), batch)
        rest = [x for j, x in enumerate(full) if j != 0 and j not in idx]
        # Inside shard_map: each device differentiates its own examples. With
        # parameters that do not vary, jax.grad would psum each per-example
        # gradient over the devices (mixing examples) before the clip.
        axes = _varying_axes(batch)
        params = _sharding.to_varying(params, axes)
        step = functools.partial(_microbatch, loss, c, idx, axes, has_aux, mask_fn)
        acc = jax.tree.map(_buffer, params)
        vtype = jnp.promote_types(_dtypes.weight_dtype(params), jnp.float32)
        carry = (acc, jnp.zeros([], vtype), jnp.zeros([], jnp.int32))
        carry = _sharding.to_varying(carry, axes)

        def body(carry, mb):
            acc, total, count = carry
            grads, loss_sum, n, aux = step(params, rest, mb)
            acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)
            return (acc, total + loss_sum.astype(total.dtype), count + n), aux

        (grads, total, count), aux = lax.scan(body, carry, split)
        n = jnp.maximum(count, 1).astype(total.dtype)
        value = jnp.where(count > 0, total / n, jnp.zeros_like(total))
        value = value.astype(total.dtype)
        if not has_aux:
            return value, grads
        aux = jax.tree.map(lambda a: _unsplit(a, rows), aux)
        return (value, aux), grads


def _microbatch(loss, c, idx, axes, has_aux, mask_fn, params, rest, mb):
    """One micro-batch: its clipped sum, loss sum, real rows and aux; all
    zeros, computing nothing, when every row is padding."""
    m = jax.tree.leaves(mb)[0].shape[0]
    mask = _mask(mask_fn, mb, m)
    shapes = jax.eval_shape(
        functools.partial(_compute, loss, c, idx, axes, has_aux),
        params,
        rest,
        mb,
        mask,
    )

    def skip(params, rest, mb, mask):
        del params, rest, mb, mask
        return jax.tree.map(_zeros, shapes)

    compute = functools.partial(_compute, loss, c, idx, axes, has_aux)
    out = lax.cond(jnp.any(mask), compute, skip, params, rest, mb, mask)
    grads, loss_sum, aux = out
    return grads, loss_sum, jnp.sum(mask, dtype=jnp.int32), aux


def _compute(loss, c, idx, axes, has_aux, params, rest, mb, mask):
    def one(params, rows):
        by_index = dict(zip(idx, rows, strict=True))
        others = iter(rest)
        n = 1 + len(idx) + len(rest)
        args = [
            jax.tree.map(lambda x: x[None], by_index[j])  # a batch of one
            if j in by_index
            else next(others)
            for j in range(1, n)
        ]
        return _value_and_aux(loss(params, *args), has_aux)

    rows = _sharding.rows_alike([mb[i] for i in range(len(idx))])
    vg = jax.value_and_grad(one, has_aux=True)
    (values, aux), grads = jax.vmap(vg, in_axes=(None, 0))(
        _gathered(params, rows), rows
    )
    # The norm is the whole example's: a leaf split over a model axis sums its
    # shards' squares over it (`clip`'s ``data_axes``: the examples' axes).
    clipped, _ = jax.vmap(functools.partial(clip, l2_clip_norm=c, data_axes=axes))(
        grads
    )

    def masked(x):  # a select, not a product: 0 * NaN is NaN
        keep = _rows_like(mask, x).reshape(mask.shape + (1,) * (x.ndim - 1))
        return jnp.where(keep, x, jnp.zeros_like(x))

    vtype = jnp.promote_types(values.dtype, jnp.float32)
    loss_sum = jnp.sum(masked(values.astype(vtype)))
    sums = jax.tree.map(lambda g: jnp.sum(masked(g), axis=0), clipped)
    return sums, loss_sum, jax.tree.map(masked, aux)


def _gathered(params: Any, rows: Any) -> Any:
    """``params`` gathered over the Explicit mesh axes that shard the rows
    (FSDP): the per-example ``vmap`` maps over those axes, and JAX refuses an
    unmapped operand sharded over them. The gathers are per micro-batch, as
    FSDP's are; the sums go back to the parameters' sharding in the carry."""
    axes = _sharding.row_axes(rows)
    if not axes:
        return params

    def gather(p):
        spec = _sharding.explicit_spec(p)
        if spec is None or not _sharding.used_axes(spec) & axes:
            return p
        keep = [
            tuple(a for a in _sharding.axes_of(e) if a not in axes) or None
            for e in spec.partitions
        ]
        keep = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in keep]
        return jax.sharding.reshard(p, P(*keep))

    return jax.tree.map(gather, params)


def _rows_like(mask: jax.Array, x: jax.Array) -> jax.Array:
    """``mask`` sharded as ``x``'s rows (axis 0), where an Explicit mesh
    shards them: a select needs its operands' shardings to agree."""
    spec = _sharding.explicit_spec(x)
    if spec is None:
        return mask
    rows = spec.partitions[0] if spec.partitions else None
    if _sharding.explicit_spec(mask) == P(rows) or (
        rows is None and not _sharding.used_axes(_sharding.explicit_spec(mask))
    ):
        return mask
    return jax.sharding.reshard(mask, jax.typeof(x).sharding.update(spec=P(rows)))


def _value_and_aux(out, has_aux):
    if has_aux:
        if not (isinstance(out, tuple | list) and len(out) == 2):
            what = (
                f"an array of shape {jnp.shape(out)}"
                if hasattr(out, "shape")
                else type(out).__name__
            )
            raise TypeError(
                f"with `has_aux=True` the loss must return (value, aux), got {what}."
            )
        value, aux = out
    else:
        value, aux = out, ()
    _checks.real_scalar_loss(value, " for one example")
    return value, aux


def _mask(mask_fn, mb, m):
    if mask_fn is None:
        return jnp.ones([m], jnp.bool_)
    mask = jnp.asarray(mask_fn(*mb))
    if mask.shape != (m,) or mask.dtype != jnp.bool_:
        raise ValueError(
            "`example_mask_fn` must return one boolean per row of the "
            f"micro-batch, shape ({m},) and dtype bool, got shape {mask.shape} "
            f"and dtype {mask.dtype}."
        )
    return mask


def _check_params(params):
    """As `jax.grad`: the parameters are floating (or complex) arrays."""
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        dtype = jnp.result_type(x)
        if not _dtypes.is_differentiable(dtype):
            raise TypeError(
                f"`params`{jax.tree_util.keystr(path)} has dtype {dtype}: "
                "clipped_value_and_grad differentiates the parameters "
                "(argument 0), whose leaves must be floating (or complex), as "
                "jax.grad requires. Move integer leaves to another argument."
            )


def _check_unsplit(full, idx, shared, rows):
    """No argument outside ``batch_argnums`` is batch-sized unless declared
    shared: every example would see all of its rows (issue 39, finding 6)."""
    for j, x in enumerate(full):
        if j == 0 or j in idx or j in shared:
            continue
        for path, leaf in jax.tree_util.tree_leaves_with_path(x):
            shape = jnp.shape(leaf)
            if shape and shape[0] == rows:
                where = f"argument {j}{jax.tree_util.keystr(path)}"
                raise ValueError(
                    f"{where} of `loss` has a leading axis of {rows}, as many "
                    f"as the batch's rows, but is not in `batch_argnums`="
                    f"{idx}: every example would see all of its rows (e.g. "
                    "every label), so one changed row would move the clipped "
                    "sum by more than `l2_clip_norm`. Pass "
                    f"`batch_argnums={tuple(sorted((*idx, j)))}` to give each "
                    f"example its own row, or `shared_argnums=({j},)` if every "
                    "example should see it whole."
                )


def _rows(batch, k):
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in jax.tree.leaves(batch)}
    if not sizes or None in sizes or len(sizes) != 1:
        raise ValueError(
            "the batch arguments (`batch_argnums`) must be arrays with one "
            f"leading axis of rows, the same for all, got leading sizes {sizes}."
        )
    (rows,) = sizes
    if rows % k:
        raise ValueError(
            f"`num_microbatches`={k} must divide the number of rows, {rows}."
        )
    return rows


def _split(x, k):
    """``(B, ...) -> (k, B/k, ...)``: micro-batch ``i`` is rows ``i, i+k, ...``."""
    x = _sharding.splittable(x, k)
    return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)


def _unsplit(a, rows):
    """`_split` undone for a per-row output ``(k, B/k, ...)``."""
    return jnp.swapaxes(a, 0, 1).reshape(rows, *a.shape[2:])


def _zeros(s: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros typed as ``s``: its sharding on an Explicit mesh (given as a
    NamedSharding, so no mesh context is needed), its varying manual axes."""
    sharding = s.sharding if _sharding.used_axes(_sharding.explicit_spec(s)) else None
    return _sharding.match_varying(
        jnp.zeros(s.shape, s.dtype, out_sharding=sharding), s
    )


def _varying_axes(batch) -> tuple:
    """The manual (``shard_map``) axes some leaf of the batch varies over."""
    axes: set = set()
    for x in jax.tree.leaves(batch):
        if isinstance(x, jax.Array | jax.core.Tracer):
            mat = getattr(jax.typeof(x), "mat", None)
            axes |= set(getattr(mat, "varying", None) or ())
    return tuple(sorted(axes))


def _buffer(p):
    return _sharding.zeros_like(p, _dtypes.for_gradient(jnp.result_type(p), "promote"))
