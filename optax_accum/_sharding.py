# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The mesh layout: the one module that reads shardings and mesh axes.

Every face (`accumulate`, `microbatch`, the Flax steps, the pipeline) asks it
how to make a per-parameter buffer (the accumulator, the zeros of a hold step,
the scan carry) with exactly its parameter's sharding, never replicated; which
mesh axes shard the batch but not a parameter (the data axes), and on which
mesh a device-local loop runs over them (`data_mesh`, `batch_axes`); how to
cast values to varying over manual axes (`varying`, `to_varying`,
`match_varying`) and whether a trace runs per device (`is_manual`); how to
place and reshard (`onto_mesh`, `replicated`, `reshard_to`, `reshard_like`,
`same_spec`); how to split a sharded batch into micro-batches without a copy;
and what shardings an optimizer state should get (`state_shardings`). Only
public JAX API is used. The arithmetic on unreduced partial sums is
`_partial_sums`'.

Collectives that belong to the parameters' own sharding (the all-gather of
FSDP weights, the reduce-scatter of their gradients) are the user's loss's,
per micro-batch, and are left alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def axes_of(axes: Any) -> tuple[str, ...]:
    """Mesh axis names from a name, a tuple of names or None."""
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _sharding(x: Any) -> Any:
    sharding = getattr(x, "sharding", None)  # a ShapeDtypeStruct
    if not isinstance(x, jax.ShapeDtypeStruct):
        try:
            sharding = jax.typeof(x).sharding
        except TypeError:  # not a JAX type
            return None
    return sharding


def explicit_spec(x: Any) -> P | None:
    """``x``'s PartitionSpec when it lives on a mesh with Explicit axes."""
    sharding = _sharding(x)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
        return None
    if AxisType.Explicit not in tuple(sharding.mesh.axis_types):
        return None
    return sharding.spec


def used_axes(spec: P | None) -> set[str]:
    """Mesh axes that shard some dimension under ``spec``."""
    if spec is None:
        return set()
    return {a for entry in spec.partitions for a in axes_of(entry)}


def axis_types(mesh: Any) -> dict[str, AxisType]:
    """Each axis name of ``mesh`` with its type (Explicit, Auto, Manual)."""
    return dict(zip(mesh.axis_names, mesh.axis_types, strict=True))


def unreduced(x: Any) -> frozenset:
    """Mesh axes over which ``x`` holds unreduced partial sums."""
    spec = explicit_spec(x)
    return frozenset(getattr(spec, "unreduced", ()) or ()) if spec else frozenset()


def varying(x: jax.Array, axes: Sequence[Any]) -> jax.Array:
    """``x`` varying over ``axes`` (manual ``shard_map`` axes): cast over
    those it does not vary over yet. Its cotangent then stays per device, and
    it can stand in a loop carry beside values that vary."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def to_varying(tree: Any, axes: Sequence[Any]) -> Any:
    """`varying` on every array leaf of ``tree`` (others pass): inputs whose
    cotangents must stay per device (no psum inside ``fun``)."""
    return jax.tree.map(
        lambda x: varying(x, axes) if isinstance(x, jax.Array) else x, tree
    )


def match_varying(x: jax.Array, like: Any) -> jax.Array:
    """``x`` varying over the manual axes ``like`` (an array, or a
    ShapeDtypeStruct from ``eval_shape``) varies over, as a loop carry must."""
    if isinstance(like, jax.ShapeDtypeStruct):
        vary = getattr(like.manual_axis_type, "varying", ())
    else:
        vary = jax.typeof(like).mat.varying
    return varying(x, tuple(vary or ()))


def is_manual(axes: Sequence[str] | None) -> bool:
    """Whether this trace runs per device of ``axes`` (all of them Manual:
    inside ``shard_map`` over them); False for None."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return axes is not None and all(a in manual for a in axes)


