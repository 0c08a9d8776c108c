# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Type aliases for what the public functions accept."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Literal
from typing import Unpack as Unpack

#: A mapped axis (``pmap``/``shard_map``) or mesh axis name, or a tuple of them.
AxisName = Hashable | tuple[Hashable, ...]

#: How the micro-batch gradients of a window combine.
Reduction = Literal["mean", "sum"]
#: The row order of a fused step's row-wise ``aux`` leaves.
AuxOrder = Literal["microbatch", "batch"]

#: A floating or complex dtype, ``"promote"`` (at least float32, of each
#: gradient's own kind) or ``None`` (each gradient's own dtype); or a pytree
#: prefix of the gradients with one of these per subtree, e.g.
#: ``{"embed": jnp.bfloat16, "layers": "promote"}``.
AccumulatorDType = Any | Literal["promote"] | None
