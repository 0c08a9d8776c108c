# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The command an error shows for a missing optional dependency (an extra).

The package is installed by name from an index, or from a source checkout
(a clone or an unpacked sdist), so each message shows both commands.
"""

from __future__ import annotations


def install_command(extra: str) -> str:
    """``pip install`` of ``extra``, by name and from a source checkout."""
    return (
        f'pip install "optax_accum[{extra}]", or from a source checkout, in its '
        f'root folder: pip install -e ".[{extra}]"'
    )
