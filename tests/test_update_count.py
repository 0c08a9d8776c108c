# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`update_count` reads the number of optimizer updates from every face's state.

Each case runs a face for a known number of calls and checks the count
against the updates made, counted independently: the calls whose update is
non-zero (SGD on a constant gradient moves the parameters only on an update).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum import privacy

K, CALLS = 3, 7  # 7 calls with k = 3: 2 updates
PARAMS = {"w": jnp.zeros(2), "b": jnp.zeros(())}
GRADS = {"w": jnp.ones(2), "b": jnp.float32(1.0)}


def _feed(tx, calls=CALLS):
    """``(state, updates made)``: the number of calls whose update moved."""
    state, made = tx.init(PARAMS), 0
    step = jax.jit(tx.update)
    for _ in range(calls):
        updates, state = step(GRADS, state, PARAMS)
        made += bool(np.any(np.asarray(updates["w"]) != 0))
    return state, made


def _dp(inner):
    return privacy.dp_accumulate(
        inner, K, l2_clip_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0,
        key=jax.random.key(0),
    )  # fmt: skip


FACES = {
    "accumulate": lambda: optax_accum.accumulate(optax.sgd(1.0), K),
    "accumulate_adam": lambda: optax_accum.accumulate(optax.adam(0.1), K),
    "multisteps": lambda: optax_accum.MultiSteps(optax.sgd(1.0), K),
    "optax_multisteps": lambda: optax.MultiSteps(optax.sgd(1.0), K),
    "dp_accumulate": lambda: _dp(optax.sgd(1.0)),
    "offload_in_accumulate": lambda: optax_accum.accumulate(
        optax_accum.offload(optax.sgd(1.0)), K
    ),
    "in_chain": lambda: optax.chain(
        optax.scale(1.0), optax_accum.accumulate(optax.sgd(1.0), K)
    ),
    "in_inject_hyperparams": lambda: optax.inject_hyperparams(
        lambda learning_rate: optax_accum.accumulate(optax.sgd(learning_rate), K)
    )(learning_rate=1.0),
    "inject_hyperparams_inside": lambda: optax_accum.accumulate(
        optax.inject_hyperparams(optax.sgd)(learning_rate=1.0), K
    ),
}


@pytest.mark.parametrize("face", list(FACES))
def test_counts_the_updates_of_every_face(face):
    state, made = _feed(FACES[face]())
    assert made == CALLS // K
    count = optax_accum.update_count(state)
    assert isinstance(count, jax.Array) and count.dtype == jnp.int32
    assert count.shape == () and int(count) == made
    assert int(jax.jit(optax_accum.update_count)(state)) == made


def test_a_restored_optax_multisteps_state_continued_by_ours():
    theirs = optax.MultiSteps(optax.sgd(1.0), K)
    state = theirs.init(PARAMS)
    for _ in range(4):  # one update, one mini-step into the next window
        _, state = theirs.update(GRADS, state, PARAMS)
    assert int(optax_accum.update_count(state)) == 1
    ours = optax_accum.MultiSteps(optax.sgd(1.0), K)
    restored = jax.tree.map(jnp.asarray, state)  # as a checkpoint hands it back
    for _ in range(2):
        _, restored = ours.update(GRADS, restored, PARAMS)
    assert int(optax_accum.update_count(restored)) == 2


def test_counts_inside_a_lax_scan_training_loop():
    tx = optax_accum.accumulate(optax.adam(0.1), K)

    def body(state, _):
        _, state = tx.update(GRADS, state, PARAMS)
        return state, optax_accum.update_count(state)

    _, counts = jax.lax.scan(body, tx.init(PARAMS), length=CALLS)
    np.testing.assert_array_equal(counts, [0, 0, 1, 1, 1, 2, 2])


def _nnx_optimizers_after_calls():
    """An ``nnx.Optimizer`` per accumulating face, after CALLS updates."""
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    grads = nnx.state(model, nnx.Param)
    for tx in (
        optax_accum.accumulate(optax.sgd(0.1), K),
        optax_accum.MultiSteps(optax.adam(0.1), K).gradient_transformation(),
    ):
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        for _ in range(CALLS):
            optimizer.update(model, grads)
        yield nnx, optimizer


