# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Runs docs/guides/flax_custom_step.md's code cells, as the page shows them.

The page's cells check each custom nnx step against `nnx_train_step` (issue
23, docs: "A custom nnx step"); this test runs them outside the docs build.
"""

from __future__ import annotations

import pathlib
import re

import pytest

pytest.importorskip("flax")

PAGE = pathlib.Path(__file__).parents[2] / "docs" / "guides" / "flax_custom_step.md"
CODE_CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```$", re.S | re.M)


@pytest.mark.slow
def test_custom_nnx_steps_in_the_guide_match_the_helper():
    cells = CODE_CELL.findall(PAGE.read_text())
    assert len(cells) == 7
    namespace: dict = {}
    for cell in cells:
        exec(compile(cell, str(PAGE), "exec"), namespace)


def test_the_split_route_refuses_batchnorm_statistics_by_name():
    # The guide's `nnx.split` route with BatchNorm in training mode: before,
    # Flax's TraceContextError with no word of optax_accum (issue 33, §7).
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import optax_accum

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.l1(x))

    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def fused_step(model, optimizer, x):
        graphdef, params, rest = nnx.split(model, optimizer.wrt, ...)

        def loss_of(params, x):
            return jnp.mean(nnx.merge(graphdef, params, rest)(x) ** 2)

        grad_fn = optax_accum.microbatch(jax.value_and_grad(loss_of), 2)
        loss, grads = grad_fn(params, x)
        optimizer.update(model, grads)
        return loss

    with pytest.raises(TypeError, match=r"`microbatch`.*nnx.*nnx_train_step"):
        fused_step(model, optimizer, jnp.arange(24.0).reshape(8, 3))
    assert float(jnp.abs(model.bn.mean[...]).max()) == 0.0  # nothing ran
