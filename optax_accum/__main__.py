# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Command line: ``python -m optax_accum demo``.

``demo`` lives in `_demo`. The benchmarks are not part of the installed
package: a source checkout runs them with ``python benchmarks/run.py``.
"""

from __future__ import annotations

import argparse
import math
import sys


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer, got {text!r}"
            ) from None
        if value < low:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {low}, got {value}"
            )
        return value

    return parse


_positive_int = _int_at_least(1)


def _finite_float(low: float, *, inclusive: bool):
    """A float ``> low`` (``>= low`` if ``inclusive``), finite."""
    bound = f"{'>=' if inclusive else '>'} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a number, got {text!r}"
            ) from None
        ok = value >= low if inclusive else value > low
        if not (math.isfinite(value) and ok):
            raise argparse.ArgumentTypeError(
                f"expected a finite number {bound}, got {text!r}"
            )
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m optax_accum",
        description="Gradient accumulation for JAX: a demo.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="train on the digits data set with and without accumulation",
        description=(
            "Trains a Flax nnx MLP on scikit-learn's bundled 8x8 digits with a "
            "small batch b, with k x b accumulated through `accumulate` and "
            "through `microbatch`, and with a true batch of k x b. Prints a "
            "table, writes a PNG of the loss curves, and exits with status 1 "
            "if an accumulated run differs from the large batch by more than "
            "--tolerance (largest absolute parameter difference)."
        ),
    )
    demo.add_argument(
        "-k", type=_positive_int, default=4, help="micro-batches per update"
    )
    demo.add_argument("-b", type=_positive_int, default=32, help="micro-batch size")
    demo.add_argument(
        "--steps", type=_positive_int, default=200, help="updates per run"
    )
    demo.add_argument(
        "--seed", type=_int_at_least(0), default=0, help="data order and initialisation"
    )
    demo.add_argument(
        "--lr",
        type=_finite_float(0.0, inclusive=False),
        default=1e-3,
        help="Adam learning rate at batch b, > 0",
    )
    demo.add_argument(
        "--tolerance",
        type=_finite_float(0.0, inclusive=True),
        default=1e-4,
        help="max abs param diff, >= 0",
    )
    demo.add_argument("--out", default=".", help="folder for the PNG (default: cwd)")
    demo.add_argument("--no-progress", action="store_true", help="hide progress bars")

    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from ._demo import INSTALL_HINT, missing_requirements, run_demo

        missing = missing_requirements()
        if missing:  # before any training: one line, and the fix
            print(
                f"error: the demo needs {', '.join(missing)}, which "
                f"{'is' if len(missing) == 1 else 'are'} not installed: "
                f"{INSTALL_HINT}",
                file=sys.stderr,
            )
            return 2
        return run_demo(
            k=args.k,
            b=args.b,
            steps=args.steps,
            seed=args.seed,
            learning_rate=args.lr,
            out=args.out,
            tolerance=args.tolerance,
            progress=not args.no_progress,
        )
    raise AssertionError(f"unknown command {args.command!r}")  # argparse checks


if __name__ == "__main__":
    sys.exit(main())
