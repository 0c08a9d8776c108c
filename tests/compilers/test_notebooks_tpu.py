# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Every Colab notebook's train step, compiled for Colab's TPU (a v5e-1);
06's two (the noise-scale measurement and `adaptive_every_k`'s run).

The notebooks (``notebooks/0N_*.py``, the py:percent sources of the
``.ipynb`` files) are written for Colab, whose TPU runtime is one TPU v5e
chip. The integration test runs them whole on the CPU, which says nothing of
XLA:TPU; this test compiles each one's train step for ``"colab_tpu"``
without the chip (`optax_accum._targets`).

The step checked is the notebook's own: its cells run here in order, and
while the training cell runs, ``jax.jit`` and ``nnx.jit`` are watched. When
the function the training loop calls (named per notebook, and defined in the
notebook's source) is first called, or the program compiled from it is, its
arguments are taken and the notebook stops there, before any training. That
jitted function is then compiled for the TPU with the same arguments (shapes,
dtypes and donation; Flax nnx objects as their state, as ``nnx.jit`` splits
them) and the notebook's own settings (its matmul precision). The pod
notebook's step reads its mesh: on Colab's one chip the notebook makes that
mesh 1 x 1, so the step compiles on a mesh of the same axes, each of size 1,
with the arrays' partition specs.

Running the notebooks whole takes minutes, so cells that only measure or
plot and that the training cell does not read are skipped, each named below;
the sizes are those the notebooks pick on a CPU. A skipped cell whose name
the training cell reads is replaced by the value it uses (05: the planner
plans only the combination it trains).

For each step: XLA:TPU compiled it, its peak fits the chip's 16 GiB of HBM,
a step that holds `optax_accum.accumulate` keeps the boundary's conditional
(the inner optimizer runs only when a window closes), and one that holds
`optax_accum.microbatch` keeps its loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import pytest
from flax import nnx

from optax_accum import _targets

from .conftest import require

NOTEBOOKS = Path(__file__).parents[2] / "notebooks"
TARGET = "colab_tpu"
HBM = 16 * 2**30  # a TPU v5e chip's memory


@dataclasses.dataclass(frozen=True)
class Case:
    """A notebook, its train step and how to reach it cheaply.

    Attributes:
      notebook: the source's name, without ``.py``.
      step: the name of the jitted function the training loop calls.
      train_cell: text of the cell that trains (where the step is caught).
      skip: texts of cells, each its first code line's start, that only
        measure or plot and whose names the training cell does not read.
      given: names the notebook would set in a skipped cell that the
        training cell reads, with the value it uses of them.
      accumulate: whether the step holds `optax_accum.accumulate`.
      microbatch: whether the step holds `optax_accum.microbatch` (a loop).
      mesh: whether the step reads the notebook's mesh (``jax.set_mesh``).
    """

    notebook: str
    step: str
    train_cell: str
    skip: tuple[str, ...] = ()
    given: dict[str, Any] = dataclasses.field(default_factory=dict)
    accumulate: bool = True
    microbatch: bool = False
    mesh: bool = False


CASES = [
    Case("01_quickstart", "micro_step", "tx = optax_accum.accumulate("),
    Case(
        "02_token_weighting",
        "micro_step",
        "def make_optimizer():",
        skip=("graphdef, state = nnx.split(model)",),  # `microbatch`'s gradient
    ),
    Case(
        "03_memory",
        "step",
        "measured = memory(",
        skip=("METHODS = [", "fig, (ax_b, ax_k)", "temp_k = ["),
    ),
    Case(
        "04_pod_scale",
        "step",
        "def make_step(grad_fn):",
        skip=("rows = jax.device_put(", "COLLECTIVE = re.compile(", "local, once ="),
        accumulate=False,
        microbatch=True,
        mesh=True,
    ),
    Case(
        "05_memory_remat",
        "step",
        "plan = plans[",
        # The sweeps; the planner then plans only the combination trained.
        skip=("COMBOS = [", "for remat, dtype in COMBOS:", "fig, ax", "param_bytes ="),
        given={"COMBOS": [("full", "bfloat16")]},
    ),
    Case("06_batch_size", "measure", "b, k, LR = "),
    Case(
        "06_batch_size",
        "train_adaptive",  # `adaptive_every_k`: k in the state, in a scan
        "every_k = optax_accum.adaptive_every_k(",
        # The noise-scale run (its cell sets `b`, given here), the sweep, the
        # fit and the plots.
        skip=("b, k, LR = ", "fig, ax", "BATCHES = ", "reached = ", "grid = "),
        given={"b": 8},
    ),
]


class _Reached(Exception):
    """The training loop's first use of the step: what it was given."""

    def __init__(self, fun: Any, jitted: Any, args: tuple, kwargs: dict, donate: Any):
        super().__init__("the train step was reached")
        self.fun, self.jitted, self.donate = fun, jitted, donate
        self.args, self.kwargs = args, kwargs


class _Watched:
    """A jitted function that stops the notebook where the loop calls it.

    Calling it, or calling the program that ``lower(...).compile()`` makes of
    it, raises `_Reached`; lowering and compiling alone (a memory measurement)
    go through.
    """

    def __init__(self, inner: Any, fun: Any, jitted: Any, donate: Any):
        self._inner, self._step = inner, (fun, jitted, donate)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fun, jitted, donate = self._step
        raise _Reached(fun, jitted, args, kwargs, donate)

    def lower(self, *args: Any, **kwargs: Any) -> _Watched:
        return _Watched(self._inner.lower(*args, **kwargs), *self._step)

    def compile(self, *args: Any, **kwargs: Any) -> _Watched:
        return _Watched(self._inner.compile(*args, **kwargs), *self._step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def _watching(filename: str, name: str) -> Iterator[None]:
    """``jax.jit`` and ``nnx.jit`` return a `_Watched` for the function
    ``name`` defined in ``filename``, and what they always did otherwise."""
    originals = jax.jit, nnx.jit

    def watch(jit):
        def watched(fun=None, /, **options):
            if fun is None:  # @nnx.jit(...) with options
                return lambda f: watched(f, **options)
            jitted = jit(fun, **options)
            code = getattr(fun, "__code__", None)
            if code and code.co_filename == filename and fun.__name__ == name:
                donate = options.get("donate_argnums", ())
                return _Watched(jitted, fun, jitted, donate)
            return jitted

        return watched

    jax.jit, nnx.jit = watch(jax.jit), watch(nnx.jit)
    try:
        yield
    finally:
        jax.jit, nnx.jit = originals


def _code_cells(path: Path) -> list[tuple[str, str]]:
    """The notebook's code cells: (first code line, source padded with blank
    lines so that tracebacks give the line in ``path``)."""
    text = path.read_text()
    cells, start = [], 0
    for match in [*re.finditer(r"^# %%.*$", text, re.M), None]:
        end = match.start() if match else len(text)
        body = text[start:end]
        header = body.split("\n", 1)[0]
        code = [ln for ln in body.split("\n")[1:] if ln.strip() and ln[0] != "#"]
        if header.startswith("# %%") and "[markdown]" not in header and code:
            padding = "\n" * text.count("\n", 0, start)
            cells.append((code[0] + "\n" + "\n".join(code[1:]), padding + body))
        start = end
    return cells


@contextlib.contextmanager
def _restoring_jax_state() -> Iterator[None]:
    """Undoes what a notebook sets for the whole process: its mesh and matmul
    precision."""
    precision = jax.config.jax_default_matmul_precision
    try:
        with jax.set_mesh(None):
            yield
    finally:
        jax.config.update("jax_default_matmul_precision", precision)


def _run_to_step(case: Case) -> _Reached:
    """Runs the notebook's cells until its training loop uses the step."""
    path = NOTEBOOKS / f"{case.notebook}.py"
    cells = _code_cells(path)
    for skip in case.skip:
        assert any(first.startswith(skip) for first, _ in cells), (case, skip)
    trains = [
        i for i, (first, _) in enumerate(cells) if first.startswith(case.train_cell)
    ]
    assert len(trains) == 1, (case.notebook, case.train_cell, len(trains))
    namespace = {"__name__": "__main__", **case.given}
    for first, source in cells[: trains[0]]:
        if not first.startswith(case.skip):
            exec(compile(source, str(path), "exec"), namespace)
    with _watching(str(path), case.step):
        try:
            exec(compile(cells[trains[0]][1], str(path), "exec"), namespace)
        except _Reached as reached:
            return reached
    raise AssertionError(f"{case.notebook}'s training cell never used `{case.step}`")


def _pure(jitted: Any, args: tuple) -> tuple[Any, tuple]:
    """``jitted`` as a function of arrays: Flax nnx objects among its
    arguments become their state, as ``nnx.jit`` splits them."""
    nodes = [i for i, a in enumerate(args) if isinstance(a, nnx.Pytree)]
    if not nodes:
        return jitted, args
    graphdef, state = nnx.split(tuple(args[i] for i in nodes))
    arrays = [a for i, a in enumerate(args) if i not in nodes]

    def step(state, *arrays):
        objects = iter(nnx.merge(graphdef, state))
        rest = iter(arrays)
        full = [next(objects) if i in nodes else next(rest) for i in range(len(args))]
        out = jitted(*full)
        return out, nnx.state(tuple(full[i] for i in nodes))

    return step, (state, *arrays)


def _compile(reached: _Reached, case: Case) -> _targets.Compiled:
    """The caught step compiled for Colab's TPU, with the loop's arguments."""
    assert not reached.kwargs, reached.kwargs
    fn, args = _pure(reached.jitted, reached.args)
    if not case.mesh:
        return _targets.compile_for(
            fn, *args, target=TARGET, donate_argnums=reached.donate
        )
    # The notebook's mesh axes on Colab's one chip (each of size 1), with the
    # partition specs its arrays have.
    mesh = jax.tree.leaves(args)[0].sharding.mesh
    layout = {
        "axis_names": mesh.axis_names,
        "mesh_shape": (1,) * len(mesh.axis_names),
        "axis_types": mesh.axis_types,
    }
    specs = [jax.tree.map(lambda a: a.sharding.spec, a) for a in args]
    with jax.set_mesh(_targets.target_mesh(TARGET, **layout)):
        return _targets.compile_for(
            fn,
            *args,
            target=TARGET,
            specs=specs,
            donate_argnums=reached.donate,
            **layout,
        )


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.notebook}:{c.step}")
def test_notebook_train_step_compiles_for_colab_tpu(case):
    require(TARGET)
    with _restoring_jax_state():
        reached = _run_to_step(case)
        start = time.perf_counter()
        compiled = _compile(reached, case)
        seconds = time.perf_counter() - start
    # The function the loop called is the notebook's, by its name and source.
    code = reached.fun.__code__
    name, line = reached.fun.__name__, code.co_firstlineno
    assert (name, Path(code.co_filename).name) == (case.step, f"{case.notebook}.py")
    assert compiled.compiler.startswith("XLA:TPU"), compiled.compiler
    memory = compiled.memory()
    assert 0 < memory.peak <= HBM, memory
    hlo = compiled.as_text()
    if case.accumulate:  # the inner optimizer runs on the boundary branch only
        assert " conditional(" in hlo, case.notebook
    if case.microbatch:  # the micro-batches are a loop, not one large batch
        assert " while(" in hlo, case.notebook
    print(
        f"{case.notebook}: `{name}` (line {line}) compiled for {TARGET} in "
        f"{seconds:.1f} s, "
        f"peak {memory.peak / 2**20:.2f} MiB"
    )
