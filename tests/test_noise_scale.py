# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The gradient noise scale (``noise_scale_decay``) and `adaptive_every_k`.

References: a linear regression whose G and Sigma are analytic, per-example
gradients (vmap) on a small MLP, and the same window formed on 1 device or
split over 2 or 8 with ``axis_name``.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum._noise_scale import NoiseScaleState
from tests.helpers import hlo as _hlo
from tests.helpers.lanes import sweep
from tests.helpers.models import mlp_loss, mlp_params, regression_data

# Linear regression y = x . w* + sigma * eps, x ~ N(0, I_D), loss 0.5 (x.w - y)^2.
# With delta = w - w*: G = delta, Sigma = |delta|^2 I + delta delta^T + sigma^2 I
# (Gaussian fourth moments), so tr(Sigma) / |G|^2 = D + 1 + D sigma^2 / |delta|^2.
D, SIGMA = 4, 1.0


def _linreg_grad(params, x, y):
    w = params["w"]
    return {"w": x.T @ (x @ w - y) / x.shape[0]}


def _linreg_data(key, shape):
    kx, ke = jax.random.split(key)
    x = jax.random.normal(kx, (*shape, D))
    return x, x @ jnp.zeros(D) + SIGMA * jax.random.normal(ke, shape)


def _run(tx, params, grads_of, batches, weights=None, state=None):
    """Feeds micro-batches ``batches[window][micro]`` through ``tx`` in a scan."""

    def micro(state, item):
        batch, w = item
        _, state = tx.update(grads_of(params, *batch), state, params, weight=w)
        return state, None

    def window(state, item):
        return jax.lax.scan(micro, state, item)[0], None

    if weights is None:
        weights = jnp.ones(jax.tree.leaves(batches)[0].shape[:2])
    state = tx.init(params) if state is None else state
    return jax.lax.scan(window, state, (batches, weights))[0]


@pytest.mark.parametrize(
    ("b", "k"), sweep([(4, 4), (2, 8), (8, 2), (16, 4)], fast=[(4, 4)])
)
def test_matches_the_analytic_noise_scale(b, k):
    windows, decay = 4000, 0.999
    # |delta|^2 = 1, so B_simple = 2 D + 1 = 9 examples.
    params = {"w": jnp.full(D, 0.5, jnp.float32)}
    truth = D + 1 + D * SIGMA**2 / float(params["w"] @ params["w"])
    batches = _linreg_data(jax.random.key(b * 100 + k), (windows, k, b))
    tx = optax_accum.accumulate(optax.sgd(0.0), k, noise_scale_decay=decay)
    state = jax.jit(lambda: _run(tx, params, _linreg_grad, batches))()
    est = optax_accum.noise_scale(state, microbatch_size=b)
    assert int(est.windows) == windows
    assert float(est.b_small) == b and float(est.b_big) == b * k

    # The tolerance from the estimator's variance: per-window estimates of
    # S and |G|^2, computed here from the micro-batch gradients directly, give
    # the standard error of the EMA ratio (delta method, EMA of n windows
    # averages like (1 + decay) / (1 - decay) independent ones).
    x, y = batches
    g = jax.vmap(jax.vmap(lambda x, y: _linreg_grad(params, x, y)["w"]))(x, y)
    small = jnp.mean(jnp.sum(g**2, -1), 1)
    big = jnp.sum(jnp.mean(g, 1) ** 2, -1)
    trace = (small - big) / (1 / b - 1 / (b * k)) * 1.0
    grad_sq = (b * k * big - b * small) / (b * k - b)
    lin = trace / jnp.mean(trace) - grad_sq / jnp.mean(grad_sq)
    std_err = float(jnp.std(lin)) * np.sqrt((1 - decay) / (1 + decay))
    assert 3 * std_err < 0.1, std_err  # 10% is at least 3 standard errors
    np.testing.assert_allclose(float(est.b_simple), truth, rtol=0.1)
    np.testing.assert_allclose(float(est.grad_sq), 1.0, rtol=0.1)
    np.testing.assert_allclose(float(est.trace_sigma), truth, rtol=0.1)


