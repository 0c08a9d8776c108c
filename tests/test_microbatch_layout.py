# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The fused loop's convolutions on the CPU (`_microbatch._layout`), and ``unroll``.

XLA's CPU compiler lays out a convolution for its fast kernels only in the
entry computation, so a weight gradient's convolution in a loop body kept
``dim_labels=f01b_i01o->01bf`` and ran 10-20x slower (issue 33, section 7).
The loop relays them out; the gradients are those of the straight-line
program, bit for bit.
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import optax_accum
from optax_accum._microbatch import _layout

K = 4
_CANONICAL = "dim_labels=b01f_01io->b01f"


def _conv(x, w, b):
    dn = ("NHWC", "HWIO", "NHWC")
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn) + b


def _pool(x):
    return lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4


def _loss(p, x, y):
    """The Flax MNIST tutorial's CNN, small: conv, pool, conv, pool, dense."""
    h = _pool(jax.nn.relu(_conv(x, *p["c1"])))
    h = _pool(jax.nn.relu(_conv(h, *p["c2"])))
    logits = h.reshape(h.shape[0], -1) @ p["d"][0] + p["d"][1]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _setup(batch=16):
    ks = jax.random.split(jax.random.key(0), 5)
    p = {
        "c1": (jax.random.normal(ks[0], (3, 3, 1, 4)) * 0.3, jnp.zeros(4)),
        "c2": (jax.random.normal(ks[1], (3, 3, 4, 8)) * 0.2, jnp.zeros(8)),
        "d": (jax.random.normal(ks[2], (2 * 2 * 8, 3)) * 0.2, jnp.zeros(3)),
    }
    x = jax.random.normal(ks[3], (batch, 8, 8, 1))
    y = jax.random.randint(ks[4], (batch,), 0, 3)
    return p, x, y


def _unrolled(p, x, y):
    """The same k micro-batches (rows i::k), unrolled in Python: XLA sees
    every convolution in the entry computation."""
    vg = jax.value_and_grad(_loss)
    outs = [vg(p, x[i::K], y[i::K]) for i in range(K)]
    return jax.tree.map(lambda *a: sum(a) / K, *outs)


def _convolutions(fun, *args) -> list[str]:
    text = jax.jit(fun).lower(*args).compile().as_text()
    return [line for line in text.splitlines() if " convolution(" in line]


@pytest.mark.parametrize("k", [1, K])
def test_every_convolution_is_canonical_in_the_loop(k):
    # Fails before the relayout: the weight gradients' convolutions kept
    # f01b_i01o->01bf, in the loop body (k = 4) and for k = 1 too.
    p, x, y = _setup()
    fun = optax_accum.microbatch(jax.value_and_grad(_loss), k, batch_argnums=(1, 2))
    convs = _convolutions(fun, p, x, y)
    assert len(convs) >= 5  # two forward, two weight gradients, one input's
    bad = [
        re.search(r"dim_labels=\S+", c).group(0) for c in convs if _CANONICAL not in c
    ]
    assert not bad, bad


def test_k1_compiles_to_the_plain_step():
    p, x, y = _setup()
    vg = jax.value_and_grad(_loss)
    fun = optax_accum.microbatch(vg, 1, batch_argnums=(1, 2))
    # No loop in the program JAX hands XLA: a loop of one trip is removed by
    # XLA only after the convolutions' layouts are chosen.
    assert "stablehlo.while" not in jax.jit(fun).lower(p, x, y).as_text()
    chex_equal(
        optax_accum.microbatch(vg, 1, batch_argnums=(1, 2))(p, x, y), vg(p, x, y)
    )


