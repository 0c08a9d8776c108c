# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Dynamic loss scaling per micro-batch, for fp16 training with accumulation.

`scaled_value_and_grad` scales one micro-batch's loss, unscales its gradients
before they reach the accumulator and adjusts the loss scale. The loss scale is
any object with ``scale``, ``unscale`` and ``adjust`` methods, such as jmp's
``DynamicLossScale``; this module never imports jmp, so the library's runtime
dependencies stay jax and optax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

_LOSS_SCALE_METHODS = ("scale", "unscale", "adjust")


class ScaledGrads(NamedTuple):
    """What `scaled_value_and_grad`'s function returns for one micro-batch.

    Attributes:
      value: ``fun``'s value, not scaled (``(value, aux)`` with ``has_aux``).
      grads: the gradients, unscaled: what the accumulator should receive.
      loss_scale: the loss scale adjusted by ``finite``, for the next call.
      finite: bool scalar, whether every gradient is finite (on every device,
        with ``axis_name``). It is the opposite of what `skip_not_finite`
        decides for ``grads`` (with the same ``axis_name`` in `accumulate`).
    """

    value: Any
    grads: optax.Updates
    loss_scale: Any
    finite: jax.Array


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def scaled_value_and_grad(
    fun: Callable[..., Any],
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    axis_name: Any = None,
) -> Callable[..., ScaledGrads]:
    """Value and gradient of ``fun`` under a dynamic loss scale, for fp16.

    The returned function is called as ``g(loss_scale, *args, **kwargs)`` on
    one micro-batch. It differentiates ``loss_scale.scale(fun(*args))``, so
    that small fp16 gradients do not flush to zero, then unscales the
    gradients, so that every micro-batch enters the accumulator in the same
    units even when the scale changes in the middle of a window. An overflow
    leaves an infinity or a NaN in the unscaled gradients: pass
    ``skip_fn=optax_accum.skip_not_finite`` to `accumulate` (or
    ``should_skip_update_fn`` to `MultiSteps`) and the micro-batch is dropped
    as if it never arrived, while ``loss_scale.adjust`` shrinks the scale.
    After ``period`` finite micro-batches in a row the scale grows.

    Under ``pmap`` or ``shard_map`` each device sees only its own gradients:
    pass ``axis_name`` so that an overflow on any device counts on all of them
    and every device keeps the same scale (``jax.jit`` over sharded arrays
    needs nothing). Give `accumulate` the same ``axis_name``, so that the
    devices also agree on skipping.

    Args:
      fun: the loss, ``fun(*args, **kwargs) -> value`` (or ``(value, aux)``
        with ``has_aux``), computed in the precision you want, e.g. fp16.
      argnums: which positional argument(s) of ``fun`` to differentiate.
      has_aux: whether ``fun`` returns ``(value, aux)``.
      axis_name: the mapped axis over which devices agree on ``finite``
        (one scalar all-reduce per call), or None.

    Returns:
      ``g(loss_scale, *args, **kwargs) -> ScaledGrads(value, grads,
      loss_scale, finite)``; ``loss_scale`` is any object with ``scale``,
      ``unscale`` and ``adjust(finite)``, such as ``jmp.DynamicLossScale``.

    Raises:
      TypeError: if ``fun`` is not callable, ``argnums`` is not an int or a
        sequence of ints, ``has_aux`` is not a bool, or (when called)
        ``loss_scale`` lacks one of the three methods.

    Examples:
      >>> import jax.numpy as jnp, jmp, optax_accum
      >>> def loss_fn(w, x):  # computed in fp16
      ...     return jnp.sum((w.astype(jnp.float16) * x) ** 2).astype(jnp.float32)
      >>> grad_fn = optax_accum.scaled_value_and_grad(loss_fn)
      >>> scale = jmp.DynamicLossScale(jnp.float32(2.0**10))
      >>> x = jnp.array([1.0, 2.0], jnp.float16)
      >>> out = grad_fn(scale, jnp.array([1.0, 1.0]), x)
      >>> out.grads, bool(out.finite), float(out.loss_scale.loss_scale)
      (Array([2., 8.], dtype=float32), True, 1024.0)
      >>> out = grad_fn(scale, jnp.array([1.0, 1.0]), 100 * x)  # overflows
      >>> bool(out.finite), float(out.loss_scale.loss_scale)
      (False, 512.0)
    """
    if not callable(fun):
        raise TypeError(f"`fun` must be callable, got {fun!r}.")
    if isinstance(argnums, bool) or not (
        isinstance(argnums, int)
        or (
            isinstance(argnums, Sequence)
            and argnums
            and all(isinstance(a, int) and not isinstance(a, bool) for a in argnums)
        )
    ):
        raise TypeError(
            "`argnums` must be an int or a non-empty sequence of ints, "
            f"got {argnums!r}."
        )
    if not isinstance(has_aux, bool):
        raise TypeError(f"`has_aux` must be a bool, got {has_aux!r}.")
    argnums = argnums if isinstance(argnums, int) else tuple(argnums)

    def scaled_grad(loss_scale: Any, *args: Any, **kwargs: Any) -> ScaledGrads:
        missing = [m for m in _LOSS_SCALE_METHODS if not hasattr(loss_scale, m)]
        if missing:
            raise TypeError(
                "`loss_scale` must have `scale`, `unscale` and `adjust` methods "
                f"(such as jmp.DynamicLossScale); {loss_scale!r} lacks {missing}."
            )

        def scaled(*args, **kwargs):
            out = fun(*args, **kwargs)
            return loss_scale.scale(out[0] if has_aux else out), out

        grads, value = jax.grad(scaled, argnums, has_aux=True)(*args, **kwargs)
        grads = loss_scale.unscale(grads)
        finite = _all_finite(grads)
        if axis_name is not None:
            overflows = jnp.logical_not(finite).astype(jnp.int32)
            finite = jax.lax.psum(overflows, axis_name) == 0
        return ScaledGrads(value, grads, loss_scale.adjust(finite), finite)

    return scaled_grad
