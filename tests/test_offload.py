# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`offload`: the inner optimizer's state in host memory between updates.

Updates equal the plain optimizer's exactly, on one device and an FSDP mesh
(Explicit and Auto); the state is in ``pinned_host`` after ``init`` and after
each jitted update; the compiled step's entry layout keeps it at ``S(5)``;
the program moves it only inside the boundary branch; donation aliases it in
place; and an Orbax round trip puts it back in host memory.
"""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from tests.helpers import layouts
from tests.helpers.lanes import sweep

K = 2
NUM_STEPS = 5
OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
}
WRAPPERS = {"accumulate": optax_accum.accumulate, "MultiSteps": optax_accum.MultiSteps}
PLACEMENTS = ("one_device", "fsdp_explicit", "fsdp_auto")


def _setup(placement):
    """The mesh context, the parameters and ``NUM_STEPS`` gradients."""
    params = layouts.params()
    rng = np.random.default_rng(3)
    grads = [
        jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
        for _ in range(NUM_STEPS)
    ]
    if placement == "one_device":
        return None, params, grads
    layout = layouts.LAYOUTS["fsdp"]
    mesh = layouts.mesh(layout, explicit=placement == "fsdp_explicit")
    place = lambda tree: layouts.place(layout, mesh, tree)
    return mesh, place(params), [place(g) for g in grads]


def _inner_state(state):
    return state.inner_state if hasattr(state, "inner_state") else state.inner_opt_state


def _assert_in_host(state):
    leaves = [
        x for x in jax.tree.leaves(_inner_state(state)) if isinstance(x, jax.Array)
    ]
    assert leaves
    assert {x.sharding.memory_kind for x in leaves} == {"pinned_host"}


def _run(tx, params, grads, check_host):
    step = jax.jit(tx.update)
    state = tx.init(params)
    if check_host:
        _assert_in_host(state)
    out = []
    for g in grads:
        updates, state = step(g, state, params)
        if check_host:
            _assert_in_host(state)
        out.append(updates)
    return out, state


CASES = list(itertools.product(WRAPPERS, OPTIMIZERS, PLACEMENTS))


@pytest.mark.parametrize(
    "wrapper,optimizer,placement",
    sweep(CASES, fast=[("accumulate", "adamw", "fsdp_explicit")]),
)
def test_equals_plain_inner_exactly_and_keeps_state_in_host(
    wrapper, optimizer, placement
):
    mesh, params, grads = _setup(placement)
    make, opt = WRAPPERS[wrapper], OPTIMIZERS[optimizer]
    with jax.set_mesh(mesh) if mesh is not None else _null():
        plain, plain_state = _run(make(opt(), K), params, grads, False)
        offl, offl_state = _run(
            make(optax_accum.offload(opt()), K), params, grads, True
        )
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(offl), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.spec == b.sharding.spec if mesh is not None else True
    for a, b in zip(
        jax.tree.leaves(_inner_state(plain_state)),
        jax.tree.leaves(_inner_state(offl_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if mesh is not None:  # sharded like the parameters it mirrors
            assert b.sharding.spec == a.sharding.spec or b.ndim == 0


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_scalar_leaves_are_replicated_on_the_parameters_mesh():
    mesh, params, _ = _setup("fsdp_auto")
    state = optax_accum.offload(optax.adam(1e-2)).init(params)
    count = state[0].count
    assert count.sharding == NamedSharding(mesh, P(), memory_kind="pinned_host")
    assert state[0].mu["w1"].sharding == NamedSharding(
        mesh, P("data", None), memory_kind="pinned_host"
    )


def _entry_layout(hlo):
    line = next(x for x in hlo.splitlines() if "entry_computation_layout" in x)
    sig = re.search(r"entry_computation_layout=\{\((.*?)\)->", line).group(1)
    return re.findall(r"\w+\[[\d,]*\](?:\{[^}]*\})?", sig)


def _state_positions(tx, args):
    """Flat argument positions of the inner state's leaves in ``(g, state, p)``."""
    grads, state, _ = args
    n_grads = len(jax.tree.leaves(grads))
    marked = jax.tree.map(lambda _: False, state)
    marked = marked._replace(
        inner_state=jax.tree.map(lambda _: True, state.inner_state)
    )
    flags = jax.tree.leaves(marked)
    return {n_grads + i for i, f in enumerate(flags) if f}


def test_entry_layout_keeps_the_state_at_s5():
    _, params, grads = _setup("one_device")
    tx = optax_accum.accumulate(optax_accum.offload(optax.adamw(1e-2)), K)
    state = tx.init(params)
    hlo = jax.jit(tx.update).lower(grads[0], state, params).compile().as_text()
    layout = _entry_layout(hlo)
    at_s5 = {i for i, a in enumerate(layout) if "S(5)" in a}
    assert at_s5 == _state_positions(tx, (grads[0], state, params))
    assert len(at_s5) == 7  # count, mu and nu of w1, b1, w2


