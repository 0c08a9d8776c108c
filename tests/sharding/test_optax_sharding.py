# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""optax's own sharding tests (``optax/_src/sharding_test.py``), every optimizer
wrapped as ``accumulate(opt, 1)``, ``accumulate(opt, 2)`` and ``MultiSteps(opt, 2)``.

The state keeps its sharding types through ``init``, ``update`` and ``jit``
(stock optax skips these on jax >= 0.10: its version guard compares strings).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from tests.helpers.lanes import sweep

OPTIMIZERS = {
    "adam": lambda: optax.adam(1.0),
    "sgd": lambda: optax.sgd(1.0),
    "adabelief": lambda: optax.adabelief(1.0),
    "adamax": lambda: optax.adamax(1.0),
    "adagrad": lambda: optax.adagrad(1.0),
    "adamw": lambda: optax.adamw(1.0),
    "rmsprop": lambda: optax.rmsprop(1.0),
    "lbfgs": lambda: optax.lbfgs(1.0, linesearch=None),
    "adadelta": lambda: optax.adadelta(1.0),
    "adafactor": lambda: optax.adafactor(),
    "adafactor2": lambda: optax.adafactor(min_dim_size_to_factor=1),
    "adan": lambda: optax.adan(1.0),
    "adamaxw": lambda: optax.adamaxw(1.0),
    "amsgrad": lambda: optax.amsgrad(1.0),
    "fromage": lambda: optax.fromage(1.0),
    "lamb": lambda: optax.lamb(1.0),
    "lars": lambda: optax.lars(1.0),
    "lion": lambda: optax.lion(1.0),
    "nadam": lambda: optax.nadam(1.0),
    "nadamw": lambda: optax.nadamw(1.0),
    "noisy_sgd": lambda: optax.noisy_sgd(1.0),
    "novograd": lambda: optax.novograd(1.0),
    "optimistic_gradient_descent": lambda: optax.optimistic_gradient_descent(1.0),
    "radam": lambda: optax.radam(1.0),
    "sm3": lambda: optax.sm3(1.0),
    "yogi": lambda: optax.yogi(1.0),
}

# optax.lbfgs itself fails here (it ravels the sharded parameters with a
# reshape that Explicit sharding refuses), wrapped or not.
_XFAIL = {
    "lbfgs": pytest.mark.xfail(
        strict=True, reason="optax.lbfgs alone rejects these sharded params"
    )
}


def _cases(names):
    return [pytest.param(n, marks=_XFAIL.get(n, ())) for n in names]


WRAPPERS = {
    "accumulate1": lambda opt: optax_accum.accumulate(opt, 1),
    "accumulate2": lambda opt: optax_accum.accumulate(opt, 2),
    "MultiSteps2": lambda opt: optax_accum.MultiSteps(opt, 2),
}


def test_lbfgs_fails_unwrapped_too():
    mesh, sharding = _params()
    with jax.set_mesh(mesh):
        params = jnp.zeros((2, 8, 4), dtype=jnp.float16, out_sharding=sharding)
        tx = optax.lbfgs(1.0, linesearch=None)
        with pytest.raises(Exception, match="reshape"):
            tx.update(params, tx.init(params), params)


def _type(x):
    # What a traced program's type says; a constant traced without the mesh
    # has a mesh-less replicated sharding, the same spec.
    t = jax.typeof(x)
    return t.shape, t.dtype, t.weak_type, t.sharding.spec


def _params():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    sharding = NamedSharding(mesh, P(None, "x"))
    return mesh, sharding


@pytest.mark.parametrize("wrapper", sweep(WRAPPERS, fast=["accumulate2"]))
@pytest.mark.parametrize("name", _cases(OPTIMIZERS))
def test_state_sharding_type_init_match_update(name, wrapper):
    # Types are a property of the trace: read them from an abstract run, so
    # that 78 cases compile nothing (eager against jit is the test below).
    tx = WRAPPERS[wrapper](OPTIMIZERS[name]())
    mesh, sharding = _params()
    types = []

    def steps(params):
        state0 = tx.init(params)
        _, state1 = tx.update(params, state0, params)
        _, state2 = tx.update(params, state1, params)  # through a boundary
        types.append(jax.typeof(params))
        types.extend(jax.tree.map(_type, s) for s in (state0, state1, state2))

    with jax.set_mesh(mesh):
        jax.eval_shape(
            steps, jax.ShapeDtypeStruct((2, 8, 4), jnp.float16, sharding=sharding)
        )
    param_type, state0, state1, state2 = types
    assert param_type.sharding.spec == P(None, "x", None)  # the trace saw the sharding
    chex.assert_trees_all_equal(state0, state1)
    chex.assert_trees_all_equal(state0, state2)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize(
    "name",
    sweep(_cases(["adam", "lamb", "adafactor", "sm3", "lbfgs"]), fast=["adafactor"]),
)
def test_state_sharding_type_preserved_with_jit(name, wrapper):
    tx = WRAPPERS[wrapper](OPTIMIZERS[name]())
    mesh, sharding = _params()
    with jax.set_mesh(mesh):
        params = jnp.zeros((2, 8, 4), dtype=jnp.float16, out_sharding=sharding)
        state0 = tx.init(params)
        state1 = jax.jit(tx.init)(params)
        chex.assert_trees_all_equal(
            jax.tree.map(jax.typeof, state0), jax.tree.map(jax.typeof, state1)
        )
        _, state2 = tx.update(params, state0, params)
        _, state3 = jax.jit(tx.update)(params, state0, params)
    chex.assert_trees_all_equal(
        jax.tree.map(jax.typeof, state2), jax.tree.map(jax.typeof, state3)
    )
