# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Writes API.md, the API at a glance: every public name, one line each.

    python docs/_ext/api_at_a_glance.py > API.md

Every name of ``optax_accum.__all__`` and of each public wing's ``__all__``
(found by walking the package, so a new wing is listed without an edit
here), with its face, the first sentence of its docstring and the guide
that shows it: the guide that names it most often, unless `GUIDE` says
otherwise. ``tests/test_api_at_a_glance.py`` checks that API.md is what this
script writes, so the table cannot drift from the package.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import pkgutil
import re
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
GUIDES = ROOT / "docs" / "guides"

# The face of each of the root package's names; a wing's names are its own.
FACE = {
    **dict.fromkeys(
        ["accumulate", "AccumulateState", "MultiSteps", "MultiStepsState",
         "SkipFn", "skip_not_finite", "skip_large_updates", "has_updated",
         "find_state", "update_count", "offload", "state_specs", "state_shardings",
         "defer_reduction"],
        "accumulate",
    ),
    **dict.fromkeys(
        ["microbatch", "microbatch_value_and_grad", "WeightFn"], "microbatch"
    ),
    **dict.fromkeys(
        ["noise_scale", "NoiseScale", "NoiseScaleState", "adaptive_every_k",
         "AdaptiveEveryK", "batch_size_warmup", "scale_learning_rate"],
        "batch size & learning rate",
    ),
    **dict.fromkeys(["scaled_value_and_grad", "ScaledGrads"], "fp16"),
    **dict.fromkeys(
        ["plan_microbatch", "plan_fused_step", "MicrobatchPlan",
         "compiled_memory_bytes"],
        "planner",
    ),
    **dict.fromkeys(["AccumulatorDType", "AxisName", "Reduction"], "types"),
}  # fmt: skip

# Where the guide that names a name most often is not the one that shows it.
GUIDE: dict[str, str | None] = {
    "MultiSteps": "getting_started",
    "offload": "memory",
    "accumulate": "accumulate",
    "AdaptiveEveryK": None,
    "linen_train_step": "microbatch",
    "nnx_train_step": "microbatch",
    "find_state": "accumulate",
    "skip_not_finite": "accumulate",
    "scale_learning_rate": "learning_rate",
    "plan_microbatch": "planner",
    "plan_fused_step": "planner",
    "compiled_memory_bytes": "planner",
    "AccumulateState": "accumulate",
    "microbatch": "microbatch",
    "microbatch_value_and_grad": "microbatch",
    "state_shardings": "sharded_parameters",
    "defer_reduction": "sharded_parameters",
}

# Guides that name everything but show little: never picked by count.
REFERENCE_GUIDES = ("design", "comparison")

# Type aliases have no docstring of their own.
ALIAS = {
    "AccumulatorDType": 'A floating or complex dtype, ``"promote"`` or '
    "``None``, or a pytree prefix of the gradients with one per subtree.",
    "AxisName": "A mapped or mesh axis name, or a tuple of them.",
    "Reduction": 'How micro-batch gradients combine: ``"mean"`` or ``"sum"``.',
}

HEADER = """\
<!-- Written by `python docs/_ext/api_at_a_glance.py > API.md`; do not edit. -->
# The API at a glance

Every public name of `optax_accum` and of its wings, one line each: the
face it belongs to, what it is, and the guide that shows it. The full
reference is [docs/api/index.md](docs/api/index.md) (and the built site).

**Which fused face?** Pass `microbatch` a value-and-grad function you
already have (`jax.value_and_grad(loss)`, `eqx.filter_value_and_grad`, a
function that clips or returns `ScaledGrads`): it calls it once per
micro-batch and uses the gradients as returned. Pass
`microbatch_value_and_grad` the loss itself when you weight micro-batches
(`weight_fn`, e.g. token counts) on a data-parallel mesh: owning the
derivative, it puts the weight into the backward pass, so the compiler can
reduce the gradients over devices once per step instead of once per
micro-batch. Without `weight_fn` the two give the same result at the same
cost; both take the same keywords.

"""


def wings() -> list[Any]:
    """The root package and each public wing (a submodule with ``__all__``)."""
    import optax_accum

    found = [optax_accum]
    for info in pkgutil.iter_modules(optax_accum.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"optax_accum.{info.name}")
        if hasattr(module, "__all__"):
            found.append(module)
    return found


def summary(name: str, obj: Any) -> str:
    """The first sentence of ``obj``'s docstring, on one line."""
    if name in ALIAS:
        text = ALIAS[name]
    else:
        doc = inspect.getdoc(obj) or ""
        text = " ".join(doc.split("\n\n")[0].split())
    text = re.split(r"(?<=\.)\s", text, maxsplit=1)[0]
    text = text.replace("``", "`").replace("|", "\\|")
    return text if text.endswith(".") else text + "."


def guide_of(name: str, wing: str) -> str | None:
    """The guide that shows ``name``: `GUIDE`'s, else the one naming it most;
    None where no guide names it (the reference then shows it)."""
    if name in GUIDE:
        return GUIDE[name]
    if wing:  # `pipeline.value_and_grad`, not `jax.value_and_grad`
        named = rf"(?<![\w.])(?:optax_accum\.)?{wing}\.{re.escape(name)}"
    else:
        named = rf"(?:(?<![\w.])|(?<=optax_accum\.)){re.escape(name)}"
    pattern = re.compile(named + r"(?!\w)")
    counts = {
        path.stem: len(pattern.findall(path.read_text()))
        for path in sorted(GUIDES.glob("*.md"))
        if path.stem not in REFERENCE_GUIDES
    }
    best = max(counts, key=lambda stem: (counts[stem], -sorted(counts).index(stem)))
    return best if counts[best] else None


def rows() -> list[tuple[str, str, str, str | None]]:
    """``(qualified name, face, summary, guide stem)`` for every public name."""
    out = []
    for module in wings():
        wing = module.__name__.removeprefix("optax_accum").lstrip(".")
        for name in module.__all__:
            qualified = f"{module.__name__}.{name}"
            face = wing or FACE.get(name, "types")
            out.append(
                (
                    qualified,
                    face,
                    summary(name, getattr(module, name)),
                    guide_of(name, wing),
                )
            )
    return out


def render() -> str:
    lines = ["| Name | Face | What it is | Guide |", "| --- | --- | --- | --- |"]
    for qualified, face, text, guide in rows():
        link = (
            f"[{guide.replace('_', ' ')}](docs/guides/{guide}.md)"
            if guide
            else "[reference](docs/api/index.md)"
        )
        lines.append(f"| `{qualified}` | {face} | {text} | {link} |")
    return HEADER + "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
