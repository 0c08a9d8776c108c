# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Command line: ``python -m optax_accum demo`` and ``python -m optax_accum bench``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    import optax_accum

    print(f"optax_accum {optax_accum.__version__}: the demo is not built yet.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
