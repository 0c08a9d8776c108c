# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`offload`'s invariant: whatever memory a state leaf arrives in, the step
returns it where `offload` keeps it (issue 33, section 1).

Each path that delivers a leaf in device memory is run as a user would:
an Orbax restore (into ``jax.eval_shape(tx.init, params)``, into
`state_shardings`, into a device target), a written hyperparameter, a
``jnp.where`` outside `offload` (``optax.apply_if_finite``), PRNG keys in
the state, a state built with `state_shardings`' shardings, mixed
placements, Flax's ``nnx.Optimizer``, the fused step and ``lax.scan`` loops.
Each run is compared leaf by leaf with an uninterrupted run, or with the
same optimizer without `offload`. Donation on one device is checked in a
subprocess (an abort there would kill pytest).
"""

import contextlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from tests.helpers import layouts
from tests.helpers.lanes import sweep

K = 2
WRAPPERS = {
    "accumulate": lambda inner: optax_accum.accumulate(inner, K),
    "MultiSteps": lambda inner: optax_accum.MultiSteps(inner, K),
}


def _setup(placement):
    params = layouts.params()
    rng = np.random.default_rng(3)
    grads = [
        jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
        for _ in range(5)
    ]
    if placement == "one_device":
        return None, params, grads
    layout = layouts.LAYOUTS["fsdp"]
    mesh = layouts.mesh(layout, explicit=placement == "fsdp_explicit")
    place = lambda tree: layouts.place(layout, mesh, tree)
    return mesh, place(params), [place(g) for g in grads]


def _ctx(mesh):
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def _inner(state):
    return state.inner_state if hasattr(state, "inner_state") else state.inner_opt_state


def _kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _assert_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _spec(x):
    """``x``'s partition spec without trailing ``None`` s."""
    spec = tuple(x.sharding.spec if hasattr(x, "sharding") else x.spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


def _target(kind, tx, params, state):
    """The abstract state Orbax restores into."""
    if kind == "eval_shape":
        return jax.eval_shape(tx.init, params)
    shardings = optax_accum.state_shardings(tx, params)
    if kind == "device":
        shardings = jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        state,
        shardings,
    )


# Orbax cannot restore into an Explicit mesh's `eval_shape` (its shardings
# name an AbstractMesh), whatever the optimizer: `state_shardings` there.
RESTORES = [
    (w, p, t)
    for w in WRAPPERS
    for p in ("one_device", "fsdp_explicit", "fsdp_auto")
    for t in ("eval_shape", "state_shardings", "device")
    if not (p == "fsdp_explicit" and t == "eval_shape")
]


@pytest.mark.parametrize(
    "wrapper,placement,target",
    sweep(
        RESTORES,
        fast=[
            ("accumulate", "one_device", "eval_shape"),
            ("MultiSteps", "fsdp_explicit", "device"),
        ],
    ),
)
def test_restored_state_continues_exactly_and_returns_to_host(
    tmp_path, wrapper, placement, target
):
    mesh, params, grads = _setup(placement)
    tx = WRAPPERS[wrapper](optax_accum.offload(optax.adamw(1e-2, weight_decay=0.1)))
    with _ctx(mesh):
        step = jax.jit(tx.update)
        state = tx.init(params)
        for g in grads[:3]:  # the middle of the second window
            _, state = step(g, state, params)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp_path / "state", state)
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(
                tmp_path / "state", _target(target, tx, params, state)
            )
        if target != "state_shardings":
            assert _kinds(_inner(restored)) == {"device"}
        for g in grads[3:]:
            u_a, state = step(g, state, params)
            u_b, restored = step(g, restored, params)
            assert _kinds(_inner(restored)) == {"pinned_host"}
    _assert_equal((u_a, state), (u_b, restored))


@pytest.mark.parametrize("wrapper", sweep(list(WRAPPERS), fast=["accumulate"]))
def test_written_hyperparameter_is_used_and_returns_to_host(wrapper):
    _, params, grads = _setup("one_device")

    def run(write):
        inject = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
        tx = WRAPPERS[wrapper](optax_accum.offload(inject))
        step, state = jax.jit(tx.update), tx.init(params)
        out = []
        for i, g in enumerate(grads):
            if i == 2:
                write(_inner(state).hyperparams)
            updates, state = step(g, state, params)
            out.append(updates)
        assert _kinds(_inner(state)) == {"pinned_host"}
        return out, state

    def on_device(h):
        h["learning_rate"] = jnp.float32(1e-3)

    def in_host(h):  # the reference: the same value where offload keeps it
        h["learning_rate"] = jax.device_put(
            jnp.float32(1e-3), h["learning_rate"].sharding
        )

    _assert_equal(run(on_device), run(in_host))


