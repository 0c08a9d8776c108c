# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Where arrays live on a mesh: the one module that reads shardings.

The engines (`accumulate`, `microbatch`) ask it how to make a per-parameter
buffer (the accumulator, the zeros of a hold step, the scan carry) with exactly
its parameter's sharding, never replicated; which mesh axes shard the batch
but not a parameter (pure data parallelism); how to split a sharded batch into
micro-batches without a copy; and what shardings an optimizer state should
get (`state_shardings`). Only public JAX API is used. The arithmetic on
unreduced partial sums is `_partial_sums`'.

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


def zeros_like(x: Any, dtype: Any, unreduced_axes: frozenset = frozenset()) -> Any:
    """Zeros with ``x``'s shape and sharding (optionally unreduced)."""
    if not unreduced_axes:
        return jnp.zeros_like(x, dtype=dtype)
    spec = explicit_spec(x).update(unreduced=unreduced_axes)
    return jnp.zeros(jnp.shape(x), dtype, out_sharding=spec)


def _annotation(like: Any) -> P | None:
    """``like``'s spec where it says more than 'replicated', else None (which
    also suits shard_map bodies and meshless code)."""
    spec = explicit_spec(like)
    if spec is not None and not (used_axes(spec) or spec.unreduced or spec.reduced):
        return None
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


def _canonical(spec: P, ndim: int) -> tuple:
    """``spec`` in a form where ``P()`` and ``P(None, None)`` compare equal."""
    entries = [axes_of(e) or None for e in spec.partitions]
    entries += [None] * (ndim - len(entries))
    return tuple(entries), frozenset(spec.unreduced), frozenset(spec.reduced)


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
    parameters' shardings, every other leaf is replicated, and a state kept
    in host memory (`offload`) has that memory kind. This is what optax
    asks users to do by hand with ``optax.tree_map_params``.

    Args:
      tx: an optimizer (anything with ``init``), e.g. `accumulate(...)`.
      params: the parameters, placed on the mesh (or ``ShapeDtypeStruct`` s
        with shardings).

    Returns:
      A pytree of ``NamedSharding`` with the structure of the state.

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
    meshes = [s.mesh for s in p_shardings if isinstance(s, NamedSharding)]
    if not meshes:
        raise ValueError(
            "`params` must be placed with NamedShardings on a mesh, got "
            f"{[type(s).__name__ for s in p_shardings]}."
        )
    replicated = NamedSharding(meshes[0], P())
    p_shapes = [(jnp.shape(x), jnp.result_type(x.dtype)) for x in p_leaves]
    closed, state = jax.make_jaxpr(tx.init, return_shape=True)(params)
    # A state kept off the device (`offload`) keeps its memory kind, so that
    # `out_shardings` built from these name every output's memory.
    host = jax.memory.Space.Host
    kinds = [
        "pinned_host" if a.memory_space == host else "device" for a in closed.out_avals
    ]

    def like_params(node: Any) -> bool:
        leaves, treedef = jax.tree.flatten(node)
        return (
            treedef == p_def
            and bool(leaves)
            and [jnp.shape(x) for x in leaves] == [s for s, _ in p_shapes]
        )

    def assign(node: Any) -> Any:
        if like_params(node):
            return jax.tree.unflatten(p_def, p_shardings)
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
