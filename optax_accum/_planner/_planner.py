# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`plan_microbatch`, `plan_fused_step`: the largest micro-batch that fits.

Everything here is ahead-of-time: the step is lowered and compiled for
abstract shapes (``jax.ShapeDtypeStruct``) and XLA's memory analysis is read;
nothing is allocated or executed on the device, so there are no OOM trials.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from .. import _checks, _offload
from . import _compile


class MicrobatchPlan(NamedTuple):
    """What `plan_microbatch` chose.

    Attributes:
      microbatch_size: examples per micro-batch (per call of the step).
      num_microbatches: ``k``, micro-batches per update.
      effective_batch_size: ``microbatch_size * num_microbatches``.
      memory_bytes: estimated peak memory of the step at ``microbatch_size``.
      memory_budget: the budget it was planned against, in bytes.
      next_microbatch_size: the next candidate size up, or None if the
        chosen size is the largest candidate.
      next_memory_bytes: the estimate for ``next_microbatch_size`` (over the
        budget), or None. Where XLA:TPU refuses to compile it for a
        ``target`` as larger than the device, the temporaries its error
        names (a lower bound).
      num_compilations: how many sizes were compiled.
      offloaded_bytes: bytes per device of the step's arguments kept in host
        memory (an `offload` ed optimizer state, whether passed as
        ``opt_state`` or inside ``params``, e.g. a split nnx state), left out
        of ``memory_bytes``.
      memory_note: how the offloaded state was left out: by the memory
        analysis's own host split, or, on a backend without one (CPU, where
        host and device share memory), by the state's own bytes; empty
        without an offloaded state.
      compiler: the compiler that compiled the candidates, and for what
        devices: this machine's, or the ``target``'s.
    """

    microbatch_size: int
    num_microbatches: int
    effective_batch_size: int
    memory_bytes: int
    memory_budget: int
    next_microbatch_size: int | None
    next_memory_bytes: int | None
    num_compilations: int
    offloaded_bytes: int = 0
    memory_note: str = ""
    compiler: str = ""


def compiled_memory_bytes(compiled: Any) -> int:
    """Peak device memory of a compiled executable, from XLA's memory analysis.

    ``argument + output - alias + temp``: the inputs, the outputs that do not
    reuse a donated input buffer, and XLA's scratch buffers, all live at once
    in the worst case. Generated code is not counted, nor are inputs and
    outputs in host memory (an `offload` ed state): a GPU's analysis reports
    them apart, and on the CPU, which does not, their own bytes come out.

    Args:
      compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``).

    Returns:
      The estimate in bytes.

    Raises:
      RuntimeError: if the backend reports no memory analysis.

    Examples:
      >>> import jax, jax.numpy as jnp, optax_accum
      >>> compiled = jax.jit(lambda x: 2 * x).lower(jnp.zeros(256)).compile()
      >>> optax_accum.compiled_memory_bytes(compiled)  # 1 KiB in, 1 KiB out
      2048
    """
    _compile.analysed(compiled)
    return _offload.device_bytes(compiled)[0]


def _candidates(
    target: int, max_size: int, multiple_of: int, divisors_only: bool
) -> list[int]:
    # A micro-batch larger than the target would overshoot it on its own.
    sizes = range(multiple_of, min(max_size, target) + 1, multiple_of)
    if divisors_only:
        sizes = [m for m in sizes if target % m == 0]
    return list(sizes)


