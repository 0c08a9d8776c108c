# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The transformer benchmark, one module per question, on one shared setup.

- `setup`: the GPT of ``examples/gpt.py``, its steps (`steps`), and `Bench`,
  which compiles them once and times them interleaved;
- `memory_map`: remat x compute dtype x k, compiled and measured peaks;
- `time_per_token`: the fused step and `accumulate` against their anchors;
- `small_micro`: the slowdown of small micro-batches at a fixed batch;
- `largest_batch`: the largest batch that fits, and accumulation's cost there;
- `offload`: the optimizer state in host memory between updates, against not.

``benchmarks/bench_transformer.py`` runs the CPU grid over all four;
``benchmarks/run.py --device`` runs their device sections.
"""
