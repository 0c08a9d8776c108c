# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Tests for `plan_microbatch`, against memory measured by compiling directly."""

import functools
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_accum

TARGET = 256


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    logits = h @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _setup():
    params = {
        "w1": jnp.zeros((64, 512)),
        "b1": jnp.zeros(512),
        "w2": jnp.zeros((512, 10)),
    }
    # SGD: the cheapest optimizer to compile; the planner does not care.
    tx = optax_accum.accumulate(optax.sgd(1e-3), every_k=4)
    opt_state = tx.init(params)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    example = {"x": jnp.zeros(64), "y": jnp.zeros([], jnp.int32)}
    return train_step, params, opt_state, example


def _bytes(lowered):
    """Compiles and reads XLA's memory analysis field by field."""
    stats = lowered.compile().memory_analysis()
    return (
        stats.temp_size_in_bytes
        + stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
    )


def _batch_spec(m):
    return {
        "x": jax.ShapeDtypeStruct((m, 64), jnp.float32),
        "y": jax.ShapeDtypeStruct((m,), jnp.int32),
    }


def _measured(step, params, opt_state, m):
    """Memory of the train step compiled at micro-batch size m."""
    fn = step if hasattr(step, "lower") else jax.jit(step)
    return _bytes(fn.lower(params, opt_state, _batch_spec(m)))


@pytest.fixture(scope="module")
def setup():
    return _setup()


@pytest.fixture(scope="module")
def measured(setup):
    step, params, opt_state, _ = setup
    sizes = [m for m in range(1, TARGET + 1) if TARGET % m == 0]
    return {m: _measured(step, params, opt_state, m) for m in sizes}


@pytest.mark.slow
def test_memory_grows_with_size_above_one(measured):
    # The premise of the binary search (m = 1 may be special, see the docs).
    values = [measured[m] for m in sorted(measured) if m >= 2]
    assert values == sorted(values)
    assert values[-1] > 1.5 * values[0]


@pytest.mark.slow
@pytest.mark.parametrize("between", [(8, 16), (32, 64), (128, 256)])
def test_chosen_fits_and_next_does_not(setup, measured, between):
    step, params, opt_state, example = setup
    small, big = between
    budget = (measured[small] + measured[big]) // 2
    plan = optax_accum.plan_microbatch(
        step, params, opt_state, example, TARGET, memory_budget=budget
    )
    assert plan.microbatch_size == small
    assert plan.num_microbatches == TARGET // small
    assert plan.effective_batch_size == TARGET
    assert plan.memory_bytes == measured[small] <= budget
    assert plan.next_microbatch_size == big
    assert plan.next_memory_bytes == measured[big] > budget
    # Brute force agrees: the largest divisor that fits.
    assert plan.microbatch_size == max(m for m, b in measured.items() if b <= budget)
    # Binary search over 9 candidates: at most 2 + ceil(log2(9)) compilations.
    assert plan.num_compilations <= 2 + math.ceil(math.log2(len(measured)))


@pytest.mark.slow
def test_everything_fits(setup, measured):
    step, params, opt_state, example = setup
    plan = optax_accum.plan_microbatch(
        step, params, opt_state, example, TARGET, memory_budget=10 * 2**30
    )
    assert (plan.microbatch_size, plan.num_microbatches) == (TARGET, 1)
    assert plan.memory_bytes == measured[TARGET]
    assert plan.next_microbatch_size is None and plan.next_memory_bytes is None
    assert plan.num_compilations == 1


@pytest.mark.slow
def test_nothing_fits(setup, measured):
    step, params, opt_state, example = setup
    with pytest.raises(ValueError, match=r"`memory_budget`=1,000 bytes.*1: .*2: "):
        optax_accum.plan_microbatch(
            step, params, opt_state, example, TARGET, memory_budget=1000
        )


@pytest.mark.slow
def test_not_divisible_rounds_k_up(setup):
    step, params, opt_state, example = setup
    sizes = range(8, 100, 8)
    measured = {m: _measured(step, params, opt_state, m) for m in (40, 48)}
    budget = (measured[40] + measured[48]) // 2
    plan = optax_accum.plan_microbatch(
        step,
        params,
        opt_state,
        example,
        100,
        memory_budget=budget,
        multiple_of=8,
        divisors_only=False,
    )
    assert 40 in sizes
    assert plan.microbatch_size == 40
    assert plan.num_microbatches == 3  # ceil(100 / 40)
    assert plan.effective_batch_size == 120
    assert plan.next_microbatch_size == 48
    assert plan.memory_bytes == measured[40]


