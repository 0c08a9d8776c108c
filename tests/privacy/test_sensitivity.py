# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The invariant a DP step rests on, as a property: removing one example
moves what the noise is added to by at most C, and replacing one by at most
2 C, on every path.

Hypothesis draws the path (one fused call, one call per micro-batch,
``shard_map`` over 2 devices with ``axis_name``, or the global view with the
rows sharded over an Explicit or an Auto mesh's data axis), the parameters'
dtype (float32, bf16, fp16, complex64), ``accumulator_dtype``, the inner
optimizer (``sgd``, or ``offload(sgd)``), the micro-batches, the data's scale,
the neighbour (one example removed, masked out, or replaced) and which. With
``sigma = 0``, ``B = 1`` and ``sgd(1.0)``, the update is minus the window's
sum, so the property reads it directly (issue 39, item 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import privacy

C, ROWS, DIM = 1.0, 8, 3
DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "complex64": jnp.complex64,
}
ACCUMULATORS = {"promote": "promote", "none": None, "bfloat16": jnp.bfloat16}


def _loss(params, x, y, mask):
    del mask
    r = x @ params["w"] + params["b"] - y
    return 0.5 * jnp.mean(jnp.real(r * jnp.conj(r)))


def _clipped(k):
    return privacy.clipped_value_and_grad(
        _loss, C, k, batch_argnums=(1, 2, 3), example_mask_fn=lambda x, y, m: m
    )


INNERS = {
    "sgd": lambda: optax.sgd(1.0),
    "offload": lambda: optax_accum.offload(optax.sgd(1.0)),
}


def _tx(every_k, accumulator, axis_name=None, inner="sgd"):
    return privacy.dp_accumulate(
        INNERS[inner](), every_k, l2_clip_norm=C, noise_multiplier=0.0,
        expected_batch_size=1.0, key=jax.random.key(0),
        accumulator_dtype=ACCUMULATORS[accumulator], axis_name=axis_name,
    )  # fmt: skip


def _window_sum(path, k, accumulator, inner, params, x, y, mask):
    """Minus the update: the window's clipped sum, as the noise sees it."""
    if path == "fused":
        tx = _tx(1, accumulator, inner=inner)
        u, _ = tx.update(_clipped(k)(params, x, y, mask)[1], tx.init(params), params)
    elif path in ("explicit", "auto"):
        u = _global_view_window(path, k, accumulator, inner, params, x, y, mask)
    elif path == "per_call":
        tx, state = _tx(k, accumulator, inner=inner), None
        state = tx.init(params)
        for xs, ys, ms in zip(*(np.split(a, k) for a in (x, y, mask)), strict=True):
            u, state = tx.update(_clipped(1)(params, xs, ys, ms)[1], state, params)
    else:
        u = _shard_map_window(k, accumulator, params, x, y, mask)
    return jax.tree.map(lambda a: -np.asarray(a, np.complex128), u)


def _global_view_window(path, k, accumulator, inner, params, x, y, mask):
    """One fused call in the global view, the rows sharded over ``d``."""
    kind = jax.sharding.AxisType.Explicit if path == "explicit" else None
    kind = kind or jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2], axis_types=(kind,))
    tx = _tx(1, accumulator, inner=inner)
    rows = NamedSharding(mesh, P("d"))
    with jax.set_mesh(mesh):
        x, y, mask = (jax.device_put(a, rows) for a in (x, y, mask))
        state = tx.init(params)
        step = jax.jit(
            lambda p, s, x, y, m: tx.update(_clipped(k)(p, x, y, m)[1], s, p)
        )
        return step(params, state, x, y, mask)[0]


def _shard_map_window(k, accumulator, params, x, y, mask):
    mesh = jax.make_mesh((2,), ("d",))
    tx = _tx(1, accumulator, axis_name="d")
    specs = optax_accum.state_specs(jax.eval_shape(tx.init, params), "d")
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
    vg = _clipped(max(1, k // 2))

    def step(p, s, x, y, m):
        return tx.update(vg(p, x, y, m)[1], s, p)[0]

    run = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), specs, P("d"), P("d"), P("d")),
            out_specs=P(),
        )
    )  # fmt: skip
    put = functools.partial(jax.device_put, device=NamedSharding(mesh, P("d")))
    return run(params, jax.jit(init)(params), put(x), put(y), put(mask))


PATHS = ["fused", "per_call", "shard_map", "explicit", "auto"]


@st.composite
def cases(draw):
    return dict(
        path=draw(
            st.sampled_from(["fused", "per_call", "shard_map", "explicit", "auto"])
        ),
        inner=draw(st.sampled_from(sorted(INNERS))),
        neighbour=draw(st.sampled_from(["remove", "replace"])),
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        accumulator=draw(st.sampled_from(sorted(ACCUMULATORS))),
        k=draw(st.sampled_from([1, 2, 4])),
        scale=draw(st.sampled_from([0.1, 1.0, 100.0])),
        removed=draw(st.integers(0, ROWS - 1)),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=30, deadline=None)
@given(cases())
def test_a_neighbouring_data_set_moves_the_window_sum_by_at_most_its_bound(case):
    rng = np.random.default_rng(case["seed"])
    dtype = DTYPES[case["dtype"]]
    x = jnp.asarray(rng.normal(size=(ROWS, DIM)) * case["scale"], dtype)
    y = jnp.asarray(rng.normal(size=(ROWS,)) * case["scale"], dtype)
    params = {
        "w": jnp.asarray(rng.normal(size=(DIM,)), dtype),
        "b": jnp.asarray(0.5, dtype),
    }
    mask = np.ones(ROWS, bool)
    args = (case["path"], case["k"], case["accumulator"], case["inner"], params)
    a = _window_sum(*args, x, y, jnp.asarray(mask))
    if case["neighbour"] == "remove":  # add/remove: the example masked out
        neighbour = mask.copy()
        neighbour[case["removed"]] = False
        b = _window_sum(*args, x, y, jnp.asarray(neighbour))
        bound = C
    else:  # replace-one: another example in its row
        other = jnp.asarray(rng.normal(size=(DIM,)) * case["scale"] * 3, dtype)
        b = _window_sum(*args, x.at[case["removed"]].set(other), y, jnp.asarray(mask))
        bound = 2 * C
    moved = np.sqrt(
        sum(np.sum(np.abs(u - v) ** 2) for u, v in zip(
            jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    )  # fmt: skip
    # float32 rounding of a sum of ROWS terms of norm <= C
    assert moved <= bound + 1e-5 * ROWS * C, (case, moved)