def test_prng_keys_in_the_state_give_the_plain_optimizers_noise():
    # optax.add_noise holds a key: it stays in device memory (JAX 0.10 types
    # a key in host memory as device memory inside a jitted program).
    _, params, grads = _setup("one_device")

    def run(offloaded):
        inner = optax.chain(optax.add_noise(0.1, 0.5, 0), optax.adam(1e-2))
        tx = WRAPPERS["accumulate"](optax_accum.offload(inner) if offloaded else inner)
        step, state = jax.jit(tx.update), tx.init(params)
        for g in grads:
            updates, state = step(g, state, params)
        return updates, state

    plain, offl = run(False), run(True)
    _assert_equal(plain, offl)
    key = offl[1].inner_state[0].rng_key
    assert key.sharding.memory_kind == "device"
    assert _kinds(offl[1].inner_state[1]) == {"pinned_host"}


def test_a_where_outside_offload_leaves_the_state_in_host():
    # optax.apply_if_finite picks the new or the old state with jnp.where,
    # on the device: the boundary puts it back where the hold step keeps it.
    _, params, grads = _setup("one_device")
    grads[1] = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads[1])

    def run(offloaded):
        adam = optax_accum.offload(optax.adam(1e-2)) if offloaded else optax.adam(1e-2)
        tx = WRAPPERS["accumulate"](optax.apply_if_finite(adam, 3))
        step, state = jax.jit(tx.update), tx.init(params)
        for g in grads:
            updates, state = step(g, state, params)
        return updates, state

    plain, offl = run(False), run(True)
    _assert_equal(plain, offl)
    assert int(offl[1].inner_state.total_notfinite) == 1
    assert _kinds(offl[1].inner_state.inner_state) == {"pinned_host"}


@pytest.mark.parametrize(
    "placement", sweep(["fsdp_explicit", "fsdp_auto"], fast=["fsdp_auto"])
)
def test_state_built_with_state_shardings_in_device_memory_moves_to_host(placement):
    mesh, params, grads = _setup(placement)
    tx = WRAPPERS["accumulate"](optax_accum.offload(optax.adamw(1e-2)))
    with _ctx(mesh):
        shardings = optax_accum.state_shardings(tx, params)
        on_device = jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)
        state = jax.jit(tx.init, out_shardings=on_device)(params)
        reference = jax.jit(tx.init, out_shardings=shardings)(params)
        step = jax.jit(tx.update)
        for g in grads:
            u_a, state = step(g, state, params)
            u_b, reference = step(g, reference, params)
            assert _kinds(_inner(state)) == {"pinned_host"}
    _assert_equal((u_a, state), (u_b, reference))


def _mixed_params(axis_type):
    mesh = jax.make_mesh(
        (2,), ("stage",), devices=jax.devices()[:2], axis_types=(axis_type,)
    )
    stages = jax.device_put(jnp.ones((2, 3, 3)), NamedSharding(mesh, P("stage")))
    return mesh, {"embed": jnp.ones((4, 3)), "stages": stages}


@pytest.mark.parametrize(
    "mode",
    sweep(
        ["auto_no_set_mesh", "explicit_no_set_mesh", "auto", "explicit"],
        fast=["explicit", "explicit_no_set_mesh"],
    ),
)
def test_mixed_placements_init_and_step(mode):
    # The pipeline guide's layout: stages on a mesh, the embedding on one
    # device; the state of the embedding is replicated on the mesh.
    kind = AxisType.Explicit if mode.startswith("explicit") else AxisType.Auto
    mesh, params = _mixed_params(kind)
    grads = jax.tree.map(lambda p: 0.5 * jnp.ones_like(p), params)
    with _ctx(None if mode.endswith("no_set_mesh") else mesh):
        plain = WRAPPERS["accumulate"](optax.adam(1e-2))
        tx = WRAPPERS["accumulate"](optax_accum.offload(optax.adam(1e-2)))
        s_plain, state = plain.init(params), tx.init(params)
        assert _kinds(state.inner_state) == {"pinned_host"}
        assert state.inner_state[0].mu["stages"].sharding.spec == P("stage")
        for _ in range(3):
            u_plain, s_plain = jax.jit(plain.update)(grads, s_plain, params)
            u, state = jax.jit(tx.update)(grads, state, params)
        assert _kinds(state.inner_state) == {"pinned_host"}
    _assert_equal((u_plain, s_plain), (u, state))


