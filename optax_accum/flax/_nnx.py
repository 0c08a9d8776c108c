# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""How `nnx_train_step` takes an nnx model apart and puts it back.

The model splits into what the optimizer trains (its ``wrt`` filter, the only
part differentiated), the other Params (read-only inputs, never
differentiated), and the state the forward pass threads from micro-batch to
micro-batch (BatchNorm statistics, Rngs counters). Values sown with
``self.sow(nnx.Intermediate, ...)`` leave each micro-batch as outputs and come
back stacked; on the devices of ``data_axes`` the Rngs keys are folded with
the device index. The step itself is `optax_accum.flax.nnx_train_step`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from flax import nnx
from jax import lax

from .. import _sharding


class Parts(NamedTuple):
    """An nnx model taken apart by `split`."""

    wrt: Any  # the optimizer's filter
    graphdef: Any
    trained: Any  # nnx.State of the optimizer's `wrt` Variables
    frozen: Any  # nnx.State of the other Params
    state: Any  # nnx.State of everything else


def check_arguments(model: Any, optimizer: Any) -> None:
    """The step's ``(model, optimizer, *batch)``, in that order.

    Raises:
      TypeError: if ``optimizer`` is not an ``nnx.Optimizer``, or ``model``
        is one (the two swapped).
    """
    order = "The step is called as `step(model, optimizer, *batch)`"
    if isinstance(model, nnx.Optimizer) or not isinstance(optimizer, nnx.Optimizer):
        swapped = isinstance(model, nnx.Optimizer)
        raise TypeError(
            "nnx_train_step's step got "
            + (
                f"`model` = an nnx.Optimizer and `optimizer` = "
                f"{type(optimizer).__name__}: the two are swapped. "
                if swapped
                else f"`optimizer` = {type(optimizer).__name__}, not an nnx.Optimizer. "
            )
            + order
            + "."
        )


def split(model: Any, wrt: Any) -> Parts:
    """``model`` in its `Parts`; a model still holding sown intermediates
    from an earlier call is refused (each step would append to them)."""
    sown = nnx.state(model, nnx.Intermediate)
    if jax.tree.leaves(sown):
        raise ValueError(
            "nnx_train_step got a model that holds nnx.Intermediate values "
            f"(sown earlier: {sorted(_paths(sown))}). Take them out before the "
            "step, e.g. `nnx.pop(model, nnx.Intermediate)` after each step; "
            "the step writes back the values sown during it, stacked per "
            "micro-batch."
        )
    return Parts(wrt, *nnx.split(model, wrt, nnx.Param, ...))


def _paths(state: Any) -> list[str]:
    return [".".join(map(str, path)) for path, _ in nnx.to_flat_state(state)]


def run(
    parts: Parts, trained: Any, frozen: Any, state: Any, call: Any, data_axes: Any
) -> tuple:
    """``call(model)`` on the model rebuilt from its parts (fresh Variables);
    returns ``(call's output, sown intermediates, new state)``."""
    model = nnx.merge(
        parts.graphdef, trained, frozen, _per_device(state, data_axes), copy=True
    )
    out = call(model)
    sown = nnx.pop(model, nnx.Intermediate)
    new_state = nnx.split(model, parts.wrt, nnx.Param, ...)[3]
    return out, sown, _keys_from(state, new_state)


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _per_device(state: Any, data_axes: Any) -> Any:
    """``state`` with each PRNG key folded with the device index on the
    devices of ``data_axes``, so that devices draw their own masks."""
    if not _sharding.is_manual(data_axes):  # not in a device-local loop
        return state
    device = lax.axis_index(data_axes)
    return jax.tree.map(
        lambda x: jax.random.fold_in(x, device) if _is_key(x) else x, state
    )


def _keys_from(old: Any, new: Any) -> Any:
    """``new`` with ``old``'s PRNG keys: the folded keys stay in the trace."""
    return jax.tree.map(lambda o, n: o if _is_key(o) else n, old, new)


class CallRngs:
    """The step's call-time ``nnx.Rngs`` (or ``RngStream``) arguments, as the
    Flax NNX tutorial passes them (``loss_fn(model, rngs, batch)``, its
    Dropout layers holding no Rngs). They are no batch: their state (keys
    and counters) is threaded from micro-batch to micro-batch, so that
    micro-batch ``i`` draws what the ``i``-th of k small steps with the same
    Rngs would, and their counters advance as over those k steps."""

    def __init__(self, batch: tuple):
        self.where = [j for j, a in enumerate(batch) if _is_rngs(a)]
        self.objects = [batch[j] for j in self.where]
        self.arrays = tuple(a for j, a in enumerate(batch) if j not in self.where)
        split = [nnx.split(r) for r in self.objects]
        self.graphdefs = [g for g, _ in split]
        self.initial = tuple(nnx.as_pure(s) for _, s in split)

    def merge(self, states: tuple, data_axes: Any) -> list:
        """Fresh Rngs inside the trace (on ``data_axes``' devices, with
        keys folded with the device index, as the model's)."""
        return [
            nnx.merge(g, _per_device(s, data_axes), copy=True)
            for g, s in zip(self.graphdefs, states, strict=True)
        ]

    def batch(self, arrays: tuple, rngs: list) -> list:
        """``loss_fn``'s batch arguments: the arrays with the Rngs in place."""
        full, it, r = [], iter(arrays), iter(rngs)
        for j in range(len(arrays) + len(rngs)):
            full.append(next(r) if j in self.where else next(it))
        return full

    def state(self, old: tuple, rngs: list) -> tuple:
        """The Rngs' state after ``loss_fn``; keys as they came in."""
        return tuple(
            _keys_from(o, nnx.as_pure(nnx.state(r)))
            for o, r in zip(old, rngs, strict=True)
        )

    def update(self, states: tuple) -> None:
        for r, s in zip(self.objects, states, strict=True):
            nnx.update(r, s)


def _is_rngs(x: Any) -> bool:
    return isinstance(x, nnx.Rngs | nnx.RngStream)