def _case_regions(mlir):
    """Lines of the boundary branch lowered for GPU: outside it, the hold
    branch, the boundary branch.

    There the branch is a ``stablehlo.while`` of at most one trip
    (`_compiler.boundary_cond`): its body steps, the hold outputs are its
    carry. It sits in ``lax.platform_dependent``'s ``stablehlo.case`` beside
    the other platforms' ``lax.cond`` (XLA keeps the platform's branch):
    outside is outside that case, and the hold branch is what the GPU's
    branch does besides the loop.
    """
    lines = mlir.splitlines()
    depth = lambda i: len(lines[i]) - len(lines[i].lstrip())
    loop = next(i for i, x in enumerate(lines) if "stablehlo.while" in x)
    cases = [i for i in range(loop) if '"stablehlo.case"' in lines[i]]
    case = max(i for i in cases if depth(i) < depth(loop))
    closes = [i for i in range(case + 1, len(lines)) if depth(i) == depth(case)]
    case_end = next(i for i in closes if lines[i].lstrip().startswith("})"))
    body = next(i for i in range(loop, len(lines)) if "} do {" in lines[i])
    body_end = next(
        i for i in range(body + 1, len(lines))
        if depth(i) == depth(body) and lines[i].strip() == "}"
    )  # fmt: skip
    splits = [i for i in range(case, loop) if depth(i) == depth(case)]
    branch = max((i for i in splits if "}, {" in lines[i]), default=case)
    hold = lines[branch + 1 : loop]
    return lines[:case] + lines[case_end + 1 :], hold, lines[body : body_end + 1]


def _moves(lines, kind):
    return sum(
        "annotate_device_placement" in x and f'_xla_buffer_placement = "{kind}"' in x
        for x in lines
    )


def _result_annotations_only(lines):
    """Whether every annotation in ``lines`` is an operand of the ``return``:
    an Explicit mesh's result memory kinds, not a move of the state."""
    ids = {
        m.group(1)
        for x in lines
        if (m := re.search(r"(%\d+) = stablehlo.custom_call @annotate_device", x))
    }
    ret = next(x for x in lines if x.strip().startswith("return "))
    returned = set(re.findall(r"%\d+", ret.split(":")[0]))
    return ids <= returned


@pytest.mark.parametrize(
    "wrapper,placement",
    sweep(
        list(itertools.product(WRAPPERS, PLACEMENTS)),
        fast=[("accumulate", "one_device")],
    ),
)
def test_state_moves_only_inside_the_boundary_branch(wrapper, placement):
    # The CPU backend lowers memory moves to nothing, so read the program
    # lowered for GPU, where they are `annotate_device_placement` calls.
    mesh, params, grads = _setup(placement)
    tx = WRAPPERS[wrapper](optax_accum.offload(optax.adamw(1e-2)), K)
    with jax.set_mesh(mesh) if mesh is not None else _null():
        state = tx.init(params)
        traced = jax.jit(tx.update).trace(grads[0], state, params)
        mlir = traced.lower(lowering_platforms=("cuda",)).as_text()
    outside, hold, boundary = _case_regions(mlir)
    n = len(jax.tree.leaves(_inner_state(state)))
    assert (_moves(boundary, "device"), _moves(boundary, "pinned_host")) == (n, n)
    assert _moves(hold, "device") + _moves(hold, "pinned_host") == 0
    if placement == "fsdp_explicit":
        assert _moves(outside, "pinned_host") == n  # the state's outputs
        assert _result_annotations_only(outside)
    else:
        assert _moves(outside, "device") + _moves(outside, "pinned_host") == 0


def _aliases(hlo):
    line = next(x for x in hlo.splitlines() if "input_output_alias" in x)
    pairs = re.findall(r"\{(\d+)\}: \((\d+), \{\}", line.split("entry_computation")[0])
    return {int(param): int(out) for out, param in pairs}


@pytest.mark.parametrize("placement", sweep(PLACEMENTS[1:], fast=["fsdp_explicit"]))
def test_donated_state_is_updated_in_place(placement):
    # One device is left out: there jit leaves the aliasing of equal-shaped
    # buffers to XLA, which on CPU gives a host buffer to a device output.
    mesh, params, grads = _setup(placement)
    tx = optax_accum.accumulate(optax_accum.offload(optax.adamw(1e-2)), K)
    with jax.set_mesh(mesh):
        state = tx.init(params)
        kwargs = {}
        if placement == "fsdp_explicit":
            # jit pairs donated buffers by shape alone unless every output's
            # memory kind is known (see `offload`'s docstring).
            on = jax.tree.map(lambda x: x.sharding, params)
            kwargs["out_shardings"] = (on, optax_accum.state_shardings(tx, params))
        step = jax.jit(tx.update, donate_argnums=1, **kwargs)
        hlo = step.lower(grads[0], state, params).compile().as_text()
        aliases, layout = _aliases(hlo), _entry_layout(hlo)
        for i in _state_positions(tx, (grads[0], state, params)):
            # Each state leaf's buffer is its own output's: no copy of the state.
            assert aliases.get(i) == i, (i, aliases)
            assert "S(5)" in layout[i]
        for g in grads:
            old = state
            _, state = step(g, state, params)
            assert all(x.is_deleted() for x in jax.tree.leaves(old.inner_state))
            _assert_in_host(state)