def test_donating_jitted_step_uses_its_aliasing(setup):
    step, params, opt_state, example = setup
    donated = jax.jit(step, donate_argnums=(0, 1))
    plain = _measured(step, params, opt_state, 32)
    with_alias = _measured(donated, params, opt_state, 32)
    assert with_alias < plain
    plan = optax_accum.plan_microbatch(
        donated, params, opt_state, example, 32, memory_budget=with_alias
    )
    assert plan.microbatch_size == 32
    assert plan.memory_bytes == with_alias


def test_loss_without_optimizer_state(setup):
    _, params, _, example = setup
    grad_fn = jax.value_and_grad(_loss)

    def measured(m):
        return _bytes(jax.jit(grad_fn).lower(params, _batch_spec(m)))

    budget = (measured(16) + measured(32)) // 2
    # At m = 1 XLA uses a matrix-vector product that needs more memory than
    # m = 16: the planner must not give up there.
    assert measured(1) > budget
    plan = optax_accum.plan_microbatch(
        grad_fn, params, None, example, 64, memory_budget=budget
    )
    assert (plan.microbatch_size, plan.num_microbatches) == (16, 4)


@pytest.mark.slow
def test_abstract_params_are_accepted(setup, measured):
    step, params, opt_state, example = setup
    abstract = jax.eval_shape(lambda: (params, opt_state))
    budget = (measured[64] + measured[128]) // 2
    plan = optax_accum.plan_microbatch(
        step, *abstract, example, TARGET, memory_budget=budget
    )
    assert plan.microbatch_size == 64


def test_cpu_requires_a_budget(setup):
    step, params, opt_state, example = setup
    assert jax.devices()[0].memory_stats() is None
    with pytest.raises(ValueError, match="`memory_budget` is required on cpu"):
        optax_accum.plan_microbatch(step, params, opt_state, example, TARGET)


@pytest.mark.slow
def test_default_budget_is_free_device_memory(setup, measured):
    step, params, opt_state, example = setup
    in_use = 123_456
    limit = in_use + (measured[4] + measured[8]) // 2
    device = SimpleNamespace(
        platform="gpu",
        memory_stats=lambda: {"bytes_limit": limit, "bytes_in_use": in_use},
    )
    plan = optax_accum.plan_microbatch(
        step, params, opt_state, example, TARGET, device=device
    )
    assert plan.memory_budget == limit - in_use
    assert plan.microbatch_size == 4


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"target_batch_size": 0}, ValueError, "`target_batch_size`"),
        ({"target_batch_size": 8.0}, TypeError, "`target_batch_size`"),
        ({"memory_budget": -1}, ValueError, "`memory_budget`"),
        ({"multiple_of": 3}, ValueError, "multiple of `multiple_of`=3"),
        ({"max_microbatch_size": 0}, ValueError, "`max_microbatch_size`"),
    ],
)
def test_bad_input(setup, kwargs, error, match):
    step, params, opt_state, example = setup
    args = {"target_batch_size": 16, "memory_budget": 10**9}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        optax_accum.plan_microbatch(step, params, opt_state, example, **args)