def _window_estimates(g, w):
    """The paper's unbiased estimates from per-micro-batch gradients ``g``."""
    W, n = jnp.sum(w), jnp.sum(w > 0)
    small = jnp.sum(w * jnp.sum(g**2, -1)) / W
    big = jnp.sum((jnp.sum(w[:, None] * g, 0) / W) ** 2)
    b_small, b_big = W / n, W
    grad_sq = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1 / b_small - 1 / b_big)
    return grad_sq, trace


@pytest.mark.slow
def test_agrees_with_per_example_gradients_on_an_mlp():
    k, b = 4, 8
    params = mlp_params(1)
    x, y = regression_data(k * b, seed=3)
    flat = lambda t: jnp.concatenate([a.ravel() for a in jax.tree.leaves(t)])
    per_example = jax.vmap(
        lambda x, y: flat(jax.grad(mlp_loss)(params, x[None], y[None]))
    )(x, y)

    def one_window(perm):
        xs, ys = x[perm].reshape(1, k, b, -1), y[perm].reshape(1, k, b, -1)
        tx = optax_accum.accumulate(optax.sgd(0.0), k, noise_scale_decay=0.5)
        state = _run(tx, params, jax.grad(mlp_loss), (xs, ys))
        return optax_accum.noise_scale(state, microbatch_size=b)

    perms = jax.vmap(lambda key: jax.random.permutation(key, k * b))(
        jax.random.split(jax.random.key(0), 512)
    )
    ns = jax.jit(jax.vmap(one_window))(perms)
    # One window: the debiased EMA is that window's estimate, which equals the
    # formula applied to the micro-batch means of the per-example gradients.
    g = per_example[perms].reshape(len(perms), k, b, -1).mean(2)
    grad_sq, trace = jax.vmap(_window_estimates, (0, None))(g, jnp.ones(k))
    np.testing.assert_allclose(ns.trace_sigma, trace * b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(ns.grad_sq, grad_sq, rtol=1e-4, atol=1e-6)
    # Averaged over random splits of the 32 examples, S is unbiased for the
    # exact covariance trace (1/(n-1) normalisation): the finite-population
    # correction of drawing micro-batches without replacement cancels exactly.
    exact_trace = jnp.sum(jnp.var(per_example, 0, ddof=1))
    exact_grad_sq = jnp.sum(jnp.mean(per_example, 0) ** 2) - exact_trace / (k * b)
    std_err = float(jnp.std(ns.trace_sigma)) / np.sqrt(len(perms))
    assert abs(float(jnp.mean(ns.trace_sigma) - exact_trace)) < 4 * std_err
    assert 4 * std_err < 0.05 * float(exact_trace)
    std_err = float(jnp.std(ns.grad_sq)) / np.sqrt(len(perms))
    assert abs(float(jnp.mean(ns.grad_sq) - exact_grad_sq)) < 4 * std_err


def test_unequal_weights_enter_as_units():
    # Token weighting: micro-batch i weighs w_i tokens; B counts tokens.
    k = 4
    g = jax.random.normal(jax.random.key(2), (3, k, 5))
    w = jnp.array([[3.0, 1.0, 7.0, 2.0], [1.0, 1.0, 1.0, 1.0], [0.0, 2.0, 5.0, 1.0]])
    tx = optax_accum.accumulate(optax.sgd(0.0), k, noise_scale_decay=0.5)
    params = {"w": jnp.zeros(5)}
    state = _run(tx, params, lambda p, g: {"w": g}, (g,), w)
    ns = optax_accum.noise_scale(state)
    grad_sq, trace = jax.vmap(_window_estimates)(g, w)
    # Windows 1..3 in an EMA of decay 0.5, debiased by 1 - 0.5**3.
    ema = lambda v: (0.25 * v[0] + 0.5 * v[1] + v[2]) / 1.75
    np.testing.assert_allclose(ns.grad_sq, ema(grad_sq), rtol=1e-5)
    np.testing.assert_allclose(ns.trace_sigma, ema(trace), rtol=1e-5)
    # The last window: a zero weight does not count as a micro-batch.
    assert float(ns.b_big) == 8.0
    np.testing.assert_allclose(ns.b_small, 8.0 / 3, rtol=1e-6)


def _sharded_state(devices, k, g, w):
    """Runs windows of ``k`` micro-steps per device over ``devices`` devices."""
    mesh = jax.make_mesh((devices,), ("d",), devices=jax.devices()[:devices])
    tx = optax_accum.accumulate(optax.sgd(0.1), k, axis_name="d", noise_scale_decay=0.7)
    params = {"w": jnp.zeros(g.shape[-1])}
    specs = optax_accum.state_specs(jax.eval_shape(tx.init, params), "d")

    def body(g, w, state):
        # g: (windows, k, 1, dim) on this device.
        return _run(tx, params, lambda p, g: {"w": g[0]}, (g,), w[..., 0], state)

    data = P(None, None, "d")
    run = jax.shard_map(body, mesh=mesh, in_specs=(data, data, specs), out_specs=specs)
    init = jax.shard_map(
        lambda: tx.init(params), mesh=mesh, in_specs=(), out_specs=specs
    )
    put = lambda a: jax.device_put(a, NamedSharding(mesh, data))
    return jax.jit(run)(put(g), put(w), jax.jit(init)())


@pytest.mark.slow
def test_invariant_to_how_the_big_batch_is_formed():
    windows, k = 5, 8
    g = jax.random.normal(jax.random.key(5), (windows, k, 6))
    w = jax.random.uniform(jax.random.key(6), (windows, k), minval=0.5, maxval=3.0)
    tx = optax_accum.accumulate(optax.sgd(0.1), k, noise_scale_decay=0.7)
    params = {"w": jnp.zeros(6)}
    one = optax_accum.noise_scale(_run(tx, params, lambda p, g: {"w": g}, (g,), w))

    def split(a, devices):
        # Device d holds micro-batches d*per .. (d+1)*per - 1 of each window.
        return jnp.swapaxes(a.reshape(windows, devices, k // devices, -1), 1, 2)

    for devices in (2, 8):
        gs, ws = split(g, devices), split(w[..., None], devices)[..., 0]
        state = _sharded_state(devices, k // devices, gs, ws)
        many = optax_accum.noise_scale(state)
        for a, b in zip(one, many, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5)


@pytest.mark.slow
def test_window_sums_join_the_one_all_reduce():
    params = {"w": jnp.zeros((16, 8)), "b": jnp.zeros(8)}
    mesh = jax.make_mesh((8,), ("d",))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("d")))
    counts = []
    for decay in (None, 0.9):
        tx = optax_accum.accumulate(
            optax.adam(1e-3), 4, axis_name="d", noise_scale_decay=decay
        )
        specs = optax_accum.state_specs(jax.eval_shape(tx.init, params), "d")
        init = jax.shard_map(
            lambda tx=tx: tx.init(params), mesh=mesh, in_specs=(), out_specs=specs
        )
        grads = jax.tree.map(lambda p: put(jnp.ones((8, *p.shape))), params)
        update = jax.shard_map(
            lambda g, s, tx=tx: tx.update(jax.tree.map(lambda a: a[0], g), s, params),
            mesh=mesh,
            in_specs=(P("d"), specs),
            out_specs=(P(), specs),
        )
        hlo = jax.jit(update).lower(grads, jax.jit(init)()).compile().as_text()
        counts.append(len(_hlo.ALL_REDUCE.findall(hlo)))
    assert counts == [1, 1]


def _growing_noise_run(num_windows_k, **kw):
    """SGD on the linear regression: |G| shrinks, so B_simple grows."""
    every_k = optax_accum.adaptive_every_k(2, 64, **kw)
    tx = optax_accum.accumulate(optax.sgd(0.3), every_k, noise_scale_decay=0.8)
    b = 4

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, state, key):
        x, y = _linreg_data(key, (b,))
        g = _linreg_grad(params, x, y)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    return tx, step, b


def test_adaptive_k_grows_with_the_noise_scale_without_recompiling():
    chex.clear_trace_counter()
    tx, step, b = _growing_noise_run(None)
    params = {"w": jnp.full(D, 3.0, jnp.float32)}
    state = tx.init(params)
    ks, b_simple = [], []
    keys = jax.random.split(jax.random.key(0), 600)
    for key in keys:
        params, state = step(params, state, key)
        if optax_accum.has_updated(state):
            ns = optax_accum.noise_scale(state, microbatch_size=b)
            # The next window's k is the rule applied to the current estimate.
            want = np.clip(np.ceil(float(ns.b_simple) / b), 2, 64)
            assert int(ns.k) == want
            ks.append(int(ns.k))
            b_simple.append(float(ns.b_simple))
    assert ks[0] <= 3 and ks[-1] >= 16, ks
    assert b_simple[-1] > 5 * b_simple[0]


@pytest.mark.slow
def test_adaptive_k_resumes_from_orbax_bit_for_bit(tmp_path):
    chex.clear_trace_counter()
    tx, step, _ = _growing_noise_run(None, never_decrease=True)
    params0 = {"w": jnp.full(D, 3.0, jnp.float32)}
    keys = jax.random.split(jax.random.key(1), 120)

    def train(params, state, keys):
        for key in keys:
            params, state = step(params, state, key)
        return params, state

    full = train(params0, tx.init(params0), keys)
    half = train(params0, tx.init(params0), keys[:61])
    assert int(half[1].micro_step) > 0  # mid-window
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", half)
    abstract = jax.eval_shape(lambda: (params0, tx.init(params0)))
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(tmp_path / "ckpt", abstract)
    resumed = train(*restored, keys[61:])
    chex.assert_trees_all_equal(resumed, full)
    assert int(optax_accum.noise_scale(full[1]).k) > 2


def test_scale_learning_rate_follows_the_adaptive_k():
    # The inner LR is an injected hyperparameter; before each update it is set
    # from the current window's k: base LR tuned at k0 micro-batches, sqrt rule.
    base_lr, k0 = 0.1, 2
    every_k = optax_accum.adaptive_every_k(2, 8)
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=base_lr)
    tx = optax_accum.accumulate(inner, every_k, noise_scale_decay=0.5)
    params = {"w": jnp.zeros(3)}

    @jax.jit
    def step(params, state, g):
        k = optax_accum.noise_scale(state).k
        lr = optax_accum.scale_learning_rate(base_lr, k0, k, rule="sqrt")
        state.inner_state.hyperparams["learning_rate"] = lr
        updates, state = tx.update(g, state, params)
        return updates, state, k

    state = tx.init(params)
    rng = np.random.default_rng(0)
    seen = set()
    for i in range(60):
        g = {"w": jnp.asarray(rng.normal(size=3) * (1 + 5 * (i > 20)), jnp.float32)}
        _, state, k = step(params, state, g)
        if optax_accum.has_updated(state):
            lr = float(state.inner_state.hyperparams["learning_rate"])
            np.testing.assert_allclose(lr, base_lr * np.sqrt(int(k) / k0), rtol=1e-6)
            seen.add(int(k))
    assert len(seen) > 1