def zeros_like(x: Any, dtype: Any, unreduced_axes: frozenset = frozenset()) -> Any:
    """Zeros with ``x``'s shape and sharding (optionally unreduced)."""
    if not unreduced_axes:
        return jnp.zeros_like(x, dtype=dtype)
    spec = explicit_spec(x).update(unreduced=unreduced_axes)
    return jnp.zeros(jnp.shape(x), dtype, out_sharding=spec)


def _annotation(like: Any) -> P | NamedSharding | None:
    """``like``'s spec where it says more than 'replicated', else None (which
    also suits shard_map bodies and meshless code)."""
    spec = explicit_spec(like)
    if spec is not None and not (used_axes(spec) or spec.unreduced or spec.reduced):
        return None
    if spec is not None and jax.sharding.get_abstract_mesh().empty:
        # No mesh in context (parameters placed on an Explicit mesh, the
        # step jitted without `jax.set_mesh`): name ``like``'s own mesh.
        return NamedSharding(_sharding(like).mesh, spec)
    return spec


def broadcast(scalar: jax.Array, like: Any) -> jax.Array:
    """``scalar`` broadcast to ``like``'s shape and sharding, in one write."""
    return jnp.broadcast_to(scalar, like.shape, out_sharding=_annotation(like))


def zeros_for(like: Any, dtype: Any) -> jax.Array:
    """Zeros of ``like``'s shape (a ShapeDtypeStruct too) and sharding."""
    return jnp.zeros(like.shape, dtype, out_sharding=_annotation(like))


def replicated(x: jax.Array) -> jax.Array:
    """``x`` replicated, where an Explicit mesh shards it (small arrays only)."""
    if not used_axes(explicit_spec(x)):
        return x
    return jax.sharding.reshard(x, P())


def batch_mesh_of(tree: Any) -> Any:
    """The Explicit mesh that shards some leaf of ``tree``, or None."""
    for x in jax.tree.leaves(tree):
        if explicit_spec(x) is not None:
            return jax.typeof(x).sharding.mesh
    return None


def onto_mesh(tree: Any, mesh: Any) -> Any:
    """Leaves placed on no mesh, replicated on ``mesh``.

    Parameters left on one device next to a batch sharded on an Explicit mesh
    have no sharding type, and their gradients would be ambiguous ("contracting
    dimensions are sharded"); replicated on the batch's mesh, they are not.
    """

    def place(x):
        if not isinstance(x, jax.Array) or jnp.issubdtype(x.dtype, jax.dtypes.extended):
            return x
        if not jax.typeof(x).sharding.mesh.empty:
            return x
        with jax.sharding.use_abstract_mesh(mesh):
            return jax.sharding.reshard(x, P())

    return jax.tree.map(place, tree)


def mesh_size(mesh: Any, axes: Sequence[str]) -> int:
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return size


def splittable(x: jax.Array, k: int) -> jax.Array:
    """``x`` resharded, if needed, so that ``(B, ...) -> (B/k, k, ...)`` keeps
    its rows sharded: over the longest prefix of its batch axes whose device
    count divides the micro-batch size ``B/k`` (micro-batches smaller than the
    device count are then computed on fewer devices, not refused)."""
    spec = explicit_spec(x)
    if spec is None or not spec.partitions or spec.partitions[0] is None:
        return x
    axes = axes_of(spec.partitions[0])
    mesh = jax.typeof(x).sharding.mesh
    rows = x.shape[0] // k
    keep = axes
    while keep and rows % mesh_size(mesh, keep):
        keep = keep[:-1]
    if keep == axes:
        return x
    return jax.sharding.reshard(x, P(keep or None, *spec.partitions[1:]))


