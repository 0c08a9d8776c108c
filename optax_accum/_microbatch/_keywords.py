# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The keywords that both faces of `microbatch` take, declared once.

`Keywords` is the one declaration: each field's name, type, default and doc.
`takes_keywords` builds a face's public signature (``inspect.signature``,
Sphinx) and the keywords' entries of its ``Args:`` from it, so that adding an
option touches this file and `_options.options`, which checks it, and no
face. A static checker cannot run that code, so the faces' ``**kwargs`` are
typed with `MicrobatchKeywords` (the Flax steps' with `StepKeywords`), the
same names and types as TypedDicts (PEP 692); ``tests/test_typing.py`` checks
that they agree with `Keywords`. The checked form the loop trusts is
`_options.Options`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypedDict, TypeVar

import jax

from .._typing import AccumulatorDType, AuxOrder, AxisName, Reduction

F = TypeVar("F", bound=Callable[..., Any])
# The line of a face's docstring that the keywords' Args entries replace.
MARKER = "{keywords}"


class WeightFn(Protocol):
    """Weights one micro-batch: ``weight_fn(*microbatch_args) -> scalar``.

    Called with the micro-batch slices of the ``batch_argnums`` arguments, in
    that order. Return, for example, the number of valid tokens.
    """

    def __call__(self, *microbatch_args: Any) -> jax.typing.ArrayLike: ...


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclasses.dataclass(frozen=True)
class Keywords:
    """`microbatch`'s and `microbatch_value_and_grad`'s keywords, as given."""

    batch_argnums: int | Sequence[int] = dataclasses.field(
        default=1,
        metadata=_doc("positional argument(s) of the function holding the batch."),
    )
    has_aux: bool = dataclasses.field(
        default=False,
        metadata=_doc(
            "whether the function returns an ``aux`` beside its value: "
            "``((value, aux), grads)`` from a value-and-grad ``fun``, "
            "``(value, aux)`` from a ``loss``."
        ),
    )
    reduction: Reduction = dataclasses.field(
        default="mean",
        metadata=_doc('``"mean"`` (weighted mean) or ``"sum"`` (weighted sum).'),
    )
    weight_fn: WeightFn | None = dataclasses.field(
        default=None,
        metadata=_doc(
            "optional `WeightFn`; weights are float32 scalars (float64 where the "
            "gradients are)."
        ),
    )
    accumulator_dtype: AccumulatorDType = dataclasses.field(
        default="promote",
        metadata=_doc(
            '``"promote"`` (the default, as in `accumulate`: at least float32, of '
            "each gradient's kind, so bf16 gradients accumulate in float32 at twice "
            "the carry's memory), a floating (or complex) dtype, or ``None`` for "
            "each gradient's dtype (values accumulate in at least float32). Or a "
            "pytree prefix of the gradients with one of these per subtree, as in "
            "`accumulate`. Results come back in the function's dtypes."
        ),
    )
    axis_name: AxisName | None = dataclasses.field(
        default=None,
        metadata=_doc(
            "inside ``shard_map`` or ``pmap``, the mapped axis (or axes) to reduce "
            "over once, after the loop."
        ),
    )
    rng_argnums: int | Sequence[int] = dataclasses.field(
        default=(),
        metadata=_doc("positional argument(s) of the function holding PRNG keys."),
    )
    data_axes: AxisName | None = dataclasses.field(
        default=None,
        metadata=_doc(
            "``None`` (the global view), or the mesh axes to run the device-local "
            "loop over (see **Sharding** in `microbatch`)."
        ),
    )
    param_gather: str | None = dataclasses.field(
        default=None,
        metadata=_doc(
            '``"per_microbatch"``, ``"once"`` or ``None`` (the former where '
            "parameters are sharded over the batch's Explicit mesh axes, else the "
            "latter). See **FSDP** in `microbatch`."
        ),
    )
    noise_scale_decay: float | None = dataclasses.field(
        default=None,
        metadata=_doc(
            "``None``, or the EMA decay in (0, 1) of the gradient noise scale, "
            "measured from the k micro-batch gradients and their mean (see "
            "`accumulate` and `noise_scale`). The result then takes a keyword "
            "``noise_scale`` (a `NoiseScaleState`, or ``None`` to start) and returns "
            "``(result, noise_scale_state)``: the state is the tracker that carries "
            "the EMA across steps, and its ``last_grad_sq``, ``last_trace``, "
            "``b_small`` and ``b_big`` are this step's statistics. Batch sizes count "
            "rows (examples), or the ``weight_fn`` weights. Needs "
            '``reduction="mean"`` and ``num_microbatches`` >= 2 (or several devices '
            "with ``axis_name``); ``num_microbatches=1`` otherwise is refused. Steps "
            "whose `ScaledGrads` are not ``finite`` (an fp16 overflow, skipped by the "
            "caller) are not observed. In the global view each micro-batch's squared "
            "norm reads its reduced gradient, so on an accelerator that reduction "
            "stays in the loop; the device-local mode measures per device and adds "
            "nothing to its one reduction."
        ),
    )
    unroll: int | bool = dataclasses.field(
        default=1,
        metadata=_doc(
            "micro-batches per trip of the loop, as ``lax.scan``'s ``unroll``: an "
            "int >= 1, or ``True`` for all k (straight-line code, no loop; memory "
            "then grows with k). A pure speed choice: the results are the same. "
            "The default, 1, keeps memory and compile time flat in k."
        ),
    )
    aux_rows: Any = dataclasses.field(
        default=None,
        metadata=_doc(
            'with ``has_aux`` and ``data_axes`` or ``aux_order="batch"``: which '
            "``aux`` leaves hold the micro-batch's rows on axis 0, to gather over "
            "devices and put in ``aux_order`` (``True``), and which are statistics "
            "(``False``, averaged over devices, kept per micro-batch); a bool for "
            "all leaves, or a pytree prefix of ``aux`` with bool leaves. Left "
            "``None``, with ``data_axes`` a leaf that could be either (its leading "
            "size is the rows per device) raises a ValueError naming it and the "
            "others are averaged; in the global view a leaf whose leading size is "
            "the micro-batch's is rows."
        ),
    )
    aux_order: AuxOrder = dataclasses.field(
        default="microbatch",
        metadata=_doc(
            "the row order of ``aux``'s row-wise leaves (see ``aux_rows``): "
            '``"microbatch"`` (the default), stacked ``(k, B/k, ...)`` with '
            'micro-batch ``i`` holding rows ``i, i+k, ...``; or ``"batch"``, '
            "``(B, ...)`` in the batch's own row order, as ``fun`` on the whole "
            "batch would return them (pair them with the batch's labels as they "
            "are). Other leaves stay stacked per micro-batch."
        ),
    )


class StepKeywords(TypedDict, total=False):
    """The `Keywords` that the Flax train steps pass through, for a type
    checker (PEP 692): the steps set ``batch_argnums``, ``rng_argnums`` and
    ``has_aux`` themselves. `Keywords` stays the declaration (defaults and
    docs); ``tests/test_typing.py`` checks that the two agree."""

    reduction: Reduction
    weight_fn: WeightFn | None
    accumulator_dtype: AccumulatorDType
    axis_name: AxisName | None
    data_axes: AxisName | None
    param_gather: str | None
    noise_scale_decay: float | None
    aux_rows: Any
    aux_order: AuxOrder
    unroll: int | bool


class MicrobatchKeywords(StepKeywords, total=False):
    """`microbatch`'s and `microbatch_value_and_grad`'s `Keywords`, for a type
    checker: ``**kwargs: Unpack[MicrobatchKeywords]``."""

    batch_argnums: int | Sequence[int]
    has_aux: bool
    rng_argnums: int | Sequence[int]


#: The keywords the Flax steps set themselves (not in `StepKeywords`).
STEP_RESERVED = ("batch_argnums", "rng_argnums", "has_aux")

FIELDS = dataclasses.fields(Keywords)
NAMES = tuple(f.name for f in FIELDS)


def given(kwargs: dict[str, Any], face: str) -> Keywords:
    """``kwargs`` as `Keywords`; an unknown keyword raises as Python would."""
    for name in kwargs:
        if name not in NAMES:
            raise TypeError(f"{face}() got an unexpected keyword argument {name!r}")
    return Keywords(**kwargs)


def _args_entries(indent: str) -> str:
    entries = []
    for f in FIELDS:
        text = textwrap.fill(
            f"{f.name}: {f.metadata['doc']}",
            width=79 - len(indent),
            subsequent_indent="  ",
            break_on_hyphens=False,
        )
        entries.append(textwrap.indent(text, indent))
    return "\n".join(entries)


def _parameters() -> list[inspect.Parameter]:
    return [
        inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
        )
        for f in FIELDS
    ]


def takes_keywords(fn: F) -> F:
    """``fn(..., **kwargs)`` presented as taking the `Keywords`: its
    ``__signature__`` lists them after its own parameters (``**kwargs``
    dropped), its docstring's marker line becomes their Args entries, and any
    other keyword raises a TypeError in its name, as Python would (so that
    `options`' own keywords, such as ``argnums``, cannot slip through)."""
    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
    allowed = {p.name for p in own} | set(NAMES)

    @functools.wraps(fn)
    def face(*args: Any, **kwargs: Any) -> Any:
        for name in kwargs:
            if name not in allowed:
                raise TypeError(
                    f"{fn.__name__}() got an unexpected keyword argument {name!r}"
                )
        return fn(*args, **kwargs)

    face.__signature__ = sig.replace(parameters=own + _parameters())  # type: ignore[attr-defined]
    lines = (fn.__doc__ or "").split("\n")
    for i, line in enumerate(lines):
        if line.strip() == MARKER:
            indent = line[: len(line) - len(line.lstrip())]
            lines[i] = _args_entries(indent)
    face.__doc__ = "\n".join(lines)
    return face  # type: ignore[return-value]