def plan_microbatch(
    step: Callable[..., Any],
    params: optax.Params,
    opt_state: optax.OptState | None,
    example: Any,
    target_batch_size: int,
    *,
    memory_budget: int | None = None,
    max_microbatch_size: int | None = None,
    multiple_of: int = 1,
    divisors_only: bool = True,
    device: Any = None,
    target: Any = None,
    data_axes: str | tuple[str, ...] | None = None,
) -> MicrobatchPlan:
    """Finds the largest micro-batch size whose compiled step fits in memory.

    ``step`` is what runs once per micro-batch: a train step
    ``step(params, opt_state, batch)`` (e.g. gradients plus an `accumulate`
    update), or, with ``opt_state=None``, ``step(params, batch)``; to plan a
    loss, pass ``jax.value_and_grad(loss)``. A step that takes the whole
    batch and splits it itself (`microbatch`) is planned by `plan_fused_step`
    instead: its memory is not one micro-batch's step. A ``jax.jit``-wrapped
    step is
    lowered with its own settings (donation, shardings); a plain function is
    wrapped in ``jax.jit`` without donation, which overestimates a step that
    donates its state.

    For each candidate size ``m`` the batch is ``example`` with a leading axis
    of ``m``, and the step is compiled ahead of time (never run). Its memory is
    `compiled_memory_bytes`: ``argument + output - alias + temp`` bytes from
    ``compiled.memory_analysis()``. A binary search over the candidates, with
    ``O(log n)`` compilations, returns a size that fits the budget whose next
    candidate does not. An optimizer state kept in host memory (`offload`;
    arrays or ``ShapeDtypeStruct`` s whose sharding names the memory kind) is
    left out of those bytes: by the analysis's host split where the backend
    reports one, otherwise by the state's own bytes, and the plan says which
    (``offloaded_bytes``, ``memory_note``). This assumes memory grows with
    ``m``; XLA may choose other algorithms at tiny sizes (a matrix-vector
    product at ``m = 1``), so the plan reports both estimates, and if the
    smallest candidate does not fit, the second smallest is tried before
    giving up.

    The number of micro-batches is ``k = ceil(target_batch_size / m)``. With
    ``divisors_only`` (the default), the candidates divide the target, so the
    effective batch ``k * m`` equals it exactly (an odd prime target then
    leaves only ``m = 1`` and ``m = target``). Without, every multiple of
    ``multiple_of`` up to the target is a candidate and the effective batch
    rounds up to ``k * m >= target``. No candidate exceeds the target,
    whatever ``max_microbatch_size``.

    Args:
      step: the per-micro-batch step, see above.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      opt_state: the optimizer state, or None to call ``step(params, batch)``.
      example: one example: a pytree of arrays without the batch axis.
      target_batch_size: the effective batch size to reach, an int >= 1.
      memory_budget: bytes the step may use. Default: the device's free
        memory, ``bytes_limit - bytes_in_use`` from ``device.memory_stats()``
        (GPU, TPU). Required on the CPU, which reports none.
      max_microbatch_size: largest size to consider, default (and at most)
        the target.
      multiple_of: candidates are multiples of this, e.g. the number of
        data-parallel devices. The batch is lowered as ``step`` places it: a
        ``jax.jit`` step with ``in_shardings`` is planned per device, a plain
        function unsharded.
      divisors_only: only consider sizes that divide the target.
      device: the device whose free memory is the default budget, default
        ``jax.devices()[0]``.
      target: plan for hardware this machine does not have: a name
        (``"h100"``, ``"h100x8"``, ``"v5e"``, ``"v5e:2x2"``, ``"colab_tpu"``)
        or a ``jax.experimental.topologies`` topology (or its devices). Each
        candidate is compiled by the target's compiler (XLA:GPU, XLA:TPU; the
        ``compilers`` extra) on a mesh over its devices: parameters and state
        keep their ``PartitionSpec`` (their mesh's shape is the target's
        mesh's, so it must have as many devices) and host memory
        (`offload`), and the mesh has their mesh's axis types, so an
        Explicit step is planned as it runs (its ``reshard`` s under the
        target's mesh); the batch's rows are sharded over ``data_axes``. The
        default budget is one device's memory (an H100's from its
        target description, a TPU's from its kind); on a GPU, JAX's allocator
        takes 75% of it unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says
        otherwise, so pass that as ``memory_budget`` to plan for a default
        run. A ``jax.jit`` step is compiled with its own donation; its
        ``in_shardings`` must not name this machine's devices.
      data_axes: the axes of the parameters' mesh the batch's rows are
        sharded over, a name or a tuple of names: the data-parallel axes,
        e.g. ``"data"`` on a ``("data", "model")`` tensor-parallel mesh.
        ``multiple_of`` must be a multiple of their device count. Default:
        with ``target``, the mesh's one axis (all of the target's devices;
        on a mesh of several axes, data or tensor parallel, there is no
        default); without, the batch is lowered as ``step`` places it.
        Parameters on a mesh have it set (``jax.set_mesh``) while the step
        is traced, where the caller has set none.

    Returns:
      A `MicrobatchPlan`.

    Raises:
      ValueError: if no budget is given and the device reports none, if no
        candidate size exists, or if even the smallest candidate does not fit;
        for an unknown ``target`` (naming the known ones), a budget over the
        target's memory, or both ``device`` and ``target``; for
        ``data_axes`` not of the parameters' mesh (or without one), none
        with ``target`` on a mesh of several axes, or a ``multiple_of``
        that does not split over them; where the step does not type-check
        with the batch sharded so (an Explicit mesh).
      ImportError: where ``target``'s compiler (the ``compilers`` extra) is
        not installed.
      TypeError: for non-integer sizes.

    Examples:
      >>> import jax, jax.numpy as jnp, optax_accum
      >>> def loss(w, x):
      ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> w = jnp.zeros((64, 256))
      >>> plan = optax_accum.plan_microbatch(
      ...     jax.value_and_grad(loss), w, None, jnp.zeros(64),
      ...     target_batch_size=1024, memory_budget=600_000)
      >>> plan.microbatch_size * plan.num_microbatches
      1024
      >>> plan.memory_bytes <= 600_000 < plan.next_memory_bytes
      True
    """
    lowerable = step if hasattr(step, "lower") else jax.jit(step)
    return _plan(
        lambda m: lowerable,
        lambda m: m,
        (params, opt_state, example),
        target_batch_size,
        memory_budget,
        max_microbatch_size,
        multiple_of,
        divisors_only,
        (device, target, data_axes),
    )


