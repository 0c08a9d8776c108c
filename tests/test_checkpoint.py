# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Checkpoint and resume with Orbax, in the middle of an accumulation window.

Each test trains without interruption, then again with a save after a step
that leaves a partly filled accumulator, a restore into a fresh process-like
state (built from abstract shapes only) and the remaining steps. Both runs
must end bit for bit equal.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import linen, nnx
from flax.training import train_state

import optax_accum
from tests.helpers.lanes import sweep

K = 4
NUM_STEPS = 11
STOP_AT = 6  # micro-step 2 of the second window: the accumulator is half full.


def _batches():
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(NUM_STEPS, 8, 5)).astype(np.float32)
    ys = rng.normal(size=(NUM_STEPS, 8, 3)).astype(np.float32)
    # One non-finite micro-batch, so the skip state and counter matter too.
    xs[3, 0, 0] = np.nan
    return [(jnp.asarray(x), jnp.asarray(y)) for x, y in zip(xs, ys, strict=True)]


def _loss(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2)


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _shape_dtype(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _save_restore(path, state, abstract):
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, state)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path, abstract)


def _optimizers():
    adam = optax.adam(1e-2)
    skip = optax_accum.skip_not_finite
    return {
        # Clipping inside the wrapper: it clips the window's mean, once.
        "accumulate": optax_accum.accumulate(
            optax.chain(optax.clip_by_global_norm(1.0), adam),
            every_k=K,
            skip_fn=skip,
        ),
        "accumulate_schedule": optax_accum.accumulate(
            adam, every_k=optax_accum.batch_size_warmup(8, 16, 32, 2), skip_fn=skip
        ),
        "MultiSteps": optax_accum.MultiSteps(
            adam, every_k_schedule=K, should_skip_update_fn=skip
        ).gradient_transformation(),
    }


@pytest.mark.parametrize("name", sweep(_optimizers(), fast=["accumulate_schedule"]))
def test_optax_resume_mid_window_is_bit_exact(tmp_path, name):
    tx = _optimizers()[name]
    batches = _batches()

    def init():
        params = {"w": jnp.full((5, 3), 0.1, jnp.float32), "b": jnp.zeros(3)}
        return {"params": params, "opt_state": tx.init(params)}

    @jax.jit
    def step(state, batch):
        grads = jax.grad(_loss)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
        }

    reference = init()
    for batch in batches:
        reference = step(reference, batch)

    state = init()
    for batch in batches[:STOP_AT]:
        state = step(state, batch)
    leaves = jax.tree.leaves(state["opt_state"])
    assert any(np.any(np.asarray(x) != 0) for x in leaves)
    restored = _save_restore(tmp_path / "ckpt", state, jax.eval_shape(init))
    del state
    assert jax.tree.map(_shape_dtype, restored) == jax.eval_shape(init)
    for batch in batches[STOP_AT:]:
        restored = step(restored, batch)
    _assert_trees_equal(restored, reference)


def test_stop_point_is_mid_window():
    # Guards the premise of the tests above: the save happens mid-window,
    # after the skipped micro-batch, with a non-zero accumulator.
    tx = optax_accum.accumulate(
        optax.sgd(1.0), every_k=K, skip_fn=optax_accum.skip_not_finite
    )
    params = {"w": jnp.full((5, 3), 0.1, jnp.float32), "b": jnp.zeros(3)}
    state = tx.init(params)
    for batch in _batches()[:STOP_AT]:
        _, state = tx.update(jax.grad(_loss)(params, batch), state, params)
    assert int(state.micro_step) == 1  # 6 steps, 1 skipped, k = 4.
    assert int(state.update_step) == 1
    assert int(state.num_skipped) == 1
    assert float(jnp.abs(state.accumulator["w"]).max()) > 0


class _MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(5, 16, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


@pytest.mark.slow
def test_nnx_optimizer_resume_mid_window_is_bit_exact(tmp_path):
    batches = _batches()

    def make():
        model = _MLP(nnx.Rngs(0))
        tx = optax_accum.accumulate(
            optax.adamw(1e-2), every_k=K, skip_fn=optax_accum.skip_not_finite
        )
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        def loss_fn(model):
            x, y = batch
            return jnp.mean((model(x) - y) ** 2)

        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, grads)

    reference = make()
    for batch in batches:
        step(*reference, batch)

    model, optimizer = make()
    for batch in batches[:STOP_AT]:
        step(model, optimizer, batch)
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    restored = _save_restore(tmp_path / "ckpt", nnx.state((model, optimizer)), abstract)
    del model, optimizer
    model, optimizer = nnx.merge(graphdef, restored)
    assert int(optimizer.opt_state.micro_step[...]) == 1
    for batch in batches[STOP_AT:]:
        step(model, optimizer, batch)
    _assert_trees_equal(nnx.state((model, optimizer)), nnx.state(reference))