def test_off_by_default_the_state_and_program_are_unchanged():
    params = {"w": jnp.zeros((16, 8)), "b": jnp.zeros(8)}
    g = jax.tree.map(jnp.ones_like, params)
    off = optax_accum.accumulate(optax.adam(1e-3), 4)
    on = optax_accum.accumulate(optax.adam(1e-3), 4, noise_scale_decay=0.9)
    state = off.init(params)
    is_ns = lambda x: isinstance(x, NoiseScaleState)
    assert not any(map(is_ns, jax.tree.leaves(state, is_leaf=is_ns)))
    assert state.noise_scale == ()
    # The leaves of the state before the feature: 2 counters, 2 accumulator
    # leaves, the weight sum, adam's 5, num_skipped and updated.
    assert len(jax.tree.leaves(state)) == 2 + 2 + 1 + 5 + 2
    ms = optax_accum.MultiSteps(optax.adam(1e-3), 4).init(params)
    ref = optax.MultiSteps(optax.adam(1e-3), 4).init(params)
    assert len(jax.tree.leaves(ms)) == len(jax.tree.leaves(ref))

    def hlo(tx):
        f = jax.jit(lambda g, s: tx.update(g, s, params))
        return f.lower(g, tx.init(params)).compile().as_text()

    # adam is elementwise: without the estimator there is no reduction at all.
    assert " reduce(" not in hlo(off) and "reduce(" in hlo(on)