@pytest.mark.slow
def test_flax_nnx_state_with_prng_keys():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(64, 256, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.out = nnx.Linear(256, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(self.drop(jax.nn.relu(self.hidden(x))))

    model = MLP(nnx.Rngs(0, dropout=1))
    tx = optax_accum.accumulate(optax.sgd(1e-3), every_k=2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits = model(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["y"]
            ).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    def measured(m):
        return _bytes(jax.jit(step).lower(state, _batch_spec(m)))

    fits, too_big = measured(8), measured(16)
    example = {"x": jnp.zeros(64), "y": jnp.zeros([], jnp.int32)}
    # Candidates 8, 16, 32 only: each compilation of this step is slow.
    plan = optax_accum.plan_microbatch(
        step,
        state,
        None,
        example,
        32,
        memory_budget=(fits + too_big) // 2,
        multiple_of=8,
    )
    assert (plan.microbatch_size, plan.num_microbatches) == (8, 4)
    assert (plan.memory_bytes, plan.next_memory_bytes) == (fits, too_big)


def test_rounded_up_plan_never_exceeds_the_target(setup):
    # Issue 23: target 10 with max_microbatch_size=64 planned 64 x 1.
    step, params, opt_state, example = setup
    plan = optax_accum.plan_microbatch(
        step, params, opt_state, example, 10, memory_budget=10**9,
        max_microbatch_size=64, divisors_only=False,
    )  # fmt: skip
    assert (plan.microbatch_size, plan.num_microbatches) == (10, 1)
    assert plan.next_microbatch_size is None
    with pytest.raises(ValueError, match="at most `target_batch_size`=10"):
        optax_accum.plan_microbatch(
            step, params, opt_state, example, 10, memory_budget=10**9,
            multiple_of=16, divisors_only=False,
        )  # fmt: skip


@functools.cache
def _make_fused_step(k):
    """The real fused step: the whole batch, k micro-batches inside."""
    tx = optax.sgd(1e-3)
    grad_fn = optax_accum.microbatch(jax.value_and_grad(_loss), k)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def test_fused_step_plan_is_the_compiled_fused_step(setup):
    # Issue 23: the plan of a fused step is that step's compiled memory at
    # the whole batch, for the k it returns (and the next size up's).
    _, params, _, example = setup
    opt_state = optax.sgd(1e-3).init(params)
    full = _batch_spec(TARGET)
    mem = {
        k: _bytes(_make_fused_step(k).lower(params, opt_state, full)) for k in (2, 4)
    }
    assert mem[4] < mem[2]  # smaller micro-batches, less memory
    plan = optax_accum.plan_fused_step(
        _make_fused_step, params, opt_state, example, TARGET,
        memory_budget=(mem[4] + mem[2]) // 2, multiple_of=64,
    )  # fmt: skip
    assert (plan.microbatch_size, plan.num_microbatches) == (64, 4)
    assert plan.effective_batch_size == TARGET
    assert (plan.memory_bytes, plan.next_memory_bytes) == (mem[4], mem[2])
    assert plan.next_microbatch_size == 128


def test_fused_step_bad_input(setup):
    _, params, opt_state, example = setup
    with pytest.raises(TypeError, match="`make_step`"):
        optax_accum.plan_fused_step(None, params, opt_state, example, 8)
    with pytest.raises(TypeError, match=r"`make_step\(1\)`"):
        optax_accum.plan_fused_step(
            lambda k: None, params, opt_state, example, 8, memory_budget=10**9
        )


def test_offloaded_state_inside_params_is_counted_and_noted():
    """Issue 41: a pure function of a split nnx state takes the optimizer's
    offloaded state inside ``params`` (``opt_state=None``); the plan's
    ``offloaded_bytes`` counts it, and the note gives the same number."""
    from flax import nnx

    from optax_accum.flax import nnx_train_step

    model = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    tx = optax_accum.offload(optax.adam(1e-3))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    adam = (16 * 8 + 8) * 4 * 2 + 4  # mu, nu and count in host memory

    def make_step(k):
        train = nnx_train_step(lambda m, x: jnp.mean(m(x) ** 2), k)

        def step(state, x):
            model, optimizer = nnx.merge(graphdef, state)
            return train(model, optimizer, x), nnx.state((model, optimizer))

        return step

    plan = optax_accum.plan_fused_step(
        make_step, state, None, jnp.zeros(16), 8, memory_budget=10**8,
        max_microbatch_size=4,
    )  # fmt: skip
    assert plan.offloaded_bytes == adam
    assert f"{adam:,} bytes of arguments (`offloaded_bytes`)" in plan.memory_note
    # The same state passed as ``opt_state`` is counted the same way.
    params, opt_state = jnp.zeros((16, 8)), tx.init(jnp.zeros((16, 8)))
    plan = optax_accum.plan_fused_step(
        lambda k: lambda p, s, x: (p, s), params, opt_state, jnp.zeros(16), 8,
        memory_budget=10**8, max_microbatch_size=4,
    )  # fmt: skip
    assert plan.offloaded_bytes == 16 * 8 * 4 * 2 + 4