def rows_alike(tree: Any) -> Any:
    """``tree``'s leaves with axis 0 sharded alike, as the first leaf whose
    rows an Explicit mesh shards (its other axes as they were): ``vmap`` over
    the rows of several arrays demands one spec for the mapped axis, and a
    mask built in the step (replicated) sits beside rows sharded over
    ``data``. A no-op where no leaf's rows are sharded."""
    leaves = jax.tree.leaves(tree)
    specs = [explicit_spec(x) for x in leaves]
    rows = next(
        (s.partitions[0] for s in specs if s is not None and s.partitions
         and s.partitions[0] is not None),
        None,
    )  # fmt: skip
    if rows is None:
        return tree

    def place(x):
        spec = explicit_spec(x)
        if spec is None or not x.ndim:
            return x
        rest = tuple(spec.partitions[1:]) + (None,) * (
            x.ndim - 1 - len(spec.partitions[1:])
        )
        want = P(rows, *rest)
        return x if same_spec(spec, want, x.ndim) else jax.sharding.reshard(x, want)

    return jax.tree.map(place, tree)


def row_axes(tree: Any) -> set[str]:
    """The Explicit mesh axes that shard axis 0 of some leaf of ``tree``."""
    found = set()
    for x in jax.tree.leaves(tree):
        spec = explicit_spec(x)
        if spec is not None and spec.partitions:
            found |= set(axes_of(spec.partitions[0]))
    return found


def sharded_over(tree: Any, axes: Sequence[str]) -> list[str]:
    """Leaves of ``tree`` (by path) that an Explicit mesh shards over ``axes``."""
    found = []
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if used_axes(explicit_spec(x)) & set(axes):
            found.append(f"{jax.tree_util.keystr(path)}: {explicit_spec(x)}")
    return found


def batch_axes(batch: Any, exclude: Sequence[str] = ()) -> tuple[str, ...]:
    """The mesh axes (in the current mesh's order) that shard the rows of
    ``batch``, less ``exclude``: the data axes a batch's sharding implies."""
    rows = row_axes(batch)
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a in mesh.axis_names if a in rows and a not in exclude)


def gathers_params(batch: Any, params: Any) -> bool:
    """Whether some leaf of ``params`` is sharded over a mesh axis that
    shards ``batch``'s rows (FSDP, HSDP): its gathers are per call."""
    axes = row_axes(batch)
    return bool(axes and sharded_over(params, sorted(axes)))


def deferrable(x: Any, axes: Sequence[str]) -> frozenset:
    """Of ``axes``, those that do not shard ``x``: its gradient's pure
    data-parallel reduction over them can wait."""
    spec = explicit_spec(x)
    if spec is None or not jnp.issubdtype(jnp.result_type(x.dtype), jnp.inexact):
        return frozenset()
    return frozenset(a for a in axes if a not in used_axes(spec))


