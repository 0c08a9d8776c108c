# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The oracle: every face and device mode against one float64 NumPy model.

`cells` names the variables of a cell; `table` declares which combinations
are refused (the compatibility table, as data); `data` builds a cell's rows
and the model's units; `model` is the documented semantics in float64 and
`expect` asks it for a cell's answer; `adapt_stream`, `adapt_loop`,
`adapt_flax` and `adapt_privacy` (per-example clipped sums, on the privacy
face's own cells) run the faces (`runtime` holds what they share, and the
cache of compiled functions by structure); `compare` holds the tolerances; `run` is
one cell end to end; `known` lists today's defects (strict xfails);
`matrix` picks the cells and `compat` renders the table for the docs.
`test_equinox` runs Equinox models (``None`` gradient leaves, `eqx.filter`
partitions) on the faces against the full batch and the plain optimizer.
"""