def _masked_txs():
    mask = {"w1": True, "b1": False, "w2": True}
    labels = {"w1": "a", "b1": "b", "w2": "a"}
    return {
        "masked": lambda: optax.masked(optax.adam(1e-2), mask),
        "multi_transform": lambda: optax.multi_transform(
            {"a": optax.adam(1e-2), "b": optax.sgd(1e-2, momentum=0.9)}, labels
        ),
    }


def _moments(state, name):
    """Every buffer of ``state`` that mirrors parameter ``name``."""
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    return [x for path, x in paths if path[-1] == jax.tree_util.DictKey(name)]


@pytest.mark.parametrize(
    "optimizer,placement,offloaded",
    sweep(
        [
            (o, p, f)
            for o in _masked_txs()
            for p in ("fsdp_explicit", "fsdp_auto")
            for f in (False, True)
        ],
        fast=[
            ("masked", "fsdp_explicit", True),
            ("multi_transform", "fsdp_auto", False),
        ],
    ),
)
def test_state_shardings_give_masked_buffers_their_parameters_specs(
    optimizer, placement, offloaded
):
    mesh, params, grads = _setup(placement)
    inner = _masked_txs()[optimizer]()
    inner = optax_accum.offload(inner) if offloaded else inner
    tx = WRAPPERS["accumulate"](inner)
    with _ctx(mesh):
        shardings = optax_accum.state_shardings(tx, params)
        for name in ("w1", "w2"):
            specs = {_spec(s) for s in _moments(shardings.inner_state, name)}
            assert specs == {_spec(params[name])}, (name, specs)
        state = jax.jit(tx.init, out_shardings=shardings)(params)
        step = jax.jit(tx.update)
        for g in grads:
            _, state = step(g, state, params)
        for name in ("w1", "w2"):
            for x in _moments(state.inner_state, name):
                assert _spec(x) == _spec(params[name])
        if offloaded:
            assert _kinds(state.inner_state) == {"pinned_host"}


def _restored_on_one_device(tmp_path, tx, params, grads):
    """A state saved mid-window and restored into ``eval_shape`` (device)."""
    state = tx.init(params)
    step = jax.jit(tx.update)
    for g in grads[:3]:
        _, state = step(g, state, params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "state", state)
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(tmp_path / "state", jax.eval_shape(tx.init, params))
    return state, restored


def test_scan_loop_takes_a_restored_state_put_back_with_state_shardings(tmp_path):
    # A lax.scan carry keeps its type, so a state restored into device
    # memory goes back where `offload` keeps it first (the guides' recipe).
    _, params, grads = _setup("one_device")
    tx = WRAPPERS["accumulate"](optax_accum.offload(optax.adam(1e-2)))
    state, restored = _restored_on_one_device(tmp_path, tx, params, grads)
    restored = jax.device_put(restored, optax_accum.state_shardings(tx, params))
    assert _kinds(restored.inner_state) == {"pinned_host"}
    stacked = jax.tree.map(lambda *g: jnp.stack(g), *grads[3:])

    @jax.jit
    def loop(state):
        def body(state, g):
            updates, state = tx.update(g, state, params)
            return state, updates

        return jax.lax.scan(body, state, stacked)

    _assert_equal(loop(state), loop(restored))


@pytest.mark.parametrize("face", sweep(["accumulate", "fused"], fast=["fused"]))
def test_scan_loop_with_a_prng_key_in_the_state(face):
    # A key in host memory would enter the loop typed as device memory and
    # leave it in host memory: the carry's type would change.
    _, params, grads = _setup("one_device")

    def loop(offloaded):
        inner = optax.chain(optax.add_noise(0.1, 0.5, 0), optax.adam(1e-2))
        inner = optax_accum.offload(inner) if offloaded else inner
        tx = WRAPPERS["accumulate"](inner) if face == "accumulate" else inner
        stacked = jax.tree.map(lambda *g: jnp.stack(g), *grads)

        def body(state, g):
            updates, state = tx.update(g, state, params)
            return state, updates

        return jax.jit(lambda s: jax.lax.scan(body, s, stacked))(tx.init(params))

    _assert_equal(loop(False), loop(True))