def data_mesh(batch: Any, params: Any, axes: tuple[str, ...]) -> Any:
    """The mesh to run a device-local loop over the data axes ``axes`` on,
    with ``axes`` checked against it and against ``params``.

    The mesh comes from ``jax.set_mesh`` or the batch's sharding. ``params``
    (anything but the batch) sharded over ``axes`` (FSDP) are refused: the
    loop would gather them whole.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        meshes = [
            s.mesh
            for x in jax.tree.leaves(batch)
            if isinstance(s := getattr(jax.typeof(x), "sharding", None), NamedSharding)
            and not s.mesh.empty
        ]
        if not meshes:
            raise ValueError(
                f"`data_axes`={axes!r} needs a mesh: call under `jax.set_mesh(mesh)`."
            )
        mesh = meshes[0]
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"`data_axes`={axes!r} names {missing}, not axes of the mesh "
            f"{mesh.axis_names}."
        )
    clash = sharded_over(params, axes)
    if clash:
        raise ValueError(
            f"`data_axes`={axes!r} must name only mesh axes that shard the "
            "batch but no parameter: the device-local loop would gather these "
            f"whole: {clash}. Name the pure data-parallel axes (HSDP: "
            '`data_axes="data"`), or keep the global view (`data_axes=None`).'
        )
    return mesh


def explicit_axes(data_axes: Any) -> tuple[str, ...]:
    """``data_axes`` as names, checked to be Explicit axes of the current mesh
    (where `defer_reduction` can type values reduced over them)."""
    names = axes_of(data_axes)
    mesh = jax.sharding.get_abstract_mesh()
    types = axis_types(mesh)
    if not names or any(types.get(n) != AxisType.Explicit for n in names):
        raise ValueError(
            "`data_axes` must name Explicit axes of the current mesh, got "
            f"{data_axes!r} "
            f"(mesh axes {mesh.axis_names}, types {mesh.axis_types}); call under "
            "`jax.set_mesh(mesh)`."
        )
    return names


def _canonical(spec: P, ndim: int) -> tuple:
    """``spec`` in a form where ``P()`` and ``P(None, None)`` compare equal."""
    entries = [axes_of(e) or None for e in spec.partitions]
    entries += [None] * (ndim - len(entries))
    return tuple(entries), frozenset(spec.unreduced), frozenset(spec.reduced)


def same_spec(a: P | None, b: P | None, ndim: int) -> bool:
    """Whether specs ``a`` and ``b`` place an ``ndim``-array alike (None, ``P()``
    and ``P(None, None)`` all mean replicated)."""
    return _canonical(a or P(), ndim) == _canonical(b or P(), ndim)


def reshard_to(tree: Any, spec: P) -> Any:
    """``tree``'s leaves resharded to ``spec`` where an Explicit mesh places
    them otherwise (``shard_map`` takes its inputs as its specs say); a no-op
    off Explicit meshes."""
    mesh = jax.sharding.get_abstract_mesh()
    if AxisType.Explicit not in tuple(mesh.axis_types):
        return tree

    def place(x):
        if same_spec(explicit_spec(x), spec, x.ndim):
            return x
        return jax.sharding.reshard(x, spec)

    return jax.tree.map(place, tree)


def reshard_like(tree: Any, params: Any) -> Any:
    """``tree`` (gradients) resharded like its Explicit-mesh ``params``."""

    def like(g, p):
        spec = explicit_spec(p)
        return g if spec is None else reshard_to(g, spec)

    return jax.tree.map(like, tree, params)


def check_like(grads: Any, accumulator: Any, slot: int) -> None:
    """Raises when a gradient's sharding differs from its accumulator's."""
    paths = jax.tree_util.tree_leaves_with_path(grads)
    for (path, g), a in zip(paths, jax.tree.leaves(accumulator), strict=True):
        gs, as_ = explicit_spec(g), explicit_spec(a)
        if gs is None or as_ is None or slot:
            continue
        if _canonical(gs, jnp.ndim(g)) != _canonical(as_, jnp.ndim(a)):
            raise ValueError(
                f"`grads`{jax.tree_util.keystr(path)} has sharding {gs}, but its "
                f"accumulator has {as_}: the gradients must be sharded like the "
                "parameters the state was initialised with"
                + (
                    " (unreduced gradients need `data_axes` on the transformation,"
                    " and `data_axes` needs gradients from `defer_reduction`)."
                    if gs.unreduced != as_.unreduced
                    else "."
                )
            )


def state_shardings(tx: Any, params: optax.Params) -> Any:
    """The shardings of ``tx.init(params)``: each buffer like its parameter.

    Under an Auto mesh, ``jax.jit(tx.init)`` leaves the placement of buffers
    that do not depend on the parameters' values (zeros: the accumulator,
    Adam's moments) to the compiler, which replicates them (under
    ``jax.set_mesh``) or puts them on one device (without it). Pass these to
    ``out_shardings`` (or to Orbax's restore as the target shardings): every
    subtree of the state with the parameters' structure and shapes gets the
    parameters' shardings (a subtree in which ``optax.masked`` or
    ``optax.multi_transform`` left an ``optax.MaskedNode`` in place of some
    parameters too), every other leaf is replicated, and a state kept in host
    memory (`offload`) has that memory kind. This is what optax asks users to
    do by hand with ``optax.tree_map_params``.

    On one device, without a mesh, each leaf gets its parameter's device (a
    ``SingleDeviceSharding``), with the memory kind the state keeps: the
    restore target of an `offload` ed state there.

    Args:
      tx: an optimizer (anything with ``init``), e.g. `accumulate(...)`.
      params: the parameters, placed on the mesh or on one device (or
        ``ShapeDtypeStruct`` s with shardings). A parameter left on one
        device next to others on a mesh counts as replicated on that mesh.

    Returns:
      A pytree of ``NamedSharding`` (``SingleDeviceSharding`` on one device)
      with the structure of the state.

    Raises:
      ValueError: if ``params`` are neither on a mesh nor on one device.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, optax_accum
      >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2,), ("fsdp",), axis_types=(AxisType.Auto,),
      ...                      devices=jax.devices()[:2])
      >>> sharding = NamedSharding(mesh, P("fsdp"))
      >>> params = {"w": jax.device_put(jnp.ones((4, 2)), sharding)}
      >>> tx = optax_accum.accumulate(optax.adam(1e-3), 4)
      >>> shardings = optax_accum.state_shardings(tx, params)
      >>> state = jax.jit(tx.init, out_shardings=shardings)(params)
      >>> state.accumulator["w"].sharding.spec, state.micro_step.sharding.spec
      (P('fsdp',), P())
    """
    p_leaves, p_def = jax.tree.flatten(params)
    p_shardings = [getattr(x, "sharding", None) for x in p_leaves]
    replicated = _replicated(p_shardings)
    p_shardings = [
        s if isinstance(s, NamedSharding) or replicated is None else replicated
        for s in p_shardings
    ]
    if replicated is None:
        replicated = p_shardings[0]
    p_shapes = [jnp.shape(x) for x in p_leaves]
    closed, state = jax.make_jaxpr(tx.init, return_shape=True)(params)
    # A state kept off the device (`offload`) keeps its memory kind, so that
    # `out_shardings` built from these name every output's memory.
    host = jax.memory.Space.Host
    kinds = [
        "pinned_host" if a.memory_space == host else "device" for a in closed.out_avals
    ]

    def masked(x: Any) -> bool:
        return isinstance(x, optax.MaskedNode)

    def like_params(node: Any) -> bool:
        if masked(node):
            return False
        leaves, treedef = jax.tree.flatten(node, is_leaf=masked)
        return (
            treedef == p_def
            and any(not masked(x) for x in leaves)
            and all(
                masked(x) or jnp.shape(x) == shape
                for x, shape in zip(leaves, p_shapes, strict=True)
            )
        )

    def assign(node: Any) -> Any:
        if like_params(node):
            leaves = jax.tree.leaves(node, is_leaf=masked)
            return jax.tree.unflatten(
                p_def,
                [
                    x if masked(x) else s
                    for x, s in zip(leaves, p_shardings, strict=True)
                ],
            )
        return jax.tree.map(lambda _: replicated, node)

    shardings = jax.tree.map(assign, state, is_leaf=like_params)
    leaves, treedef = jax.tree.flatten(shardings)
    return jax.tree.unflatten(
        treedef,
        [
            s if k == "device" else s.with_memory_kind(k)
            for s, k in zip(leaves, kinds, strict=True)
        ],
    )


def _replicated(shardings: list) -> Any:
    """Replicated on the parameters' mesh; None for parameters on one
    device; an error for parameters on neither."""
    meshes = [s.mesh for s in shardings if isinstance(s, NamedSharding)]
    if meshes:
        return NamedSharding(meshes[0], P())
    devices = {
        d
        for s in shardings
        if isinstance(s, jax.sharding.SingleDeviceSharding)
        for d in s.device_set
    }
    if len(devices) != 1 or not all(
        isinstance(s, jax.sharding.SingleDeviceSharding) for s in shardings
    ):
        raise ValueError(
            "`params` must be placed with NamedShardings on a mesh, or all on "
            f"one device, got {[type(s).__name__ for s in shardings]}."
        )
    return None
