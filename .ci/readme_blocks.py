# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Runs README.md's ``python`` blocks as a user pastes them: each in a fresh
interpreter, in the current (empty) folder, importing whatever optax_accum the
interpreter finds. The wheel lane (.ci/wheel_lane.sh) runs it from outside
the checkout, so that is the installed wheel.

Usage: python readme_blocks.py PATH/TO/README.md
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def main(readme: str) -> int:
    blocks = _BLOCK.findall(Path(readme).read_text())
    if not blocks:
        print(f"no python blocks in {readme}", file=sys.stderr)
        return 1
    for i, code in enumerate(blocks, 1):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], check=False)
        took = time.perf_counter() - start
        print(f"README block {i}/{len(blocks)}: exit {done.returncode}, {took:.1f} s")
        if done.returncode:
            return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