def test_fused_step_takes_a_restored_state_and_returns_it_to_host(tmp_path):
    _, params, grads = _setup("one_device")
    tx = optax_accum.offload(optax.adamw(1e-2))
    x, y = layouts.data(16)
    grad_fn = optax_accum.microbatch_value_and_grad(
        layouts.loss_fn(None), 4, batch_argnums=(1, 2)
    )

    @jax.jit
    def step(params, state):
        _, g = grad_fn(params, x, y)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    state, restored = _restored_on_one_device(tmp_path, tx, params, grads)
    assert _kinds(restored) == {"device"}
    a, b = (params, state), (params, restored)
    for _ in range(2):
        a, b = step(*a), step(*b)
        assert _kinds(b[1]) == {"pinned_host"}
    _assert_equal(a, b)


def test_nnx_optimizer_restored_through_nnx_eval_shape_continues(tmp_path):
    nnx = pytest.importorskip("flax.nnx")
    from optax_accum.flax import nnx_train_step

    def make():
        model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
        tx = WRAPPERS["MultiSteps"](optax_accum.offload(optax.adam(1e-2)))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    rng = np.random.default_rng(0)
    batches = [
        (jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
         jnp.asarray(rng.normal(size=(8, 2)), jnp.float32))
        for _ in range(5)
    ]  # fmt: skip
    step = nnx.jit(nnx_train_step(lambda m, x, y: jnp.mean((m(x) - y) ** 2), 2))
    model, optimizer = make()
    for b in batches[:3]:
        step(model, optimizer, *b)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "nnx", nnx.state((model, optimizer)))
    abstract = nnx.eval_shape(make)
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(tmp_path / "nnx", nnx.state(abstract))
    nnx.update(abstract, restored)
    model_b, optimizer_b = abstract
    for b in batches[3:]:
        step(model, optimizer, *b)
        step(model_b, optimizer_b, *b)
    leaves = jax.tree.leaves(nnx.state(optimizer_b.opt_state.inner_opt_state))
    assert {x.sharding.memory_kind for x in leaves} == {"pinned_host"}
    _assert_equal(nnx.state((model, optimizer)), nnx.state((model_b, optimizer_b)))


def test_a_state_of_another_structure_is_refused_naming_offload():
    _, params, grads = _setup("one_device")
    tx = WRAPPERS["MultiSteps"](optax_accum.offload(optax.adam(1e-2)))
    state = tx.init(params)
    other = optax.sgd(0.1, momentum=0.9).init(params)  # a state of another tx
    with pytest.raises(
        ValueError, match=r"`offload`.* 3 leaves.*gives 7.*\[0\]\.trace\['b1'\]"
    ):
        jax.jit(tx.update)(grads[0], state._replace(inner_opt_state=other), params)


def test_state_shardings_on_one_device_and_unplaced_params():
    _, params, _ = _setup("one_device")
    tx = WRAPPERS["accumulate"](optax_accum.offload(optax.adam(1e-2)))
    shardings = optax_accum.state_shardings(tx, params)
    mu = shardings.inner_state[0].mu["w1"]
    assert mu == jax.sharding.SingleDeviceSharding(
        jax.devices()[0], memory_kind="pinned_host"
    )
    assert shardings.accumulator["w1"].memory_kind == "device"
    state = jax.jit(tx.init, out_shardings=shardings)(params)
    assert _kinds(state.inner_state) == {"pinned_host"}
    with pytest.raises(ValueError, match=r"`params` must be placed"):
        optax_accum.state_shardings(tx, jax.eval_shape(lambda: params))


_DONATE = """
import jax, jax.numpy as jnp, optax, optax_accum
tx = optax_accum.accumulate(optax_accum.offload(optax.adamw(1e-2)), 2)
params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
state = tx.init(params)
on = jax.tree.map(lambda x: x.sharding, params)
shardings = optax_accum.state_shardings(tx, params)
step = jax.jit(
    tx.update,
    donate_argnums=1,
    in_shardings=(on, shardings, on),
    out_shardings=(on, shardings),
)
for _ in range(3):
    old = state
    _, state = step(jax.tree.map(jnp.ones_like, params), state, params)
    assert all(x.is_deleted() for x in jax.tree.leaves(old.inner_state))
kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.inner_state)}
print("ok", sorted(kinds))
"""


@pytest.mark.slow
def test_donation_on_one_device_with_the_state_shardings_works():
    # Without in_shardings and out_shardings, jit (JAX 0.10) pairs donated
    # buffers with outputs by shape alone on one device, and the process
    # aborts; with them, each buffer is its own output's.
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_DONATE)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["ok", "['pinned_host']"]
