# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The benchmark harness: how every ``benchmarks/bench_*.py`` measures.

A script says what it measures (its workload and its variants); the harness
does the rest, one concept a module:

- `timing`: interleaved rounds, and the median ratio to a named anchor with
  its spread;
- `memory`: compiled memory from ``memory_analysis()``, the device's
  ``memory_stats()``, JAX's persistent compilation cache;
- `peaks`: the measured peak of one step, each in a fresh process;
- `report`: Markdown tables from rows, the device and versions, the JSON
  results (with the command that made them);
- `cli`: the common command line (``--quick``, ``--rounds``, ``--out``);
- `isolated`: a script's `measure` in a process of its own (8 CPU devices).

A new ``bench_<question>.py`` (``benchmarks/run.py`` runs every one) holds its
workload and variants, and::

    def measure(quick=False, rounds=None) -> dict:   # the rows, as data
        times = harness.interleaved({"anchor": f, "candidate": g}, rounds)
        ratio = harness.ratio(times, "candidate", "anchor")  # median, q25, q75
        ...

    def markdown(data) -> str:                       # rendering, separately
        return "\n".join(harness.table(header, rows, "lr"))

    if __name__ == "__main__":
        raise SystemExit(harness.script_main("bench_x", __doc__, measure, markdown))

Run as a script, ``benchmarks/`` is on ``sys.path``; ``benchmarks/run.py``
puts it there for the scripts it loads.
"""

from . import cli as cli
from . import report as report
from .cli import script_main as script_main
from .isolated import json_of_script as json_of_script
from .isolated import needs_cpu_devices as needs_cpu_devices
from .memory import compiled_memory as compiled_memory
from .memory import memory_stats as memory_stats
from .memory import use_compilation_cache as use_compilation_cache
from .report import device_info as device_info
from .report import gib as gib
from .report import jsonable as jsonable
from .report import mib as mib
from .report import table as table
from .report import write_results as write_results
from .timing import Ratio as Ratio
from .timing import Timed as Timed
from .timing import interleaved as interleaved
from .timing import median as median
from .timing import ratio as ratio
from .timing import ratios as ratios
