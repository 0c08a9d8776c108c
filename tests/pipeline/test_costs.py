# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`measure_costs` against hand-counted FLOPs; `bubble_fraction` takes them;
`bubble_fraction` without costs warns and keeps the slot share one release."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from optax_accum import pipeline as pl
from tests.pipeline import models as md


def linear_first(fp, b):
    return b["x"] @ fp


def linear_stage(sp, h):
    return h @ sp


def linear_loss(lp, h, b):
    return jnp.mean(h @ lp)


def linear_model(rows=64, width=128, stages=2):
    k = jax.random.split(jax.random.key(0), 3)
    params = (
        jax.random.normal(k[0], (4, width)),
        jax.random.normal(k[1], (stages, width, width)),
        jnp.ones((width,)),
    )
    return params, {"x": jax.random.normal(k[2], (rows, 4))}


def test_linear_stage_flops_are_hand_counted():
    """A matmul stage h @ W, h (n, d): F = 2nd², B = g Wᵀ = 2nd², W = hᵀ g =
    2nd²; the micro-batch has n = rows / M rows (the ratios do not see n)."""
    params, batch = linear_model()
    costs = pl.measure_costs(
        linear_first, linear_stage, linear_loss, params, batch, num_microbatches=4
    )
    assert isinstance(costs, pl.Costs)
    assert costs == pytest.approx((1.0, 1.0, 1.0), rel=1e-6)


def test_mlp_stage_flops_near_hand_counted():
    """The tests' residual tanh stage h + tanh(h W + b): each op is one
    2nd² matmul plus O(nd) elementwise work, so each ratio is 1 within
    O(1/d)."""
    d = 256
    params, batch = md.make(2, rows=64, width=d)
    costs = pl.measure_costs(md.first_fn, md.stage_fn, md.loss_fn, params, batch, 2)
    assert costs.f == 1.0
    assert costs.b == pytest.approx(1.0, abs=10 / d)
    assert costs.w == pytest.approx(1.0, abs=10 / d)


def test_b_is_not_a_second_forward():
    """B from the kept residuals holds no stage forward. A stage
    tanh(h A) B has F = 2 matmuls; B = (g Bᵀ ⊙ (1 - t²)) Aᵀ is 2 (1.0 F,
    where a second forward would make it 2.0 F); W = tᵀ g and hᵀ (g Bᵀ ⊙
    (1 - t²)) is 3 (1.5 F: W recomputes g Bᵀ, which B does not hand on)."""

    def stage(sp, h):
        return jnp.tanh(h @ sp["a"]) @ sp["b"]

    d = 128
    sp = {"a": jnp.ones((2, d, d)) / d, "b": jnp.ones((2, d, d)) / d}
    params = (jnp.ones((4, d)), sp, jnp.ones((d,)))
    batch = {"x": jnp.ones((32, 4))}
    costs = pl.measure_costs(linear_first, stage, linear_loss, params, batch)
    assert costs.b == pytest.approx(1.0, abs=0.05)
    assert costs.w == pytest.approx(1.5, abs=0.05)


def test_timed_costs_are_positive_relative_times():
    params, batch = linear_model(width=32)
    costs = pl.measure_costs(
        linear_first, linear_stage, linear_loss, params, batch, timed=True, rounds=3
    )
    assert costs.f == 1.0 and costs.b > 0 and costs.w > 0


def test_bubble_fraction_takes_measured_costs():
    params, batch = linear_model()
    costs = pl.measure_costs(linear_first, linear_stage, linear_loss, params, batch)
    for name in ("gpipe", "1f1b", "zb_h1"):
        assert pl.bubble_fraction(name, 4, 8, costs=costs) == pytest.approx(
            pl.bubble_fraction(name, 4, 8, costs=(1, 1, 1))
        )


def test_bubble_fraction_without_costs_is_the_time_bubble_at_unit_costs():
    for name in ("gpipe", "1f1b", "zb_h1"):
        got = pl.bubble_fraction(name, 4, 8)
        assert got == pl.bubble_fraction(name, 4, 8, costs=(1, 1, 1))
    # ZB-H1's slots idle less than its ticks at unit costs (B and W tick apart).
    assert pl.bubble_fraction("zb_h1", 4, 8) != pl.idle_slots("zb_h1", 4, 8)
    assert pl.idle_slots("gpipe", 4, 4) == pytest.approx(3 / 7)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"params": (1, 2)}, "`params`"),
        ({"num_microbatches": 0}, "`num_microbatches`"),
        ({"num_microbatches": 3}, "`num_microbatches`=3"),
        ({"num_microbatches": True}, "`num_microbatches`"),
        ({"rounds": 0, "timed": True}, "`rounds`"),
        ({"stage_fn": lambda sp, h: h[:, :3]}, "`stage_fn`"),
        ({"loss_fn": lambda lp, h, b: h}, "`loss_fn`"),
        ({"stage_fn": lambda sp, h: h}, "no FLOPs"),
    ],
)
def test_bad_arguments_named(change, match):
    params, batch = linear_model(width=16)
    kw = dict(
        first_fn=linear_first,
        stage_fn=linear_stage,
        loss_fn=linear_loss,
        params=params,
        batch=batch,
    )
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        pl.measure_costs(**kw)