def plan_fused_step(
    make_step: Callable[[int], Callable[..., Any]],
    params: optax.Params,
    opt_state: optax.OptState | None,
    example: Any,
    target_batch_size: int,
    *,
    memory_budget: int | None = None,
    max_microbatch_size: int | None = None,
    multiple_of: int = 1,
    device: Any = None,
    target: Any = None,
    data_axes: str | tuple[str, ...] | None = None,
) -> MicrobatchPlan:
    """Plans a fused step: the whole batch in one call, split into ``k`` inside.

    `plan_microbatch` plans a step that runs once per micro-batch. A fused
    step, built on `microbatch` (or ``lax.scan``), takes the whole batch of
    ``target_batch_size`` rows and splits it into ``k`` micro-batches itself;
    its memory holds that batch, the accumulator, the optimizer's state and
    its update, on top of one micro-batch's activations. So this compiles the
    real step for each candidate: ``make_step(k)`` returns the train step for
    ``k`` micro-batches per call, ``step(params, opt_state, batch)``, or, with
    ``opt_state=None``, ``step(params, batch)``. It is lowered with the whole
    batch (``example`` with a leading axis of ``target_batch_size``), for each
    candidate micro-batch size ``m`` (the divisors of the target that are
    multiples of ``multiple_of``, at most ``max_microbatch_size``) at
    ``k = target_batch_size // m``, and `compiled_memory_bytes` of each is
    compared with the budget, in a binary search as in `plan_microbatch`
    (which also says how an offloaded state is left out).

    Args:
      make_step: ``k -> step``; a ``jax.jit``-wrapped step is lowered with its
        own settings (donation, shardings), a plain function is jitted.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      opt_state: the optimizer state, or None to call ``step(params, batch)``.
      example: one example: a pytree of arrays without the batch axis.
      target_batch_size: the rows of the batch each call takes, an int >= 1.
      memory_budget: bytes the step may use; default as in `plan_microbatch`.
      max_microbatch_size: largest micro-batch size to consider.
      multiple_of: candidate sizes are multiples of this.
      device: the device whose free memory is the default budget.
      target: plan for another GPU or TPU, as in `plan_microbatch`.
      data_axes: the mesh axes the batch's rows are sharded over, as in
        `plan_microbatch`.

    Returns:
      A `MicrobatchPlan`: ``num_microbatches`` is the ``k`` to build the step
      with, and ``memory_bytes`` that step's compiled memory.

    Raises:
      ValueError: as `plan_microbatch`.
      ImportError: as `plan_microbatch`.
      TypeError: for a ``make_step`` that is not callable, non-integer sizes.

    Examples:
      >>> import jax, jax.numpy as jnp, optax_accum
      >>> def loss(w, x):
      ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> def make_step(k):
      ...     return optax_accum.microbatch(jax.value_and_grad(loss), k)
      >>> plan = optax_accum.plan_fused_step(
      ...     make_step, jnp.zeros((64, 256)), None, jnp.zeros(64),
      ...     target_batch_size=1024, memory_budget=1_000_000)
      >>> plan.microbatch_size * plan.num_microbatches
      1024
      >>> plan.memory_bytes <= 1_000_000 < plan.next_memory_bytes
      True
    """
    if not callable(make_step):
        raise TypeError(
            f"`make_step` must be a function of k that returns the step, got "
            f"{make_step!r}."
        )
    total = _checks.positive_int(target_batch_size, "target_batch_size")

    def step_at(m: int) -> Any:
        step = make_step(total // m)
        if not callable(step):
            raise TypeError(
                f"`make_step({total // m})` must return the step, got {step!r}."
            )
        return step if hasattr(step, "lower") else jax.jit(step)

    return _plan(
        step_at,
        lambda m: total,
        (params, opt_state, example),
        total,
        memory_budget,
        max_microbatch_size,
        multiple_of,
        True,  # microbatch splits the batch into k equal parts
        (device, target, data_axes),
    )


def _plan(
    step_at, rows_at, args, target_batch_size, memory_budget, max_microbatch_size,
    multiple_of, divisors_only, where,
) -> MicrobatchPlan:  # fmt: skip
    """The checks and the search both planners share.

    ``step_at(m)`` is the lowerable step for micro-batch size ``m``, and
    ``rows_at(m)`` the rows of the batch it is lowered with; ``where``,
    ``(device, target, data_axes)``, is where a `_compile.Compiler` compiles
    and measures it.
    """
    params, opt_state, example = args
    # Arrays keep their sharding, so a sharded state is planned per device.
    # So does a state kept in host memory (`offload`).
    state = jax.tree.map(_abstract, (params, opt_state))
    compiler = _compiler(state, *where)
    target = _checks.positive_int(target_batch_size, "target_batch_size")
    multiple_of = _checks.positive_int(multiple_of, "multiple_of")
    max_size = target
    if max_microbatch_size is not None:
        max_size = _checks.positive_int(max_microbatch_size, "max_microbatch_size")
    compiler.check_multiple(multiple_of)
    budget = compiler.budget(memory_budget)
    sizes = _candidates(target, max_size, multiple_of, divisors_only)
    if not sizes:
        raise ValueError(
            f"No micro-batch size is a multiple of `multiple_of`={multiple_of}, "
            f"at most `max_microbatch_size`={max_size} and "
            + (
                f"a divisor of `target_batch_size`={target}."
                if divisors_only
                else f"at most `target_batch_size`={target}."
            )
        )
    estimate = _Estimates(step_at, rows_at, compiler.measure, state, example)
    lo = _largest_fitting(sizes, estimate, budget)
    m = sizes[lo]
    k = math.ceil(target / m)
    next_m = sizes[lo + 1] if lo + 1 < len(sizes) else None
    return MicrobatchPlan(
        microbatch_size=m,
        num_microbatches=k,
        effective_batch_size=k * m,
        memory_bytes=estimate(m),
        memory_budget=budget,
        next_microbatch_size=next_m,
        next_memory_bytes=None if next_m is None else estimate(next_m),
        num_compilations=len(estimate.memory),
        offloaded_bytes=estimate.host_state,
        memory_note=estimate.note,
        compiler=compiler.name,
    )


class _Estimates:
    """The compiled step's memory at each micro-batch size, compiled once."""

    def __init__(self, step_at, rows_at, measure, state, example):
        """``state``: ``(params, opt_state)``, abstract (`_abstract`)."""
        self.step_at, self.rows_at, self.measure = step_at, rows_at, measure
        self.abstract = state
        self.with_state = state[1] is not None
        # Every argument in host memory: an nnx step takes the whole split
        # state (the optimizer's included) as ``params``.
        self.host_state = _offload.offloaded_bytes(self.abstract)
        self.note = ""
        self.example = example
        self.memory: dict[int, int] = {}

    def __call__(self, m: int) -> int:
        if m not in self.memory:
            rows = self.rows_at(m)
            batch = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(
                    (rows, *np.shape(x)), jax.dtypes.result_type(x)
                ),
                self.example,
            )
            params, opt_state = self.abstract
            args = (params, opt_state, batch) if self.with_state else (params, batch)
            self.memory[m], self.note = self.measure(self.step_at(m), args)
        return self.memory[m]