def test_multisteps_and_nnx_state_read_the_same():
    k = 3
    g = jax.random.normal(jax.random.key(3), (4, k, 5))
    params = {"w": jnp.zeros(5)}
    tx = optax_accum.accumulate(optax.sgd(0.0), k, noise_scale_decay=0.6)
    ref = optax_accum.noise_scale(_run(tx, params, lambda p, g: {"w": g}, (g,)))
    ms = optax_accum.MultiSteps(optax.sgd(0.0), k, noise_scale_decay=0.6)
    state = ms.init(params)
    update = jax.jit(ms.update)
    for gi in g.reshape(-1, 5):
        _, state = update({"w": gi}, state, params)
    chex.assert_trees_all_close(optax_accum.noise_scale(state), ref, rtol=1e-6)

    model = nnx.Linear(5, 1, rngs=nnx.Rngs(0))
    # Our state inside a chain, inside nnx's wrapped opt_state. (Not clipping:
    # a clip before the accumulator is the mistake that warns.)
    chain = optax.chain(optax.scale(1.0), tx)
    optimizer = nnx.Optimizer(model, chain, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, gi):
        grads = nnx.State({"kernel": nnx.Param(gi[:, None]), "bias": nnx.Param(gi[:1])})
        optimizer.update(model, grads)

    for gi in g.reshape(-1, 5):
        step(model, optimizer, gi)
    ns = optax_accum.noise_scale(optimizer.opt_state)
    assert int(ns.windows) == 4