@pytest.mark.parametrize("placement", sweep(PLACEMENTS, fast=["one_device"]))
def test_orbax_round_trip_returns_the_state_to_host_and_resumes_exactly(
    tmp_path, placement
):
    mesh, params, grads = _setup(placement)
    tx = optax_accum.accumulate(optax_accum.offload(optax.adamw(1e-2)), K)
    with jax.set_mesh(mesh) if mesh is not None else _null():
        step = jax.jit(tx.update)
        state = tx.init(params)
        for g in grads[:3]:  # the middle of the second window
            _, state = step(g, state, params)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            state,
        )
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp_path / "state", state)
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(tmp_path / "state", abstract)
        _assert_in_host(restored)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
            assert a.sharding == b.sharding
        for g in grads[3:]:
            u_a, state = step(g, state, params)
            u_b, restored = step(g, restored, params)
            _assert_in_host(restored)
        for a, b in zip(
            jax.tree.leaves((u_a, state)), jax.tree.leaves((u_b, restored)), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unknown_memory_kind_names_the_argument_and_the_kinds():
    with pytest.raises(ValueError, match=r"`memory_kind`.*'device'.*'pinned_host'"):
        optax_accum.offload(optax.sgd(0.1), memory_kind="hbm")
    with pytest.raises(ValueError, match=r"`memory_kind`='unpinned_host'"):
        optax_accum.offload(optax.sgd(0.1), memory_kind="unpinned_host")


def test_device_memory_kind_is_the_inner_optimizer():
    tx = optax_accum.offload(optax.adam(0.1), memory_kind="device")
    state = tx.init({"w": jnp.ones(3)})
    assert state[0].mu["w"].sharding.memory_kind == "device"


def test_optax_multisteps_cannot_hold_it():
    # It selects the new or old inner state with jnp.where, on the device,
    # so its update branch returns device memory and its skip branch host
    # memory: its lax.cond rejects the mismatch.
    params = {"w": jnp.ones(3)}
    tx = optax.MultiSteps(optax_accum.offload(optax.adam(0.1)), K)
    state = tx.init(params)
    with pytest.raises(TypeError, match="host"):
        jax.jit(tx.update)(params, state, params)


def test_fused_step_moves_the_state_once_per_step_and_equals_plain():
    params = layouts.params()
    x, y = layouts.data(16)
    loss = layouts.loss_fn(None)
    grad_fn = optax_accum.microbatch_value_and_grad(loss, 4, batch_argnums=(1, 2))

    def make(tx):
        @jax.jit
        def step(params, state, x, y):
            _, grads = grad_fn(params, x, y)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return step, tx.init(params)

    plain, s_plain = make(optax.adamw(1e-2))
    offl, s_offl = make(optax_accum.offload(optax.adamw(1e-2)))
    p_plain = p_offl = params
    for _ in range(3):
        p_plain, s_plain = plain(p_plain, s_plain, x, y)
        p_offl, s_offl = offl(p_offl, s_offl, x, y)
        assert {v.sharding.memory_kind for v in jax.tree.leaves(s_offl)} == {
            "pinned_host"
        }
    for a, b in zip(jax.tree.leaves(p_plain), jax.tree.leaves(p_offl), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    mlir = offl.trace(params, s_offl, x, y).lower(lowering_platforms=("cuda",))
    text = mlir.as_text()
    n = len(jax.tree.leaves(s_offl))
    assert (
        _moves(text.splitlines(), "device"),
        _moves(text.splitlines(), "pinned_host"),
    ) == (n, n)


@pytest.mark.parametrize("how", ["jit(grad)", "grad(vmap)", "grad(jit)"])
def test_update_differentiates_as_the_plain_optimizer_does(how):
    # The move waits for the gradients behind a barrier (`_compiler.after`),
    # except under differentiation: its transpose cannot type a cotangent in
    # host memory. Under `vmap` (an ensemble) the update sees batch tracers
    # over the JVP's: the barrier must still be left out.
    params = layouts.params()

    def grads_of(tx):
        state = tx.init(params)
        total = lambda g: sum(jnp.sum(u) for u in jax.tree.leaves(
            tx.update(g, state, params)[0]))  # fmt: skip
        if how == "grad(vmap)":
            members = lambda g: jnp.sum(jax.vmap(total)(
                jax.tree.map(lambda x: jnp.stack([x, 2 * x]), g)))  # fmt: skip
            return jax.grad(members)(params)
        if how == "grad(jit)":
            return jax.grad(jax.jit(total))(params)
        return jax.jit(jax.grad(total))(params)

    plain = grads_of(optax.adamw(1e-2))
    offl = grads_of(optax_accum.offload(optax.adamw(1e-2)))
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(offl), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _planned(offloaded, fused, budget):
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    inner = optax.adam(1e-3)
    params = jnp.zeros((64, 256))
    if fused:
        tx = optax_accum.offload(inner) if offloaded else inner

        def make_step(k):
            grad_fn = optax_accum.microbatch_value_and_grad(loss, k)

            def step(w, state, x):
                return tx.update(grad_fn(w, x)[1], state, w)

            return jax.jit(step)

        return optax_accum.plan_fused_step(
            make_step,
            params,
            tx.init(params),
            jnp.zeros(64),
            256,
            memory_budget=budget,
        )
    inner = optax_accum.offload(inner) if offloaded else inner
    tx = optax_accum.accumulate(inner, 4)

    @jax.jit
    def step(w, state, x):
        return tx.update(jax.grad(loss)(w, x), state, w)

    return optax_accum.plan_microbatch(
        step, params, tx.init(params), jnp.zeros(64), 256, memory_budget=budget
    )


@pytest.mark.parametrize("fused", [False, True], ids=["microbatch", "fused_step"])
def test_planner_leaves_the_offloaded_state_out_of_device_bytes(fused):
    plain, offl = _planned(False, fused, 2**22), _planned(True, fused, 2**22)
    assert plain.microbatch_size == offl.microbatch_size == 256  # both fit
    state_bytes = 4 + 2 * 64 * 256 * 4  # Adam's count, mu and nu
    assert (plain.offloaded_bytes, plain.memory_note) == (0, "")
    assert offl.offloaded_bytes == state_bytes
    assert "no host split" in offl.memory_note  # CPU: host and device share memory
    # Not donated: the state in and the state out both leave the device.
    assert plain.memory_bytes - offl.memory_bytes >= 2 * state_bytes - 64
    # The freed bytes buy a larger micro-batch under a tighter budget.
    tight = 650_000
    assert _planned(True, fused, tight).microbatch_size == 256
    assert _planned(False, fused, tight).microbatch_size < 256


def _flax_data():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    return x, jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)


def _nnx_run(tx):
    from flax import nnx

    from optax_accum.flax import nnx_train_step

    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = nnx.jit(nnx_train_step(lambda m, x, y: jnp.mean((m(x) - y) ** 2), 4))
    for _ in range(3):
        step(model, optimizer, *_flax_data())
    leaves = jax.tree.leaves(nnx.state(optimizer.opt_state))
    return jax.tree.leaves(nnx.state(model)), leaves


def _linen_run(tx):
    import flax.linen as nn
    from flax.training import train_state

    from optax_accum.flax import linen_train_step

    net = nn.Dense(2)
    x, y = _flax_data()
    params = net.init(jax.random.key(0), x)["params"]
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)

    def loss_fn(params, rng, x, y):
        return jnp.mean((net.apply({"params": params}, x) - y) ** 2)

    step = jax.jit(linen_train_step(loss_fn, num_microbatches=4))
    for _ in range(3):
        state, _ = step(state, x, y)
    return jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state)


@pytest.mark.parametrize("run", [_nnx_run, _linen_run], ids=["nnx", "linen"])
def test_flax_steps_take_it_as_the_optimizer(run):
    pytest.importorskip("flax")
    plain, _ = run(optax.adamw(1e-2))
    offl, state = run(optax_accum.offload(optax.adamw(1e-2)))
    assert {x.sharding.memory_kind for x in state} == {"pinned_host"}
    for a, b in zip(plain, offl, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("placement", sweep(PLACEMENTS, fast=["fsdp_auto"]))
def test_jitted_init_places_the_state_in_host(placement):
    mesh, params, _ = _setup(placement)
    tx = optax_accum.accumulate(optax_accum.offload(optax.adamw(1e-2)), K)
    with jax.set_mesh(mesh) if mesh is not None else _null():
        kwargs = {}
        if mesh is not None:  # under Auto, jit would otherwise replicate the zeros
            kwargs["out_shardings"] = optax_accum.state_shardings(tx, params)
        state = jax.jit(tx.init, **kwargs)(params)
    _assert_in_host(state)
    if mesh is not None:
        assert state.inner_state[0].mu["w1"].sharding.spec == P("data", None)
