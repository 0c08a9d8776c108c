# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Which combinations a face supports: the compatibility table, as data.

Two lists of rules, each rule a set of allowed values per variable (a cell
matches when every named variable takes one of them):

- `NOT_APPLICABLE`: the option does not exist on that face (``has_aux`` on
  `accumulate`) or the oracle does not drive that combination; such cells
  are left out of the matrix.
- `REFUSED`: the library must refuse the cell with a ValueError or TypeError
  whose message names every entry of ``names``, at construction or when the
  call is traced, before anything is computed.

Every other cell must equal the model. The docs' table is rendered from here
(`compat`), so it cannot drift from what the tests check.
"""

from __future__ import annotations

from typing import NamedTuple

from .cells import LOOP_FACES, PIPELINE_FACES, PRIVACY_FACES, STREAM_FACES, Cell


class Rule(NamedTuple):
    when: dict  # variable -> allowed values
    names: tuple[str, ...]  # what the refusal's message must name
    why: str
    short: str = ""  # the condition, as the docs' table says it


def _rule(names: tuple[str, ...], why: str, short: str = "", **when) -> Rule:
    return Rule(when, names, why, short)


NOT_APPLICABLE = (
    _rule((), "a loop option", face=STREAM_FACES, option=("has_aux", "rng", "clip")),
    _rule(
        (),
        "a per-call option",
        face=LOOP_FACES,
        option=("skip_fn", "skip_large", "close", "schedule"),
    ),
    _rule(
        (),
        "the value-and-grad face only",
        face=("loss", "nnx", "linen", *PIPELINE_FACES),
        option=("clip",),
    ),
    _rule(
        (),
        "the pipeline runs its own shard_map over the stage axis: one device's "
        "view (the stages only) or data_axes",
        face=PIPELINE_FACES,
        mode=("global", "axis_name", "pmap"),
    ),
    _rule((), "no noise scale on the pipeline", face=PIPELINE_FACES, option=("noise",)),
    _rule((), "not driven by the oracle", face=("nnx", "linen"), option=("float0",)),
    _rule((), "not driven by the oracle", face=("nnx", "linen"), int_param=(True,)),
    _rule((), "nnx keys come from nnx.Rngs", face=("nnx",), option=("rng",)),
    _rule(
        (),
        "not driven by the oracle",
        face=("nnx",),
        mode=("axis_name", "pmap"),
    ),
    _rule(
        (),
        "data_axes declares fun row-independent; a clipped gradient is not",
        option=("clip",),
        mode=("data_axes",),
    ),
    # The privacy face: sums of clipped per-example gradients, in at least
    # float32; the noise, the division by the expected batch size and the
    # per-call options are dp_accumulate's (tests/privacy).
    _rule((), "the privacy face sums", face=PRIVACY_FACES, reduction=("mean",)),
    _rule(
        (),
        "its sums are in the promoted dtype",
        face=PRIVACY_FACES,
        acc=("none", "f32"),
    ),
    _rule(
        (),
        "no data_axes: the sums are over examples, never partial",
        face=PRIVACY_FACES,
        mode=("data_axes",),
    ),
    _rule(
        (),
        "dp_accumulate's options, or not the privacy face's (per-example aux: "
        "tests/privacy)",
        face=PRIVACY_FACES,
        option=(
            "skip_fn",
            "skip_large",
            "close",
            "schedule",
            "noise",
            "rng",
            "clip",
            "has_aux",
        ),
    ),
)

REFUSED = (
    _rule(
        ("weight",),
        "every mini-step weighs 1, as in optax",
        face=("multisteps",),
        weights=("counts", "zeros", "nan", "negative"),
    ),
    _rule(
        ("axis_name",),
        "no axis_name argument",
        face=("multisteps",),
        mode=("axis_name", "pmap"),
    ),
    _rule(
        ("noise_scale_decay", "reduction"),
        "the noise scale needs mean gradients",
        "mean only",
        reduction=("sum",),
        option=("noise",),
    ),
    _rule(
        ("noise_scale_decay", "data_axes"),
        "data_axes leaves the micro-batch gradients unreduced",
        face=STREAM_FACES,
        mode=("data_axes",),
        option=("noise",),
    ),
    _rule(
        ("noise_scale_decay", "num_microbatches"),
        "one micro-batch on one device measures nothing",
        "k ≥ 2",
        face=LOOP_FACES,
        mode=("single", "global", "data_axes"),
        k=(1,),
        option=("noise",),
    ),
    _rule(
        ("skip_fn", "data_axes"),
        "data_axes leaves the micro-batch gradients unreduced",
        face=("accumulate",),
        mode=("data_axes",),
        option=("skip_fn", "skip_large"),
    ),
    _rule(
        ("should_skip_update_fn", "data_axes"),
        "data_axes leaves the micro-batch gradients unreduced",
        face=("multisteps",),
        mode=("data_axes",),
        option=("skip_fn", "skip_large"),
    ),
    _rule(
        ("noise_scale_decay", "every_k"),
        "one micro-batch on one device measures nothing",
        "k ≥ 2",
        face=("accumulate",),
        mode=("single", "global"),
        k=(1,),
        option=("noise",),
    ),
    _rule(
        ("noise_scale_decay", "every_k_schedule"),
        "one micro-batch on one device measures nothing",
        "k ≥ 2",
        face=("multisteps",),
        mode=("single", "global"),
        k=(1,),
        option=("noise",),
    ),
    _rule(
        ("argnums",),
        "the loss face differentiates argnums, as jax.grad, floating leaves only",
        "floating parameters",
        face=("loss",),
        option=("float0",),
    ),
    _rule(
        ("argnums",),
        "the loss face differentiates argnums, as jax.grad, floating leaves only",
        "floating parameters",
        face=("loss",),
        int_param=(True,),
    ),
    _rule(
        ("`params`",),
        "the pipeline differentiates every parameter leaf",
        "floating parameters",
        face=PIPELINE_FACES,
        option=("float0",),
    ),
    _rule(
        ("`params`",),
        "the pipeline differentiates every parameter leaf",
        "floating parameters",
        face=PIPELINE_FACES,
        int_param=(True,),
    ),
    _rule(
        ("`num_microbatches`", "multiple"),
        "circular and interleaved 1F1B need M a multiple of S",
        "k a multiple of S",
        face=("pipe-circular", "pipe-interleaved"),
        k=(1, 3),
    ),
    _rule(
        ("weight_fn",),
        "a row is an example or padding (example_mask_fn): no weights",
        "padding rows",
        face=PRIVACY_FACES,
        weights=("counts", "nan", "negative"),
    ),
    _rule(
        ("`params`",),
        "the privacy face differentiates every parameter leaf",
        "floating parameters",
        face=PRIVACY_FACES,
        option=("float0",),
    ),
    _rule(
        ("`params`",),
        "the privacy face differentiates every parameter leaf",
        "floating parameters",
        face=PRIVACY_FACES,
        int_param=(True,),
    ),
    _rule(
        ("weight",),
        "a constant weight that is negative or not finite raises",
        face=("accumulate",),
        eager=(True,),
        weights=("nan", "negative"),
    ),
)


def matches(rule: Rule, cell: Cell) -> bool:
    return all(getattr(cell, var) in values for var, values in rule.when.items())


def applicable(cell: Cell) -> bool:
    return not any(matches(r, cell) for r in NOT_APPLICABLE)


def refusals(cell: Cell) -> list[Rule]:
    """The rules that refuse ``cell`` (empty: it must work). A refusal must
    name the options of at least one of them."""
    return [r for r in REFUSED if matches(r, cell)]


def refusal(cell: Cell) -> Rule | None:
    found = refusals(cell)
    return found[0] if found else None