def test_bad_input():
    sgd = optax.sgd(0.1)
    for decay in (0.0, 1.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="noise_scale_decay"):
            optax_accum.accumulate(sgd, 2, noise_scale_decay=decay)
    for decay in (True, "0.9"):
        with pytest.raises(TypeError, match="noise_scale_decay"):
            optax_accum.accumulate(sgd, 2, noise_scale_decay=decay)
    with pytest.raises(ValueError, match="noise_scale_decay"):
        optax_accum.MultiSteps(sgd, 2, noise_scale_decay=2.0)
    with pytest.raises(ValueError, match="reduction"):
        optax_accum.accumulate(sgd, 2, reduction="sum", noise_scale_decay=0.9)
    vg = jax.value_and_grad(mlp_loss)
    with pytest.raises(ValueError, match="noise_scale_decay"):
        optax_accum.microbatch(vg, 2, noise_scale_decay=1.0)
    with pytest.raises(ValueError, match="reduction"):
        optax_accum.microbatch(vg, 2, reduction="sum", noise_scale_decay=0.9)
    with pytest.raises(ValueError, match="min_k"):
        optax_accum.adaptive_every_k(8, 4)
    with pytest.raises(ValueError, match="min_k"):
        optax_accum.adaptive_every_k(0, 4)
    with pytest.raises(TypeError, match="max_k"):
        optax_accum.adaptive_every_k(1, 4.5)
    with pytest.raises(ValueError, match="init_k"):
        optax_accum.adaptive_every_k(2, 4, init_k=5)
    with pytest.raises(ValueError, match="noise_scale_decay"):
        optax_accum.accumulate(sgd, optax_accum.adaptive_every_k(2, 4))
    state = optax_accum.accumulate(sgd, 2, noise_scale_decay=0.9).init(jnp.zeros(2))
    for b in (0, -4):
        with pytest.raises(ValueError, match="microbatch_size"):
            optax_accum.noise_scale(state, microbatch_size=b)
    with pytest.raises(ValueError, match="NoiseScaleState"):
        optax_accum.noise_scale(optax_accum.accumulate(sgd, 2).init(jnp.zeros(2)))


