# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The sizes of ``benchmarks/run.py --device``: one H200, or ``--smoke`` on the CPU.

Per section: its arguments and its estimated time (what the budget loop of
``device_run.py`` compares with the time left).
"""

from __future__ import annotations

from typing import Any

# The device run, sized for one H200 (141 GB HBM). Estimates (seconds, on the
# H200 machine's 16 cores) come from the compilations each section makes, at
# about 2 s per MLP step and 30 to 45 s per gpt2_small step, 6 compiling at
# once (XLA releases the GIL), and about 12 s per measuring process (start,
# CUDA, parameters, the step from the compilation cache, one update), 4 at
# once; timing is a few seconds per section. See each entry.
DEVICE: dict[str, Any] = {
    "threads": 6,  # concurrent compilations
    "workers": 4,  # concurrent peak-measuring processes
    "worker_timeout_s": 240,
    # 4 candidate steps + 3 floor programs = 7 MLP compilations; 134M
    # parameters, 12 rounds of 8 calls of ~1 ms: ~25 s.
    "accumulate": {
        "config": {"width": 4096, "depth": 8, "micro": 128, "k": 8, "rounds": 11},
        "estimate_s": 25,
    },
    # 6 variants + 1 more k = 7 MLP compilations; 67M parameters, batch
    # 2048: ~25 s.
    "microbatch": {
        "config": {"width": 4096, "layers": 4, "micro": 256, "k": 8, "rounds": 7},
        "estimate_s": 25,
    },
    "transformer": {"preset": "gpt2_small", "changes": {}},
    # 3 remat x 2 dtypes x 2 k = 12 gpt2_small compilations (2 waves of 6,
    # ~45 s each) and 12 measuring processes (3 waves of 4, ~12 s each):
    # ~130 s, plus the parameters' initialisation.
    "memory_map": {
        "args": {
            "remats": ("none", "dots", "full"),
            "dtypes": ("f32", "bf16"),
            "ks": (1, 4),
            "micro": 8,
        },
        "estimate_s": 140,
    },
    # 3 fused steps from the memory map + `accumulate` + the plain step on 32
    # sequences: 2 compilations (one wave, ~45 s), 6 rounds of 5 updates of
    # ~0.15 s: ~50 s.
    "time_per_token": {
        "args": {
            "remats": ("none", "dots", "full"),
            "dtype": "bf16",
            "k": 4,
            "micro": 8,
            "rounds": 5,
        },
        "estimate_s": 50,
    },
    # The plain step at 8 sequences (at 32 from above): 1 compilation, then the
    # batch found, the next one, `microbatch` and `accumulate` on it: 4 in one
    # wave; 6 rounds of 3 updates of ~0.4 s: ~100 s.
    "overhead": {
        "args": {
            "dtype": "bf16",
            "remat": "none",
            "k": 4,
            "fit_batches": (8, 32),
            "multiple": 8,
            "max_batch": 512,
            "rounds": 5,
        },
        "budget_fraction": 0.9,  # of bytes_limit - bytes_in_use
        "budget_bytes": None,
        "estimate_s": 100,
    },
    # 2 forms x 3 k x with/without offload = 12 gpt2_small compilations (the
    # fused step and `accumulate` without offload at k=4 come from above): 2
    # waves of 6, ~45 s each; 4 rounds of 12 updates of ~0.05 to 0.6 s: ~110 s.
    "offload": {
        "args": {
            "ks": (1, 4, 16),
            "remat": "none",
            "dtype": "bf16",
            "micro": 8,
            "rounds": 4,
        },
        "estimate_s": 110,
    },
    # Five schedules at S = 1, two compiles each (seconds at this width), 7
    # interleaved rounds of steps of a few milliseconds.
    "pipeline": {
        "config": {"width": 1024, "rows": 64, "m": 8, "rounds": 7},
        "estimate_s": 40,
    },
}

# The same code paths on the CPU, on sizes that take seconds.
SMOKE: dict[str, Any] = {
    "threads": 2,
    "workers": 2,
    "worker_timeout_s": 120,
    "accumulate": {
        "config": {"width": 64, "depth": 2, "micro": 8, "k": 2, "rounds": 2},
        "estimate_s": 5,
    },
    "microbatch": {
        "config": {"width": 64, "layers": 2, "micro": 8, "k": 4, "rounds": 2},
        "estimate_s": 5,
    },
    "transformer": {"preset": "tiny", "changes": {"n_layers": 1}},
    "memory_map": {
        "args": {
            "remats": ("none", "full"),
            "dtypes": ("bf16",),
            "ks": (2,),
            "micro": 2,
            # The CPU reports no memory: a pool that fits both processes
            # (1 GiB + the step each), to run the GPU's admission code.
            "pool_bytes": 3 * 2**30,
        },
        "estimate_s": 20,
    },
    "time_per_token": {
        "args": {
            "remats": ("none", "full"),
            "dtype": "bf16",
            "k": 2,
            "micro": 2,
            "rounds": 2,
        },
        "estimate_s": 5,
    },
    "overhead": {
        "args": {
            "dtype": "bf16",
            "remat": "none",
            "k": 2,
            "fit_batches": (2, 4),
            "multiple": 2,
            "max_batch": 64,
            "rounds": 2,
        },
        "budget_fraction": 0.9,
        "budget_bytes": 8 * 2**20,  # the CPU reports no free memory
        "estimate_s": 10,
    },
    "offload": {
        "args": {
            "ks": (1, 2),  # k=2 reuses the time_per_token steps
            "remat": "none",
            "dtype": "bf16",
            "micro": 2,
            "rounds": 2,
        },
        "estimate_s": 10,
    },
    "pipeline": {
        "config": {"width": 16, "rows": 2, "m": 4, "rounds": 2},
        "estimate_s": 10,
    },
}
