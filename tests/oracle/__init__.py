# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The oracle: every face and device mode against one float64 NumPy model.

`cells` names the variables of a cell, `table` declares which combinations
are refused (the compatibility table), `data` builds a cell's inputs, `model`
computes the documented answer in float64, `adapters` runs a face, `compare`
holds the tolerances, `known` lists today's defects, `matrix` picks the cells
and `compat` renders the table for the docs.
"""