def test_one_micro_batch_windows_on_one_device_are_refused():
    # k = 1 on one device measures nothing: B_simple would stay NaN forever.
    with pytest.raises(ValueError, match=r"`noise_scale_decay`.*`every_k`=1"):
        optax_accum.accumulate(optax.sgd(0.1), 1, noise_scale_decay=0.9)
    # With an axis name every device's micro-batch is one of the window's.
    g = np.arange(8 * 2, dtype=np.float32).reshape(4, 1, 4, 1)  # 4 windows
    state = _sharded_state(4, 1, g, np.ones((4, 1, 4), np.float32))
    ns = optax_accum.noise_scale(state)
    assert int(ns.windows) == 4 and float(ns.b_small) == 1.0
    assert np.isfinite(float(ns.b_simple))


@pytest.mark.slow
def test_microbatch_matches_accumulate_and_tracks_the_ema():
    k = 4
    params = mlp_params(1)
    x, y = regression_data(3 * 64, seed=3)
    f = jax.jit(
        optax_accum.microbatch(
            jax.value_and_grad(mlp_loss), k, batch_argnums=(1, 2), noise_scale_decay=0.5
        )
    )
    tx = optax_accum.accumulate(optax.sgd(0.0), k, noise_scale_decay=0.5)
    state, tracker = tx.init(params), None
    for step in range(3):
        xs, ys = x[step * 64 : (step + 1) * 64], y[step * 64 : (step + 1) * 64]
        (value, grads), tracker = f(params, xs, ys, noise_scale=tracker)
        ref_value, ref_grads = jax.value_and_grad(mlp_loss)(params, xs, ys)
        np.testing.assert_allclose(value, ref_value, rtol=1e-5)
        chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-7)
        for i in range(k):  # microbatch's split: rows i, i + k, ...
            g = jax.grad(mlp_loss)(params, xs[i::k], ys[i::k])
            _, state = tx.update(g, state, params)
    # microbatch counts rows; accumulate counts micro-batches of 16 rows.
    chex.assert_trees_all_close(
        optax_accum.noise_scale(tracker),
        optax_accum.noise_scale(state, microbatch_size=16),
        rtol=1e-5,
    )
    assert int(tracker.windows) == 3 and float(tracker.b_big) == 64


