# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`dp_accumulate`: sum clipped gradients over a window, noise it once.

Built on `accumulate` in sum mode, with the Gaussian mechanism (`_noise`) as
the first step of the inner chain. So the schedule of windows, ``close_window``,
the reduction over devices before the boundary, the single ``lax.cond`` and the
exact zeros of hold steps are the core's (`sum_and_clear`: its boundary
branch also zeroes the window's sums, so nothing un-noised outlives a
window). This module adds the noise, keeps the window in at least float32,
and refuses what would break the privacy accounting: a ``weight``, or an
accumulating wrapper around it.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax

from .. import _checks, _dtypes, _schedules
from .._accumulate import Engine, sum_and_clear
from .._typing import AccumulatorDType, AxisName
from . import _checks as _privacy_checks
from ._noise import add_noise, refuse_shared_key_under_vmap


def dp_accumulate(
    inner: optax.GradientTransformation,
    every_k: _schedules.EveryK,
    *,
    l2_clip_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    key: jax.typing.ArrayLike,
    axis_name: AxisName | None = None,
    accumulator_dtype: AccumulatorDType = "promote",
) -> optax.GradientTransformationExtraArgs:
    r"""DP-SGD's aggregation: sum clipped gradients, add noise once, normalise.

    Each call's gradients are a sum of per-example gradients clipped to
    ``l2_clip_norm`` (`clipped_value_and_grad`'s). They are summed over the
    window's calls; when the window closes, Gaussian noise is added once to
    every element of the sum and it is divided by the expected batch size,
    then ``inner`` runs on it:

    .. math::

        \tilde g = \frac{1}{B}\Bigl(\sum_{\text{calls}} \sum_e
            \mathrm{clip}(g_e, C) + \mathcal{N}(0, \sigma^2 C^2 I)\Bigr)

    with :math:`\sigma` = ``noise_multiplier``, :math:`C` = ``l2_clip_norm``
    and :math:`B` = ``expected_batch_size``. A complex entry is two real
    coordinates, as the clip measures it: its real and imaginary parts each
    get noise of standard deviation :math:`\sigma C`. Divide by the
    *expected* batch size (``sampling_rate * num_examples`` under Poisson
    sampling): dividing by the realised size would leak it.

    Hold steps emit exact zeros and draw no noise. The key lives in the state
    (`DPNoiseState`): the same key and data give the same run, a checkpoint
    resumes it bit for bit, and window ``t`` draws from ``fold_in(key, t)``,
    so every window's noise is fresh and does not depend on how the window was
    split into calls.

    **Clipping cannot be checked.** This transformation trusts that its input
    is a sum of gradients each clipped to ``l2_clip_norm``: nothing in a sum
    shows whether its terms were clipped, so un-clipped gradients give noise
    of the right scale and no privacy. Compute them with
    `clipped_value_and_grad` with the same ``l2_clip_norm``.

    **Dtypes.** The window is summed, noised and divided in at least float32,
    whatever the gradients' dtype and ``accumulator_dtype``: a narrower
    accumulator (or ``None``) is taken as ``"promote"``, and bf16 or fp16
    gradients are cast to float32 before they are summed. A sum rounded to
    bf16 would move by more than ``C`` when one example changes (issue 39:
    1024 vs 1020 for two windows whose exact sums differ by 0.25).
    `clipped_value_and_grad` returns its sums in float32 already. The updates
    are float32 (float64 or complex where the gradients are) and
    ``optax.apply_updates`` casts them to the parameters' dtype.

    **Devices.** With ``axis_name`` (inside ``shard_map`` or ``pmap``), each
    device sums its own examples and the sums are reduced over devices before
    the noise, which is drawn once, from the same key on every device: its
    variance does not grow with the device count and replicated parameters
    stay identical everywhere (keep the state across calls with
    ``optax_accum.state_specs``). In a global-view ``jit`` on a mesh the
    gradients arrive reduced and the same holds. Sharded parameters (FSDP):
    the noise is drawn in each parameter's sharding, shard by shard, without
    a gather, and equals the one-device noise for the same key.

    ``update`` takes ``close_window`` (as `accumulate`: the window closes
    early, e.g. an epoch's last, partial logical batch) and forwards other
    extra args to ``inner``. It takes no ``weight``: the clipped sums are
    already sums over examples, and weighting a call would change the
    sensitivity.

    Args:
      inner: the optimizer to run on the noised, normalised gradient.
      every_k: calls per window (logical batch), as `accumulate` takes it: an
        int >= 1 or a callable of the update step. With
        `clipped_value_and_grad`'s ``num_microbatches`` covering the logical
        batch in one call, pass 1 (the fused form).
      l2_clip_norm: ``C``, the clip norm the gradients were clipped to, a
        finite number > 0.
      noise_multiplier: ``sigma`` >= 0, the noise's standard deviation in
        units of ``C`` (0: no noise and no privacy, e.g. to test a pipeline).
      expected_batch_size: ``B`` >= 1, the expected number of examples per
        window.
      key: the noise key, ``jax.random.key(seed)`` (or a raw uint32 key from
        ``jax.random.PRNGKey``). Use a key of its own, not one the model also
        uses.
      axis_name: inside ``shard_map`` or ``pmap``, the mapped axis (see
        **Devices**).
      accumulator_dtype: as `accumulate`'s (``"promote"``: at least float32);
        a dtype narrower than float32, or ``None``, is taken as ``"promote"``
        (see **Dtypes**).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is
      `accumulate`'s ``AccumulateState`` with ``inner_state`` the pair
      ``(DPNoiseState, inner's state)``.

    Raises:
      ValueError: for ``l2_clip_norm`` <= 0 or not finite, a negative or
        non-finite ``noise_multiplier``, ``expected_batch_size`` < 1, a batch
        of keys, ``every_k`` < 1, or a ``weight`` passed to ``update``.
      TypeError: for an ``inner`` that is not an optimizer, a ``key`` that is
        not a PRNG key, or any option that is not a number.

    At ``init``, a ValueError if an accumulating wrapper
    (``optax.MultiSteps``, `accumulate`, `MultiSteps`) holds this
    transformation: it would average or sum noised windows; or if ``inner``
    reads ``value`` (the loss, which would reach it without noise).

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> from optax_accum import privacy
      >>> tx = privacy.dp_accumulate(
      ...     optax.sgd(1.0), 2, l2_clip_norm=1.0, noise_multiplier=0.0,
      ...     expected_batch_size=4, key=jax.random.key(0))
      >>> params = {"w": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> u, state = tx.update({"w": jnp.array([1.0, 2.0])}, state, params)
      >>> u["w"]  # a hold step
      Array([0., 0.], dtype=float32)
      >>> u, state = tx.update({"w": jnp.array([1.0, 2.0])}, state, params)
      >>> u["w"]  # -(sum of the window) / 4
      Array([-0.5, -1. ], dtype=float32)

      The fused form in a Flax nnx step: the logical batch of 32 clipped in 4
      micro-batches of 8, noised once, in one compiled step.

      >>> from flax import nnx
      >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
      >>> tx = privacy.dp_accumulate(
      ...     optax.adam(1e-3), 1, l2_clip_norm=1.0, noise_multiplier=1.1,
      ...     expected_batch_size=32, key=jax.random.key(0))
      >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> @nnx.jit
      ... def train_step(model, optimizer, x, y):
      ...     graphdef, params, rest = nnx.split(model, nnx.Param, ...)
      ...     def loss_fn(params, x, y):  # x, y: one example, as a batch of one
      ...         pred = nnx.merge(graphdef, params, rest)(x)
      ...         return jnp.mean((pred - y) ** 2)
      ...     vg = privacy.clipped_value_and_grad(
      ...         loss_fn, 1.0, 4, batch_argnums=(1, 2))
      ...     loss, grads = vg(params, x, y)
      ...     optimizer.update(model, grads)
      ...     return loss
      >>> loss = train_step(model, optimizer, jnp.ones((32, 3)), jnp.zeros((32, 1)))
    """
    _checks.optimizer(inner, "inner")
    c = _privacy_checks.clip_norm(l2_clip_norm)
    sigma = _privacy_checks.noise_multiplier(noise_multiplier)
    b = _privacy_checks.expected_batch_size(expected_batch_size)
    key_data, impl = _privacy_checks.prng_key(key)
    mechanism = add_noise(sigma * c, b, key_data, impl)
    # The boundary branch zeroes the window's sums: after it, nothing un-noised
    # stays in the state (or a checkpoint of it).
    tx = sum_and_clear(
        optax.chain(mechanism, inner),
        every_k,
        accumulator_dtype=_at_least_float32(accumulator_dtype),
        axis_name=axis_name,
    )

    def update_fn(
        grads: optax.Updates,
        state: Any,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, Any]:
        if "weight" in extra_args:
            raise ValueError(
                "`dp_accumulate` takes no `weight`: its input is a sum of "
                "clipped per-example gradients, and weighting it would change "
                f"the sensitivity; got weight={extra_args['weight']!r}. Mark "
                "padding rows with clipped_value_and_grad's `example_mask_fn`."
            )
        refuse_shared_key_under_vmap(grads, state.inner_state[0].key)
        return tx.update(_widened(grads), state, params, **extra_args)

    def init_fn(params: optax.Params) -> Any:
        _refuse_accumulating_wrappers(sys._getframe(1))
        state = tx.init(params)
        if jax.tree.leaves(state.value_accumulator):
            raise ValueError(
                "`inner` reads `value` (the loss: `reduce_on_plateau`, a line "
                "search): `dp_accumulate` would hand it the window's loss "
                "without noise, and the updates would then depend on the "
                "un-noised training data. Use an inner optimizer that reads "
                "gradients only."
            )
        return state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _refuse_accumulating_wrappers(frame: Any) -> None:
    """No accumulator around `dp_accumulate` (issue 39, finding 8).

    ``optax.MultiSteps(dp_accumulate(...), 2)`` or ``accumulate(dp_accumulate(
    ...), 2)`` average or sum noised windows: a mechanism the accounting does
    not describe. The wrapper calls this ``init`` from its own, so it is
    found among the callers: an ``optax.MultiSteps`` (optax's class, which
    cannot be asked) or the core's engine (`accumulate`, `MultiSteps`).
    """
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, optax.MultiSteps | Engine):
            name = (
                "optax.MultiSteps"
                if isinstance(owner, optax.MultiSteps)
                else "optax_accum.accumulate (or optax_accum.MultiSteps)"
            )
            raise ValueError(
                f"`dp_accumulate` must not be wrapped in {name}: it closes "
                "its own windows and noises each once, and an accumulator "
                "around it would average or sum noised windows, which the "
                "privacy accounting does not describe. Give the calls of a "
                "logical batch to dp_accumulate's `every_k` instead (e.g. "
                "dp_accumulate(inner, 2 * every_k, ...))."
            )
        frame = frame.f_back


def _at_least_float32(policy: Any) -> Any:
    """``accumulator_dtype`` with every narrow (or gradient-dtype) policy
    widened: a sum rounded to bf16 or fp16 has a sensitivity above ``C``."""
    canonical = _dtypes.canonical(policy)
    if isinstance(canonical, _dtypes.PerLeaf):
        return _dtypes.PerLeaf(
            canonical.treedef, tuple(_wide(p) for p in canonical.policies)
        ).prefix()
    return _wide(canonical)


def _wide(policy: Any) -> Any:
    """A narrow or gradient-dtype policy as ``"promote"``: at least float32,
    of each gradient's own kind (complex stays complex)."""
    if policy is None or isinstance(policy, str) or _dtypes.is_narrow(policy):
        return _dtypes.PROMOTE
    return policy


def _widened(grads: optax.Updates) -> optax.Updates:
    """bf16 and fp16 gradients as float32 (exact), so that the window's sum
    reaches the noise in float32, not cast back to the gradients' dtype."""

    def widen(g):
        if _dtypes.is_float0(g):
            return g
        return g.astype(jnp.promote_types(g.dtype, jnp.float32))

    return jax.tree.map(widen, grads)
