# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The command line of every ``bench_*.py``: ``--quick``, ``--rounds``, ``--out``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .report import out_paths, write_results


def _rounds(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def parser(description: str) -> argparse.ArgumentParser:
    """The common options; a script adds its own to what this returns."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small sizes, seconds")
    p.add_argument("--rounds", type=_rounds, default=None, help="timed rounds")
    p.add_argument(
        "--out",
        default=None,
        help="write the Markdown and the JSON: a .md file (its .json beside it) "
        "or a folder",
    )
    return p


def script_main(
    name: str,
    description: str,
    measure: Callable[..., dict[str, Any]],
    markdown: Callable[[dict[str, Any]], str],
    argv: list[str] | None = None,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    write: Callable[[dict[str, Any], Path], Any] | None = None,
) -> int:
    """Parses the command line, measures, prints the Markdown, writes ``--out``.

    ``measure`` gets ``quick``, ``rounds`` and the options ``add_arguments``
    added; ``write(data, folder)`` replaces the default files
    (``<folder>/<name>.md`` and ``.json``, or the ``.md`` file given).
    """
    p = parser(description)
    if add_arguments is not None:
        add_arguments(p)
    args = vars(p.parse_args(argv))
    out = args.pop("out")
    data = measure(**args)
    text = markdown(data)
    if out is not None and write is not None:
        write(data, Path(out))
    elif out is not None:
        md, js = write_results(out_paths(out, Path(out), name)[0], text, data)
        print(f"Wrote {md} and {js}")
    print(text)
    return 0


def sizes(
    configs: dict[str, dict[str, Any]],
    quick: bool,
    config: dict[str, Any] | None = None,
    **given: Any,
) -> dict[str, Any]:
    """A script's sizes: ``config``, else ``configs["quick"]`` or ``["cpu"]``,
    with each of ``given`` (``rounds=``, ``micro=``...) that is set."""
    cfg = dict(config if config is not None else configs["quick" if quick else "cpu"])
    cfg.update({k: v for k, v in given.items() if v})
    return cfg
