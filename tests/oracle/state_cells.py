# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The dimensions of the faces that hold state: where the state arrives.

A `StateCell` is a face that holds an optimizer state across calls
(`accumulate`, `MultiSteps`, and the fused step, ``microbatch_value_and_grad``
then ``tx.update``), its inner optimizer wrapped in `offload`, an optax family
for that optimizer, the device mode, and two dimensions of issue 33:

- ``restore``: how the state comes back in the middle of a run: ``"none"``
  (it stays in the process), ``"eval_shape"`` (Orbax, into
  ``jax.eval_shape(tx.init, params)``) or ``"state_shardings"`` (Orbax, into
  `state_shardings` targets, with ``memory``'s kind: ``"device"`` is a
  device target);
- ``memory``: the memory kind the state's leaves arrive in at the next
  step, ``"device"`` or ``"pinned_host"`` (with ``restore="none"``,
  ``"device"`` is a user's ``jax.device_put`` of it).

Each cell is checked against the same face with the plain optimizer, run
without a break (bit for bit: `offload` changes where the state lives, not
a value), and, for the families the float64 model knows (SGD, Adam) on the
per-call faces, against the model (`adapt_state`). The families cover masks
(``optax.masked``, ``multi_transform``), a PRNG key (``optax.add_noise``),
injected hyperparameters (one written by hand at the break) and a
``jnp.where`` outside `offload` (``optax.apply_if_finite``). The cells are an
all-pairs covering array of these variables (`covering`), three of them in
the fast lane (`FAST`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

from allpairspy import AllPairs

from .cells import Cell

FACES = ("accumulate", "multisteps", "fused")
RESTORES = ("none", "eval_shape", "state_shardings")
MEMORY = ("device", "pinned_host")
FAMILIES = (
    "sgd",
    "adam",
    "masked",
    "multi_transform",
    "add_noise",
    "inject",
    "apply_if_finite",
)
MODES = ("single", "global")
MODEL_FAMILIES = ("sgd", "adam")  # the ones `model.INNER` knows

VARIABLES = {
    "face": FACES,
    "restore": RESTORES,
    "memory": MEMORY,
    "family": FAMILIES,
    "mode": MODES,
}


@dataclasses.dataclass(frozen=True)
class StateCell:
    face: str
    restore: str
    memory: str
    family: str
    mode: str = "single"
    k: int = 2

    @property
    def stream(self) -> bool:
        return self.face != "fused"

    def base(self) -> Cell:
        """The oracle's cell whose rows (`data.build`) and model answer
        (`expect.stream`) this one reuses."""
        face = {"fused": "loss"}.get(self.face, self.face)
        inner = self.family if self.family in MODEL_FAMILIES else "adam"
        return Cell(
            face, self.mode, "mean", "none", self.k, "f32", "promote", "none", inner
        )

    def id(self) -> str:
        return "/".join((self.face, self.mode, self.restore, self.memory, self.family))


def applicable(row: dict) -> bool:
    """``eval_shape`` names no memory kind, so it restores into device
    memory; and Orbax cannot restore into an Explicit mesh's ``eval_shape``
    (its shardings name an abstract mesh), whatever the optimizer."""
    if row.get("restore") == "eval_shape":
        return row.get("memory", "device") == "device" and row.get("mode") != "global"
    return True


def _pairs(row: dict) -> set:
    return set(itertools.combinations(sorted(row.items()), 2))


@functools.cache
def feasible_pairs() -> frozenset:
    rows = (
        dict(zip(VARIABLES, values, strict=True))
        for values in itertools.product(*VARIABLES.values())
    )
    return frozenset().union(*(_pairs(r) for r in rows if applicable(r)))


@functools.cache
def covering() -> tuple[StateCell, ...]:
    """Every feasible pair of values in at least one cell."""
    names = list(VARIABLES)
    admissible = lambda values: applicable(dict(zip(names, values, strict=False)))
    rows = [
        dict(zip(names, r, strict=True))
        for r in AllPairs(list(VARIABLES.values()), filter_func=admissible)
    ]
    missing = set(feasible_pairs()) - set().union(*(_pairs(r) for r in rows))
    for values in itertools.product(*VARIABLES.values()):  # allpairspy's gaps
        row = dict(zip(names, values, strict=True))
        if applicable(row) and _pairs(row) & missing:
            rows.append(row)
            missing -= _pairs(row)
    return tuple(StateCell(**r) for r in rows)


# The fast lane: a restore into eval_shape, a device target on a mesh with a
# PRNG key, a user's write of a hyperparameter in device memory.
FAST = (
    StateCell("accumulate", "eval_shape", "device", "adam"),
    StateCell("multisteps", "state_shardings", "device", "add_noise", "global"),
    StateCell("fused", "none", "device", "inject"),
)


def slow() -> tuple[StateCell, ...]:
    return tuple(c for c in covering() if c not in FAST)
