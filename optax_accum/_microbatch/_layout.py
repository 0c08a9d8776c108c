# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Convolutions in the loop body laid out as XLA's CPU kernels need them.

XLA's CPU compiler runs a convolution on its fast (Eigen) kernel only in the
canonical layout: input ``NHWC``, kernel ``HWIO``, output ``NHWC``. Its
``ConvCanonicalization`` pass transposes the others into it, but it visits
the entry computation only. A convolution inside a loop body, or inside a
branch of a conditional, keeps its layout and runs a naive kernel. A weight
gradient's convolution is never canonical (``dim_labels=f01b_i01o->01bf``):
on a conv net, one micro-batch in the loop then costs 10-20 times its
straight-line cost, k = 1 included, whose loop of one trip XLA removes only
after that pass.

`canonical_convolutions` applies that pass's rewrite where the pass cannot
see. It traces the body of one micro-batch to a jaxpr and runs it again, with
every non-canonical convolution put between the same transposes that XLA
would add, so the result is what the straight-line program computes. Calls
(``jit``, ``closed_call``) are inlined, as XLA inlines them before the pass.
Convolutions inside control flow of ``fun``'s own (a ``scan``, a ``cond``) are
left as they are: the pass does not reach them in the plain step either. On
other backends, whose compilers lay out every convolution, nothing changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend import core
from jax.extend.core import primitives

source_info_util: Any
try:  # private, as for `jax.core.eval_jaxpr`; names only, so optional
    from jax._src import source_info_util
except ImportError:  # pragma: no cover
    source_info_util = None

_ARRAYS = (jax.Array, np.ndarray, np.generic)
_CALLS = (primitives.jit_p, primitives.closed_call_p, primitives.call_p)


def canonical_convolutions(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` with its convolutions in the CPU's canonical layout (on the CPU;
    elsewhere ``f`` itself). Same values: only operand layouts change."""
    if jax.default_backend() != "cpu":
        return f

    def relaid(*args: Any) -> Any:
        # Only array leaves are traced; anything else stays a Python value.
        arrays, fill = split_arrays(args)
        closed, shape = jax.make_jaxpr(lambda *a: f(*fill(a)), return_shape=True)(
            *arrays
        )
        if not _has_convolution(closed.jaxpr):
            return f(*args)
        flat = _run(closed.jaxpr, closed.consts, arrays)
        return jax.tree.unflatten(jax.tree.structure(shape), flat)

    return relaid


def split_arrays(tree: Any) -> tuple[list, Callable[[Any], Any]]:
    """``tree``'s array leaves, and a function that puts other arrays in
    their places (the other leaves, such as an Equinox model's functions,
    stay as they are): what a trace or a `lax.cond` may take as operands."""
    leaves, treedef = jax.tree.flatten(tree)
    where = [j for j, x in enumerate(leaves) if isinstance(x, _ARRAYS)]

    def fill(arrays: Any) -> Any:
        full = list(leaves)
        for j, x in zip(where, arrays, strict=True):
            full[j] = x
        return jax.tree.unflatten(treedef, full)

    return [leaves[j] for j in where], fill


def _has_convolution(jaxpr: core.Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive is primitives.conv_general_dilated_p:
            return True
        if eqn.primitive in _CALLS and _has_convolution(_inner(eqn).jaxpr):
            return True
    return False


def _inner(eqn: core.JaxprEqn) -> core.ClosedJaxpr:
    sub: Any = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    return sub if isinstance(sub, core.ClosedJaxpr) else core.ClosedJaxpr(sub, ())


def _run(jaxpr: core.Jaxpr, consts: Any, args: list) -> list:
    """Evaluates ``jaxpr`` as `jax.core.eval_jaxpr` does, convolutions relaid."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        with _source(eqn), eqn.ctx.manager:
            if eqn.primitive is primitives.conv_general_dilated_p:
                outs = [_conv(*invals, **eqn.params)]
            elif eqn.primitive in _CALLS:
                sub = _inner(eqn)
                outs = _run(sub.jaxpr, sub.consts, invals)
            else:
                params = eqn.primitive.get_bind_params(eqn.params)
                outs = eqn.primitive.bind(*invals, **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, core.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _source(eqn: core.JaxprEqn) -> Any:
    """The equation's name stack and traceback, as `jax.core.eval_jaxpr`
    keeps them, so that profiles and HLO metadata name the user's ops."""
    if source_info_util is None:
        return contextlib.nullcontext()
    names = source_info_util.current_name_stack() + eqn.source_info.name_stack
    return source_info_util.user_context(eqn.source_info.traceback, name_stack=names)


def canonical(n: int) -> lax.ConvDimensionNumbers:
    """``NHWC``, ``HWIO``, ``NHWC`` for ``n`` dimensions (``n - 2`` spatial)."""
    spatial = tuple(range(1, n - 1))
    return lax.ConvDimensionNumbers(
        lhs_spec=(0, n - 1, *spatial),
        rhs_spec=(n - 1, n - 2, *range(n - 2)),
        out_spec=(0, n - 1, *spatial),
    )


def _conv(lhs: Any, rhs: Any, *, dimension_numbers, **params: Any) -> Any:
    """One convolution, as ``ConvCanonicalization`` rewrites it: its operands
    transposed to the canonical layout, its result transposed back."""
    n = lhs.ndim
    dn = dimension_numbers
    target = canonical(n)
    if tuple(dn) == tuple(target) or params.get("out_sharding") is not None:
        return lax.conv_general_dilated_p.bind(lhs, rhs, dimension_numbers=dn, **params)
    lhs = lax.transpose(lhs, (dn.lhs_spec[0], *dn.lhs_spec[2:], dn.lhs_spec[1]))
    rhs = lax.transpose(rhs, (*dn.rhs_spec[2:], dn.rhs_spec[1], dn.rhs_spec[0]))
    out = lax.conv_general_dilated_p.bind(lhs, rhs, dimension_numbers=target, **params)
    # The canonical result's axes are (batch, spatial..., feature).
    source = [0] * n
    source[dn.out_spec[0]] = 0
    source[dn.out_spec[1]] = n - 1
    for j, axis in enumerate(dn.out_spec[2:]):
        source[axis] = 1 + j
    return lax.transpose(out, tuple(source))