def test_nnx_optimizer_counts_updates_not_calls():
    for nnx, optimizer in _nnx_optimizers_after_calls():
        assert int(optimizer.step[...]) == CALLS  # nnx counts calls
        assert int(optax_accum.update_count(optimizer)) == CALLS // K
        assert int(optax_accum.update_count(optimizer.opt_state)) == CALLS // K
        counted = nnx.jit(lambda o: optax_accum.update_count(o))(optimizer)
        assert int(counted) == CALLS // K


def test_fused_steps_count_their_steps():
    nnx = pytest.importorskip("flax.nnx")
    from flax.training.train_state import TrainState

    from optax_accum.flax import linen_train_step, nnx_train_step

    x = jax.random.normal(jax.random.key(0), (8, 2))
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = nnx.jit(nnx_train_step(lambda m, x: jnp.mean(m(x) ** 2), 4))
    for _ in range(3):
        step(model, optimizer, x)
    assert int(optax_accum.update_count(optimizer)) == 3

    params = {"w": jnp.ones((2, 1))}
    state = TrainState.create(
        apply_fn=lambda p, x: x @ p["w"], params=params, tx=optax.adam(1e-2)
    )
    linen_step = jax.jit(
        linen_train_step(lambda p, rng, x: jnp.mean((x @ p["w"]) ** 2), 4)
    )
    for _ in range(2):
        state, _ = linen_step(state, x)
    count = optax_accum.update_count(state)
    assert count.dtype == jnp.int32 and int(count) == 2


def test_linen_train_state_with_accumulate_counts_updates():
    pytest.importorskip("flax")
    from flax.training.train_state import TrainState

    state = TrainState.create(
        apply_fn=None, params=PARAMS, tx=optax_accum.accumulate(optax.sgd(1.0), K)
    )
    for _ in range(CALLS):
        state = state.apply_gradients(grads=GRADS)
    assert int(state.step) == CALLS
    assert int(optax_accum.update_count(state)) == CALLS // K
    assert int(optax_accum.update_count(state.opt_state)) == CALLS // K


def test_no_accumulation_state_is_refused_naming_what_was_found():
    state = optax.adam(0.1).init(PARAMS)
    with pytest.raises(ValueError, match=r"no accumulation state.*ScaleByAdamState"):
        optax_accum.update_count(state)
    with pytest.raises(ValueError, match=r"pass the `nnx\.Optimizer` or the linen"):
        optax_accum.update_count(state)


def test_several_accumulation_states_are_refused():
    tx = optax.chain(
        optax_accum.accumulate(optax.sgd(1.0), 2),
        optax_accum.MultiSteps(optax.sgd(1.0), 2).gradient_transformation(),
    )
    with pytest.raises(ValueError, match="found 2: AccumulateState, MultiStepsState"):
        optax_accum.update_count(tx.init(PARAMS))


def test_the_split_nnx_state_that_orbax_saves():
    """``nnx.state(optimizer)`` (what Orbax saves, what split/merge loops pass)
    holds the accumulation state as a mapping of its fields, beside ``step``:
    the count is still the updates, not ``step``'s calls."""
    for nnx, optimizer in _nnx_optimizers_after_calls():
        state = nnx.state(optimizer)
        assert int(optax_accum.update_count(state)) == CALLS // K
        assert int(optax_accum.update_count(state["opt_state"])) == CALLS // K
        assert int(jax.jit(optax_accum.update_count)(state)) == CALLS // K


def test_nested_accumulation_is_refused():
    for tx in (
        optax_accum.accumulate(optax_accum.accumulate(optax.sgd(1.0), 2), 2),
        optax.MultiSteps(optax_accum.accumulate(optax.sgd(1.0), 2), 2),
    ):
        with pytest.raises(ValueError, match=r"found 2: .*\(one inside another\)"):
            optax_accum.update_count(tx.init(PARAMS))


def test_an_abstract_restore_target_gives_an_abstract_count():
    tx = optax_accum.accumulate(optax.adam(0.1), K)
    target = jax.eval_shape(tx.init, PARAMS)
    assert optax_accum.update_count(target) == jax.ShapeDtypeStruct((), jnp.int32)