def test_linen_train_state_resume_mid_window_is_bit_exact(tmp_path):
    batches = _batches()
    module = linen.Dense(3)
    tx = optax_accum.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=K)

    def init():
        params = module.init(jax.random.key(0), jnp.zeros((1, 5)))
        return train_state.TrainState.create(
            apply_fn=module.apply, params=params, tx=tx.gradient_transformation()
        )

    @jax.jit
    def step(state, batch):
        def loss_fn(params):
            x, y = batch
            return jnp.mean((jnp.nan_to_num(state.apply_fn(params, x)) - y) ** 2)

        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

    reference = init()
    for batch in batches:
        reference = step(reference, batch)

    state = init()
    for batch in batches[:STOP_AT]:
        state = step(state, batch)
    assert int(state.opt_state.mini_step) == STOP_AT % K
    restored = _save_restore(tmp_path / "ckpt", state, jax.eval_shape(init))
    for batch in batches[STOP_AT:]:
        restored = step(restored, batch)
    _assert_trees_equal(restored.params, reference.params)
    _assert_trees_equal(restored.opt_state, reference.opt_state)
    assert int(restored.step) == int(reference.step) == NUM_STEPS


class _DropoutBatchNormMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(5, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(self.norm(jax.nn.relu(self.hidden(x)))))


@pytest.mark.slow
def test_flax_nnx_train_step_resume_mid_window_is_bit_exact(tmp_path):
    # The fused helper runs 2 micro-batches per call; `accumulate` adds a
    # window of 2 calls on top, so a save after an odd call is mid-window.
    # BatchNorm statistics and the dropout stream's counter must resume too.
    from optax_accum.flax import nnx_train_step

    batches = [(jnp.nan_to_num(x), y) for x, y in _batches()]

    def make():
        model = _DropoutBatchNormMLP(nnx.Rngs(0, dropout=1))
        tx = optax_accum.accumulate(optax.adam(1e-2), every_k=2)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    step = nnx.jit(nnx_train_step(loss_fn, num_microbatches=2))

    reference = make()
    for batch in batches:
        step(*reference, *batch)

    model, optimizer = make()
    for batch in batches[: STOP_AT + 1]:
        step(model, optimizer, *batch)
    assert int(optimizer.opt_state.micro_step[...]) == 1
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    restored = _save_restore(tmp_path / "ckpt", nnx.state((model, optimizer)), abstract)
    model, optimizer = nnx.merge(graphdef, restored)
    for batch in batches[STOP_AT + 1 :]:
        step(model, optimizer, *batch)
    final = nnx.state((model, optimizer))
    _assert_trees_equal(final, nnx.state(reference))
    # The dropout stream did advance: once per micro-batch.
    assert int(reference[0].drop.rngs.count[...]) == 2 * NUM_STEPS


@pytest.mark.slow
def test_flax_linen_train_step_resume_mid_window_is_bit_exact(tmp_path):
    from optax_accum.flax import linen_train_step

    batches = [(jnp.nan_to_num(x), y) for x, y in _batches()]

    class Net(linen.Module):
        @linen.compact
        def __call__(self, x, train: bool):
            x = linen.relu(linen.Dense(16)(x))
            x = linen.BatchNorm(use_running_average=not train)(x)
            x = linen.Dropout(0.25, deterministic=not train)(x)
            return linen.Dense(3)(x)

    class TrainState(train_state.TrainState):
        batch_stats: dict

    net = Net()
    tx = optax_accum.MultiSteps(optax.adam(1e-2), every_k_schedule=3)

    def init():
        variables = net.init(jax.random.key(0), jnp.zeros((1, 5)), train=False)
        return TrainState.create(
            apply_fn=net.apply,
            params=variables["params"],
            batch_stats=variables["batch_stats"],
            tx=tx.gradient_transformation(),
        )

    def loss_fn(params, batch_stats, rng, x, y):
        out, updates = net.apply(
            {"params": params, "batch_stats": batch_stats},
            x,
            train=True,
            mutable=["batch_stats"],
            rngs={"dropout": rng},
        )
        return jnp.mean((out - y) ** 2), updates["batch_stats"]

    train = linen_train_step(loss_fn, num_microbatches=2)

    @jax.jit
    def step(state, x, y):
        # The key is derived from the state, so it resumes with it.
        rng = jax.random.fold_in(jax.random.key(42), state.step)
        return train(state, x, y, rng=rng)[0]

    reference = init()
    for batch in batches:
        reference = step(reference, *batch)

    state = init()
    for batch in batches[: STOP_AT - 1]:
        state = step(state, *batch)
    assert int(state.opt_state.mini_step) == 2
    restored = _save_restore(tmp_path / "ckpt", state, jax.eval_shape(init))
    for batch in batches[STOP_AT - 1 :]:
        restored = step(restored, *batch)
    for field in ("step", "params", "batch_stats", "opt_state"):
        _assert_trees_equal(getattr(restored, field), getattr(reference, field))