def _compiler(
    state: Any, device: Any, target: Any, data_axes: Any
) -> _compile.Compiler:
    if target is None:
        return _compile.here(device, state, data_axes)
    if device is not None:
        raise ValueError(
            "Pass `device` (plan for one of this machine's devices) or `target` "
            f"(plan for another), not both: got {device!r} and {target!r}."
        )
    return _compile.for_target(target, state, data_axes)


def _abstract(x: Any) -> Any:
    """``x`` as `_offload.abstract` keeps it; an array JAX has not committed
    to its device (``opt.init(params)``'s scalar count) stays uncommitted, as
    ``jax.jit`` treats it, not pinned to device 0 beside a mesh."""
    if isinstance(x, jax.Array) and not x.committed:
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return _offload.abstract(x)


def _largest_fitting(sizes: list[int], estimate: _Estimates, budget: int) -> int:
    """The index of a size that fits ``budget`` whose next one does not."""
    # Invariant: sizes[lo] fits and sizes[hi] does not.
    hi = len(sizes) - 1
    if estimate(sizes[hi]) <= budget:
        return hi
    # XLA may switch to a matrix-vector product at the smallest size, which
    # can need more memory than the next one, so try two.
    lo = 0
    if estimate(sizes[lo]) > budget and hi > 1:
        lo = 1
    if estimate(sizes[lo]) > budget:
        tried = ", ".join(f"{m}: {estimate(m):,} bytes" for m in sizes[: lo + 1])
        raise ValueError(
            f"Even the smallest micro-batch sizes do not fit `memory_budget`="
            f"{budget:,} bytes (estimates {tried})."
        )
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if estimate(sizes[mid]) <= budget:
            lo = mid
        else:
            hi = mid
    return lo