@pytest.mark.slow
def test_microbatch_device_local_loop_uses_device_micro_batches():
    # Batch sharded over 8 devices: each device's part of a micro-batch (2 of
    # its 16 rows) is a micro-batch of the estimate, B_small = 2, B_big = 64.
    k, n_dev = 4, 8
    params = mlp_params(1)
    x, y = regression_data(64, seed=7)
    mesh = jax.make_mesh((n_dev,), ("data",))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
    fun = optax_accum.microbatch(
        jax.value_and_grad(mlp_loss),
        k,
        batch_argnums=(1, 2),
        noise_scale_decay=0.5,
        data_axes="data",  # the device-local loop
    )
    with jax.set_mesh(mesh):
        (value, _), tracker = jax.jit(fun)(params, put(x), put(y))
    np.testing.assert_allclose(value, mlp_loss(params, x, y), rtol=1e-5)
    ns = optax_accum.noise_scale(tracker)
    assert float(ns.b_small) == 2 and float(ns.b_big) == 64
    flat = lambda t: jnp.concatenate([a.ravel() for a in jax.tree.leaves(t)])
    view = lambda a: a.reshape(64 // k, k, -1)  # micro-batch i is view[:, i]
    g = jnp.stack(
        [
            flat(
                jax.grad(mlp_loss)(
                    params, view(x)[2 * d : 2 * d + 2, i], view(y)[2 * d : 2 * d + 2, i]
                )
            )
            for i in range(k)
            for d in range(n_dev)
        ]
    )
    grad_sq, trace = _window_estimates(g, jnp.full(k * n_dev, 2.0))
    np.testing.assert_allclose(ns.grad_sq, grad_sq, rtol=1e-4)
    np.testing.assert_allclose(ns.trace_sigma, trace, rtol=1e-4)


@pytest.mark.slow
def test_flax_helpers_return_the_tracker():
    from flax.training import train_state

    from optax_accum.flax import linen_train_step, nnx_train_step

    k = 4
    x = jax.random.normal(jax.random.key(0), (32, 3))
    y = jax.random.normal(jax.random.key(1), (32, 1))
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    w0 = {"kernel": model.kernel[...], "bias": model.bias[...]}
    loss = lambda p, x, y: jnp.mean((x @ p["kernel"] + p["bias"] - y) ** 2)
    fun = optax_accum.microbatch(
        jax.value_and_grad(loss), k, batch_argnums=(1, 2), noise_scale_decay=0.8
    )
    _, ref = fun(w0, x, y)
    ref = optax_accum.noise_scale(ref)

    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = nnx.jit(
        nnx_train_step(
            lambda m, x, y: jnp.mean((m(x) - y) ** 2), k, noise_scale_decay=0.8
        )
    )
    _, tracker = step(model, optimizer, x, y)
    chex.assert_trees_all_close(optax_accum.noise_scale(tracker), ref, rtol=1e-5)
    _, tracker = step(model, optimizer, x, y, noise_scale=tracker)
    assert int(tracker.windows) == 2

    class TrainState(train_state.TrainState):
        batch_stats: dict

    state = TrainState.create(
        apply_fn=None, params=w0, tx=optax.sgd(0.1), batch_stats={}
    )
    lstep = jax.jit(
        linen_train_step(
            lambda p, stats, rng, x, y: (loss(p, x, y), stats),
            k,
            noise_scale_decay=0.8,
        )
    )
    state, _, tracker = lstep(state, x, y)
    chex.assert_trees_all_close(optax_accum.noise_scale(tracker), ref, rtol=1e-5)


def test_state_can_be_donated_and_multisteps_adapts_k():
    # Every state leaf is its own buffer, so a donated state is accepted.
    every_k = optax_accum.adaptive_every_k(2, 8)
    ms = optax_accum.MultiSteps(optax.sgd(0.1), every_k, noise_scale_decay=0.5)
    params = {"w": jnp.zeros(3)}
    update = jax.jit(ms.update, donate_argnums=1)
    state = ms.init(params)
    assert isinstance(state, optax_accum.MultiStepsState)
    rng = np.random.default_rng(0)
    for _ in range(12):
        g = {"w": jnp.asarray(rng.normal(size=3) * 10, jnp.float32)}
        _, state = update(g, state, params)
    # Pure noise around a zero mean: B_simple is large, so k goes to max_k.
    assert int(optax_accum.noise_scale(state).k) == 8


@pytest.mark.slow
@pytest.mark.parametrize(
    "face", sweep(["accumulate", "MultiSteps"], fast=["MultiSteps"])
)
def test_float64_gradients_measure_as_float32_ones_do(face):
    # oracle-1: the boundary's noise sums were float64 under x64, the hold
    # branch's float32, and the lax.cond failed at trace time.
    def run(dtype):
        if face == "accumulate":
            tx = optax_accum.accumulate(optax.sgd(1.0), 2, noise_scale_decay=0.5)
        else:
            tx = optax_accum.MultiSteps(
                optax.sgd(1.0), 2, noise_scale_decay=0.5
            ).gradient_transformation()
        p = jnp.ones(3, dtype)
        state = tx.init(p)
        for g in ([1.0, 2.0, 0.5], [3.0, -1.0, 2.0], [0.0, 1.0, 1.0], [2.0, 2.0, 1.0]):
            _, state = tx.update(jnp.asarray(g, dtype), state, p)
        return optax_accum.noise_scale(state)

    want = run(jnp.float32)
    with jax.enable_x64(True):
        got = run(jnp.float64)
    assert int(got.windows) == 2
    chex.assert_trees_all_close(got, want, rtol=1e-6)
