# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`microbatch_value_and_grad`: the loss face of `microbatch`.

`microbatch` takes a value-and-grad function and uses its gradients as they
come. This face takes the loss and differentiates it itself, like
`jax.value_and_grad`, so it may do what `microbatch` must not: start each
micro-batch's backward pass from its weight, so that the loop adds weighted
gradients with a plain add and an accelerator's compiler can move their
reduction over the data axes out of the loop. The loop is `microbatch`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._typing import Unpack
from ._keywords import MicrobatchKeywords, takes_keywords
from ._microbatch import _microbatched
from ._options import check_callable, options


@takes_keywords
def microbatch_value_and_grad(
    loss: Callable[..., Any],
    num_microbatches: int,
    *,
    argnums: int | Sequence[int] = 0,
    **kwargs: Unpack[MicrobatchKeywords],
) -> Callable[..., Any]:
    r"""`jax.value_and_grad` of ``loss`` over micro-batches, in one `lax.scan`.

    The result has ``jax.value_and_grad(loss, argnums, has_aux)``'s signature
    and output, ``(value, grads)`` or ``((value, aux), grads)``, and equals
    ``microbatch(jax.value_and_grad(loss, argnums, has_aux), ...)`` with the
    same options (see `microbatch` for the split into micro-batches, weights,
    reductions, sharding, keys and the noise scale).

    The difference is where a weight goes. Here the library owns the
    differentiation, so in the global view with ``weight_fn`` it starts each
    micro-batch's backward pass from that micro-batch's share of the weight
    instead of 1: the gradients come out weighted and enter the loop's
    buffers through a plain add, which is the pattern an accelerator's
    compiler needs to move the data-parallel reduction of the gradients out
    of the loop, once per step (`microbatch` weighs a value-and-grad
    function's gradients after it, and that reduction stays in the loop).

    **Precision.** Weighting inside the backward pass rounds each weighted
    gradient to the gradients' dtype once more, before accumulation: with
    bf16 gradients, token weights and ``k = 1024``, the mean's relative error
    is 0.0043 against 0.0039 for the unweighted path, whose only rounding is
    the output's. The weight itself enters as a cotangent of the loss's
    dtype, so a bf16 loss rounds it to bf16; return a float32 loss to keep
    the weights exact.

    Args:
      loss: ``loss(*args) -> value`` (or ``(value, aux)`` with ``has_aux``),
        a real floating scalar.
      num_microbatches: ``k``, an int >= 1; it must divide the batch size.
      argnums: as in `jax.value_and_grad`: the argument(s) to differentiate
        (an int gives their gradients, a tuple a tuple of them). They must
        not hold the batch or keys.
      {keywords}

    Returns:
      A function with ``loss``'s arguments that returns what
      ``jax.value_and_grad(loss, argnums, has_aux)`` would for the whole batch.

    Raises:
      ValueError: as `microbatch`, and for ``argnums`` naming a batch or key
        argument.
      TypeError: as `microbatch`; at trace time for a loss that is not a real
        floating scalar, or differentiated arguments with integer leaves.

    Examples:
      >>> import jax, jax.numpy as jnp, optax_accum
      >>> loss = lambda w, x: jnp.sum(x * w) / jnp.sum(x > 0)
      >>> vg = optax_accum.microbatch_value_and_grad(
      ...     loss, 2, weight_fn=lambda x: jnp.sum(x > 0))
      >>> x = jnp.array([2.0, 0.0, 4.0, 6.0])  # micro-batches [2, 4], [0, 6]
      >>> print(*vg(jnp.float32(1.0), x))  # (2 * 3 + 1 * 6) / 3 tokens
      4.0 4.0
      >>> print(*jax.value_and_grad(loss)(jnp.float32(1.0), x))
      4.0 4.0
    """
    check_callable(loss)
    opts = options(
        num_microbatches,
        argnums=argnums,
        face="microbatch_value_and_grad",
        **kwargs,
    )
    return _microbatched(loss, opts)


def value_and_grad_with_state(
    loss: Callable[..., Any], num_microbatches: int, **kwargs: Any
) -> Callable[..., Any]:
    """`microbatch_value_and_grad` that threads a ``state`` (as
    `microbatch_with_state`): ``loss(*args, state=state)`` returns
    ``(value, new_state)`` (``((value, aux), new_state)`` with ``has_aux``);
    the result is called as ``f(*args, state=state)`` and returns
    ``(((value, aux), grads), final_state)``. The Flax helpers use it."""
    check_callable(loss)
    kwargs.setdefault("argnums", 0)
    opts = options(
        num_microbatches, stateful=True, face="value_and_grad_with_state", **kwargs
    )
    return _microbatched(loss, opts)
