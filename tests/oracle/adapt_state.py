# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""A `state_cells.StateCell` end to end: a run broken by a restore.

The face runs the cell's calls with ``offload(inner)``; after call ``k + 1``
(the middle of the second window; the first of the fused step's two calls)
its state comes back as the cell says (`arrive`) and the run continues. The
same face with the plain ``inner`` runs the calls without a break. Every
call's updates, and the final state, must be equal bit for bit; the state's
leaves must arrive in the cell's memory kind, and leave every later call in
host memory (PRNG keys stay in device memory, as `offload` documents). On
the per-call faces, SGD and Adam also equal the float64 model.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import optax_accum

from . import compare, data, expect
from . import runtime as rt
from .state_cells import MODEL_FAMILIES, StateCell

LR = 0.1
WRITTEN_LR = 0.05  # the ``inject`` family's hyperparameter written at the break


def _adam() -> optax.GradientTransformation:
    return optax.adam(LR, eps=1e-4)  # as `model.Adam`


def inner(family: str, offloaded: bool) -> optax.GradientTransformation:
    """The family's optimizer, its state kept by `offload` or not."""
    off = optax_accum.offload if offloaded else (lambda tx: tx)
    if family == "apply_if_finite":  # a jnp.where outside offload
        return optax.apply_if_finite(off(_adam()), 2)
    return off(
        {
            "sgd": lambda: optax.sgd(0.5),
            "adam": _adam,
            "masked": lambda: optax.masked(_adam(), {"w": True, "b": False}),
            "multi_transform": lambda: optax.multi_transform(
                {"a": _adam(), "b": optax.sgd(0.5, momentum=0.9)}, {"w": "a", "b": "b"}
            ),
            "add_noise": lambda: optax.chain(optax.add_noise(0.01, 0.55, 0), _adam()),
            "inject": lambda: optax.inject_hyperparams(optax.adam)(
                learning_rate=LR, eps=1e-4
            ),
        }[family]()
    )


def _tx(cell: StateCell, offloaded: bool) -> Any:
    opt = inner(cell.family, offloaded)
    if cell.face == "accumulate":
        return optax_accum.accumulate(opt, cell.k)
    if cell.face == "multisteps":
        return optax_accum.MultiSteps(opt, cell.k).gradient_transformation()
    return opt


def _loss(cell: StateCell):
    """The oracle's loss of ``w`` (its gradient the model's), and a term in
    ``b`` so that the masked parameter has a gradient of its own."""
    loss_w = rt.loss(cell.base())

    def loss(p, c, m):
        return loss_w(p, c, m) + 0.5 * jnp.sum(m * (c @ p["b"])) / jnp.sum(m)

    return loss


def _step(cell: StateCell, tx):
    loss = _loss(cell)
    if cell.stream:

        def step(params, state, c, m):
            updates, state = tx.update(jax.grad(loss)(params, c, m), state, params)
            return params, updates, state

    else:
        grad_fn = optax_accum.microbatch_value_and_grad(
            loss, cell.k, batch_argnums=(1, 2)
        )

        def step(params, state, c, m):
            _, grads = grad_fn(params, c, m)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), updates, state

    return jax.jit(step)


def _inner_state(cell: StateCell, state: Any) -> Any:
    """The inner optimizer's state (the fused step's is the whole state)."""
    if cell.face == "accumulate":
        return state.inner_state
    return state.inner_opt_state if cell.face == "multisteps" else state


def _offloaded(cell: StateCell, state: Any) -> Any:
    """The part of it `offload` keeps (``apply_if_finite``'s counters are
    its own, outside `offload`)."""
    state = _inner_state(cell, state)
    return state.inner_state if cell.family == "apply_if_finite" else state


def _kinds(cell: StateCell, state: Any) -> set[str]:
    """The memory kinds of the offloaded leaves, keys left out (SGD has
    none)."""
    return {
        x.sharding.memory_kind
        for x in jax.tree.leaves(_offloaded(cell, state))
        if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    }


def arrive(cell: StateCell, tx, params, state, directory: Path) -> Any:
    """The state as the next call gets it: kept, moved or restored."""
    if cell.restore == "none":
        if cell.memory == "device":  # a user's device_put
            return jax.device_put(state, jax.memory.Space.Device)
        return state
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / "state", state)
    if cell.restore == "eval_shape":
        target = jax.eval_shape(tx.init, params)
    else:
        shardings = optax_accum.state_shardings(tx, params)
        if cell.memory == "device":
            shardings = jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            jax.eval_shape(tx.init, params),
            shardings,
        )
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(directory / "state", target)


def _write_hyperparameter(cell: StateCell, state: Any) -> None:
    if cell.family == "inject":  # in device memory, whatever the state's
        _inner_state(cell, state).hyperparams["learning_rate"] = jnp.float32(WRITTEN_LR)


def _run(cell: StateCell, inputs: data.Inputs, params, offloaded: bool) -> dict:
    base = cell.base()
    tx = _tx(cell, offloaded)
    step = _step(cell, tx)
    state = tx.init(params)
    cut = cell.k + 1 if cell.stream else 1
    updates = []
    with tempfile.TemporaryDirectory() as directory:
        for t in range(len(inputs.m)):
            if t == cut:
                if offloaded:
                    state = arrive(cell, tx, params, state, Path(directory))
                    assert _kinds(cell, state) <= {cell.memory}, (
                        f"arrived in {_kinds(cell, state)}, the cell says {cell.memory}"
                    )
                _write_hyperparameter(cell, state)
            c = rt.place(base, inputs.c[t], jnp.float32, rows=True)
            m = rt.place(base, inputs.m[t], jnp.float32, rows=True)
            params, u, state = step(params, state, c, m)
            if offloaded:
                assert _kinds(cell, state) <= {"pinned_host"}, (
                    f"call {t}: the state left in {_kinds(cell, state)}"
                )
            updates.append(u)
    return {"updates": updates, "state": state, "params": params}


def _leaves(tree: Any) -> list[np.ndarray]:
    out = []
    for x in jax.tree.leaves(tree):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.asarray(x))
    return out


def run(cell: StateCell) -> None:
    """Asserts the cell's contract (see the module docstring)."""
    base = cell.base()
    inputs = data.build(base)
    with rt.context(base):
        w0 = rt.place(base, inputs.w0, jnp.float32, rows=False)
        params = {"w": w0, "b": jnp.zeros_like(w0)}
        got = _run(cell, inputs, params, offloaded=True)
        want = _run(cell, inputs, params, offloaded=False)
    for a, b in zip(_leaves(got), _leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    if cell.stream and cell.family in MODEL_FAMILIES:
        model = expect.stream(base, inputs)["updates"]
        updates = np.stack([rt.to_np(u["w"]) for u in got["updates"]])
        compare.close(updates, model, compare.rtol(base), "updates")