def chex_equal(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("face", ["microbatch", "loss"])
@pytest.mark.parametrize("unroll", [1, 2, True])
def test_relaid_loop_equals_the_python_unrolled_loop_bit_for_bit(face, unroll):
    p, x, y = _setup()
    if face == "microbatch":
        fun = optax_accum.microbatch(
            jax.value_and_grad(_loss), K, batch_argnums=(1, 2), unroll=unroll
        )
    else:
        fun = optax_accum.microbatch_value_and_grad(
            _loss, K, batch_argnums=(1, 2), unroll=unroll
        )
    got = jax.jit(fun)(p, x, y)
    chex_equal(got, jax.jit(_unrolled)(p, x, y))
    # and the full batch, to float32 rounding
    want = jax.value_and_grad(_loss)(p, x, y)
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


_DNUMS = [
    # (lhs, rhs, out) specs as strings, shapes of lhs and rhs
    (("NHWC", "HWIO", "NHWC"), (2, 6, 6, 3), (3, 3, 3, 4), {}),
    (("NCHW", "OIHW", "NCHW"), (2, 3, 6, 6), (4, 3, 3, 3), {}),
    (("CHWN", "HWOI", "NHCW"), (3, 6, 5, 2), (2, 3, 4, 3), {"rhs_dilation": (2, 1)}),
    (("NWC", "WIO", "NWC"), (2, 7, 3), (3, 3, 4), {"window_strides": (2,)}),
    (("NHWC", "HWIO", "NHWC"), (2, 6, 6, 4), (3, 3, 2, 6), {"feature_group_count": 2}),
    (("NCHW", "OIHW", "CNHW"), (4, 3, 6, 6), (6, 3, 3, 3), {"batch_group_count": 2}),
]


@pytest.mark.parametrize("dnums,lhs_shape,rhs_shape,extra", _DNUMS)
def test_relaid_convolution_equals_lax(dnums, lhs_shape, rhs_shape, extra):
    lhs = jax.random.normal(jax.random.key(1), lhs_shape)
    rhs = jax.random.normal(jax.random.key(2), rhs_shape)
    n = len(lhs_shape) - 2
    kwargs = {"window_strides": (1,) * n, "padding": "SAME", **extra}

    def conv(a, b):
        return lax.conv_general_dilated(a, b, dimension_numbers=dnums, **kwargs)

    relaid = _layout.canonical_convolutions(conv)
    np.testing.assert_allclose(relaid(lhs, rhs), conv(lhs, rhs), rtol=1e-5, atol=1e-5)
    text = jax.jit(relaid).lower(lhs, rhs).as_text()
    given = lax.conv_dimension_numbers(lhs_shape, rhs_shape, dnums)
    canonical = tuple(given) == tuple(_layout.canonical(n + 2))
    assert text.count("stablehlo.transpose") == (0 if canonical else 3)


def test_relayout_leaves_python_values_static():
    # A non-array argument (a flag) must stay a Python value for `fun`.
    def f(x, training):
        assert isinstance(training, bool)
        return _conv(x, jnp.ones((3, 3, 1, 2)), 0.0) if training else x

    out = _layout.canonical_convolutions(f)(jnp.ones((1, 4, 4, 1)), True)
    assert out.shape == (1, 4, 4, 2)


@pytest.mark.parametrize(
    "bad,error", [(0, ValueError), (-2, ValueError), (2.5, TypeError), ("2", TypeError)]
)
def test_bad_unroll_is_refused_by_name(bad, error):
    vg = jax.value_and_grad(_loss)
    with pytest.raises(error, match="`unroll`"):
        optax_accum.microbatch(vg, K, unroll=bad)
    with pytest.raises(error, match="`unroll`"):
        optax_accum.microbatch_value_and_grad(_loss, K, unroll=bad)


def test_unroll_reaches_the_flax_step():
    nnx = pytest.importorskip("flax.nnx")
    from optax_accum.flax import nnx_train_step

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    loss = lambda m, x: jnp.mean(m(x) ** 2)
    x = jnp.arange(8.0).reshape(4, 2)
    step = nnx_train_step(loss, 2, unroll=True)
    assert "stablehlo.while" not in nnx.jit(step).lower(model, optimizer, x).as_text()
    with pytest.raises(ValueError, match="`unroll`"):
        nnx_train_step(loss, 2, unroll=0)


def test_relayout_runs_any_fun_remat_custom_vjp_scan_jit_and_callbacks():
    # The relaid body re-binds every other primitive as it came, calls
    # inlined: `fun`'s own transformations keep their meaning.
    dn = ("NHWC", "HWIO", "NHWC")

    @jax.custom_vjp
    def sine(x):
        return jnp.sin(x)

    sine.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))

    def loss(p, x):
        conv = partial(lax.conv_general_dilated, window_strides=(1, 1))
        h = jax.checkpoint(
            lambda x: jax.nn.relu(conv(x, p["w"], padding="SAME", dimension_numbers=dn))
        )(x)
        h, _ = lax.scan(lambda c, _: (jnp.tanh(c), None), sine(h), None, length=2)
        h = jax.jit(lambda h: conv(h, p["w2"], padding="SAME", dimension_numbers=dn))(h)
        jax.debug.callback(lambda v: None, h.sum())
        return jnp.mean(h**2)

    p = {"w": jnp.full((3, 3, 1, 4), 0.1), "w2": jnp.full((3, 3, 4, 2), 0.1)}
    x = jax.random.normal(jax.random.key(0), (8, 6, 6, 1))
    want = jax.value_and_grad(loss)(p, x)
    faces = [
        optax_accum.microbatch(jax.value_and_grad(loss), K),
        optax_accum.microbatch_value_and_grad(loss, K, weight_fn=lambda x: x.shape[0]),
    ]
    for fun in faces:
        got = jax.jit(fun)(p, x)
        for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)