def _optax_loop(opt, params, opt_state, batches):
    """A user's optax.MultiSteps-style loop: params and state per batch."""
    step = jax.jit(
        lambda p, s, b: (lambda u, s: (optax.apply_updates(p, u), s))(
            *opt.update(jax.grad(_loss)(p, b), s, p)
        )
    )
    for batch in batches:
        params, opt_state = step(params, opt_state, batch)
    return params, opt_state


@pytest.mark.parametrize(
    ("use_grad_mean", "skip"),
    [
        (False, optax.skip_not_finite),
        (True, None),
        pytest.param(True, optax.skip_not_finite, marks=pytest.mark.slow),
        pytest.param(False, None, marks=pytest.mark.slow),
    ],
)
def test_optax_checkpoint_restores_into_multisteps(tmp_path, use_grad_mean, skip):
    # Issue 23: an optax.MultiSteps checkpoint, saved mid-window (after a
    # skipped micro-batch), restored by the obvious call, continues as optax.
    opts = dict(use_grad_mean=use_grad_mean, should_skip_update_fn=skip)
    adam = optax.adam(1e-2)
    theirs, ours = (
        optax.MultiSteps(adam, K, **opts),
        optax_accum.MultiSteps(adam, K, **opts),
    )
    batches = _batches()
    if skip is None:  # no NaN without a skip function
        batches = batches[:3] + batches[4:]
    params = {"w": jnp.full((5, 3), 0.1, jnp.float32), "b": jnp.zeros(3)}
    params, state = _optax_loop(theirs, params, theirs.init(params), batches[:STOP_AT])
    assert int(state.mini_step) in (1, 2) and int(state.gradient_step) == 1
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    abstract = {
        "params": jax.eval_shape(lambda: params),
        "opt_state": jax.eval_shape(ours.init, params),
    }
    if skip is not None:
        # optax's fields cannot say whether the last call updated: ours has
        # one more, which an optax checkpoint lacks. Restore without it.
        with (
            ocp.StandardCheckpointer() as ckptr,
            pytest.raises(ValueError, match="updated"),
        ):
            ckptr.restore(tmp_path / "ckpt", abstract)
        abstract["opt_state"] = abstract["opt_state"]._replace(updated=())
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(tmp_path / "ckpt", abstract)
    assert type(restored["opt_state"]) is optax_accum.MultiStepsState
    ref = _optax_loop(theirs, params, state, batches[STOP_AT:])
    got = _optax_loop(
        ours, restored["params"], restored["opt_state"], batches[STOP_AT:]
    )
    assert int(got[1].gradient_step) == int(ref[1].gradient_step) == 2
    chex.assert_trees_all_close(got[0], ref[0], rtol=1e-6)
    chex.assert_trees_all_close(
        got[1].inner_opt_state, ref[1].inner_opt_state, rtol=1e-6
    )
    chex.assert_trees_all_close(got[1].acc_grads, ref[1].acc_grads, rtol=1e-6)


def _value_as_update():
    """An inner optimizer that reads ``value``: its update is ``value``."""

    def update(updates, state, params=None, *, value, **extra_args):
        del params, extra_args
        return jax.tree.map(lambda u: jnp.zeros_like(u) + value, updates), state

    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)


@pytest.mark.parametrize(
    ("use_grad_mean", "stop"),
    [(True, 2), (True, K), pytest.param(False, 1, marks=pytest.mark.slow)],
    ids=["mean-mid_window", "mean-whole_window", "sum-mid_window"],
)
def test_optax_checkpoint_restores_the_value_of_the_window(
    tmp_path, use_grad_mean, stop
):
    # Issue 27: the inner optimizer reads `value`, so our state has one leaf
    # more than optax's, `acc_value`; the documented restore says so, and the
    # restore with `acc_value=()` continues with the window's value: its mean
    # over a whole window, over the values seen since the restore mid-window
    # (optax's state never held those before it). It once got the last
    # mini-step's value, silently.
    opts = dict(use_grad_mean=use_grad_mean)
    theirs = optax.MultiSteps(_value_as_update(), K, **opts)
    ours = optax_accum.MultiSteps(_value_as_update(), K, **opts)
    params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
    values = [jnp.float32(2.0**i) for i in range(12)]
    state = theirs.init(params)
    for v in values[:stop]:
        _, state = theirs.update(params, state, params, value=v)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", state)
    abstract = jax.eval_shape(ours.init, params)
    with (
        ocp.StandardCheckpointer() as ckptr,
        pytest.raises(ValueError, match="acc_value"),
    ):
        ckptr.restore(tmp_path / "ckpt", abstract)
    with ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(tmp_path / "ckpt", abstract._replace(acc_value=()))
    update = jax.jit(lambda s, v: ours.update(params, s, params, value=v))
    seen = K - stop % K  # the restored window's values seen after the restore
    emitted = []
    for v in values[stop : stop + seen + K]:
        u, state = update(state, v)
        if bool(ours.has_updated(state)):
            emitted.append(float(u["b"][0]))
    reduce = np.mean if use_grad_mean else np.sum
    rest = np.asarray(values[stop:], np.float64)
    assert emitted == [reduce(rest[:seen]), reduce(rest[seen : seen + K])]
