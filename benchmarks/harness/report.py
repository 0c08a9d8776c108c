# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Markdown tables from rows, the device and versions, the JSON results.

The tables are rendered here rather than by ``tabulate``: its Markdown
formats pad every column to its widest cell, so a changed number re-pads
the whole table (noisy diffs of ``benchmarks/results/``), and the tables
here are a dozen lines of code.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def table(
    header: Sequence[str], rows: Iterable[Sequence[Any] | str], align: str
) -> list[str]:
    """The lines of a Markdown table.

    ``align`` has one letter per column: ``l`` (left) or ``r`` (right). A row
    that is a string is a line of its own (e.g. a failure across the columns).
    """
    if len(align) != len(header):
        raise ValueError(f"`align` {align!r} does not have {len(header)} letters")
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    lines = ["| " + " | ".join(header) + " |", rule]
    for row in rows:
        lines.append(
            row if isinstance(row, str) else "| " + " | ".join(map(str, row)) + " |"
        )
    return lines


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:,.2f}"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "device"


def jsonable(x: Any) -> Any:
    """Tuples to lists, dict keys to strings, NumPy/JAX scalars to Python."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "item") and getattr(x, "shape", None) == ():
        return x.item()
    return x


def device_info() -> dict[str, Any]:
    """The first device, its memory limit, the versions, the date."""
    import jax
    import jaxlib
    import optax

    from .memory import memory_stats

    device = jax.devices()[0]
    stats = memory_stats(device)
    return {
        "device": getattr(device, "device_kind", str(device)),
        "platform": getattr(device, "platform", "?"),
        "backend": jax.default_backend(),
        "device_count": jax.device_count(),
        "platform_version": getattr(device.client, "platform_version", None),
        "bytes_limit": stats.get("bytes_limit"),
        "memory_stats_keys": sorted(stats),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", None),
        "optax": optax.__version__,
        "python": sys.version.split()[0],
        "default_matmul_precision": getattr(
            jax.config, "jax_default_matmul_precision", None
        ),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def command_line(argv: Sequence[str] | None = None) -> str:
    """How this process was started, as ``python benchmarks/...``."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    if script.is_relative_to(ROOT):
        argv[0] = script.relative_to(ROOT).as_posix()
    return "python " + shlex.join(argv)


def out_paths(
    out: str | Path | None, default_dir: Path, stem: str
) -> tuple[Path, Path]:
    """``(markdown, json)``: ``out`` if it names a ``.md`` file, else in the
    folder ``out`` (default ``default_dir``) as ``<stem>.md``."""
    if out is not None and str(out).endswith(".md"):
        md = Path(out)
    else:
        md = (Path(out) if out is not None else default_dir) / f"{stem}.md"
    return md, md.with_suffix(".json")


def write_results(
    md: Path, markdown: str, data: dict[str, Any], command: str | None = None
) -> tuple[Path, Path]:
    """Writes the Markdown to ``md`` and the data to ``md`` with ``.json``.

    The JSON holds the data, the command that made it, and `device_info`.
    """
    js = md.with_suffix(".json")
    md.parent.mkdir(parents=True, exist_ok=True)
    record = {
        **data,
        "command": command or command_line(),
        "environment": device_info(),
    }
    js.write_text(json.dumps(jsonable(record), indent=1))  # first: the numbers
    md.write_text(markdown.rstrip("\n") + "\n")
    return md, js
