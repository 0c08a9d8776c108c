# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Command line: ``python -m optax_accum demo`` and ``python -m optax_accum bench``.

``demo`` lives in `_demo`. ``bench`` runs the ``benchmarks/bench_*.py`` scripts
of a source checkout (they are not part of the installed package), each of
which exposes ``run(quick: bool) -> str`` returning a Markdown table.
``bench --full`` writes one Markdown and one JSON file named after the device;
a script that also has ``run_full(quick, out_dir) -> (markdown, dict)`` gives
its own JSON data (and may write plots into ``out_dir``), the others' tables
are parsed into rows.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import re
import sys
from pathlib import Path

BENCHMARKS_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m optax_accum",
        description="Gradient accumulation for JAX: demo and benchmarks.",
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
        "--lr", type=float, default=1e-3, help="Adam learning rate at batch b"
    )
    demo.add_argument(
        "--tolerance", type=float, default=1e-4, help="max abs param diff"
    )
    demo.add_argument("--out", default=".", help="folder for the PNG (default: cwd)")
    demo.add_argument("--no-progress", action="store_true", help="hide progress bars")

    bench = commands.add_parser(
        "bench",
        help="run the benchmarks of a source checkout",
        description="Runs benchmarks/bench_*.py and prints their Markdown tables.",
    )
    bench.add_argument("--quick", action="store_true", help="small sizes, for CI")
    bench.add_argument(
        "--full",
        action="store_true",
        help=(
            "every benchmark at the sizes of the backend found, written to one "
            "Markdown and one JSON file (default: benchmarks/results/"
            "bench_<device>.md and .json)"
        ),
    )
    bench.add_argument(
        "--out",
        help="also write the tables to this Markdown file (with --full: the "
        "report, and the JSON next to it)",
    )
    bench.add_argument(
        "--benchmarks-dir",
        type=Path,
        default=BENCHMARKS_DIR,
        help=f"where the bench_*.py scripts are (default: {BENCHMARKS_DIR})",
    )
    return parser


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"_optax_accum_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "run", None)):
        raise AttributeError(f"{path} has no `run(quick: bool) -> str` function")
    return module


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "device"


def parse_tables(markdown: str) -> list[list[dict[str, str]]]:
    """The Markdown tables of ``markdown``, each a list of ``{header: cell}``."""
    tables, block = [], []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 2 and all(re.fullmatch(r":?-+:?", c) for c in block[1]):
            tables.append([dict(zip(block[0], row, strict=False)) for row in block[2:]])
        block = []
    return tables


def _device() -> dict[str, object]:
    import jax
    import optax

    device = jax.devices()[0]
    return {
        "device": getattr(device, "device_kind", str(device)),
        "backend": jax.default_backend(),
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
    }


def run_full_bench(quick: bool, out: str | None, scripts: list[Path]) -> int:
    info = _device()
    md_path = (
        Path(out)
        if out is not None
        else scripts[0].parent / "results" / f"bench_{_slug(str(info['device']))}.md"
    )
    md_path.parent.mkdir(parents=True, exist_ok=True)
    title = (
        f"## Benchmarks on {info['device']} ({info['backend']}, "
        f"{info['device_count']} device(s))"
    )
    sections = [
        f"{title}\n\njax {info['jax']}, optax {info['optax']}, "
        f"{info['date']}{', quick sizes' if quick else ''}. Command: "
        f"`python -m optax_accum bench --full{' --quick' if quick else ''}`.\n"
    ]
    results: dict[str, object] = {}
    for path in scripts:
        print(f"Running {path.name} (full) ...", file=sys.stderr, flush=True)
        module = _load(path)
        if callable(getattr(module, "run_full", None)):
            table, data = module.run_full(quick=quick, out_dir=md_path.parent)
        else:
            table = module.run(quick=quick)
            data = {"markdown": table, "tables": parse_tables(table)}
        section = f"### {path.stem}\n\n{table.strip()}\n"
        print(section, flush=True)
        sections.append(section)
        results[path.stem] = data
    md_path.write_text("\n".join(sections))
    json_path = md_path.with_suffix(".json")
    json_path.write_text(json.dumps({**info, "benchmarks": results}, indent=1))
    print(f"Wrote {md_path.resolve()} and {json_path.resolve()}")
    return 0


def run_bench(
    quick: bool, out: str | None, benchmarks_dir: Path, full: bool = False
) -> int:
    scripts = (
        sorted(benchmarks_dir.glob("bench_*.py")) if benchmarks_dir.is_dir() else []
    )
    if not scripts:
        print(
            f"error: no benchmarks/bench_*.py found in {benchmarks_dir}. The "
            "benchmarks ship with the source, not the package: run `bench` from "
            "a clone installed with `pip install -e .`, or pass --benchmarks-dir.",
            file=sys.stderr,
        )
        return 2
    if full:
        return run_full_bench(quick, out, scripts)
    sections = []
    for path in scripts:
        print(f"Running {path.name}{' (quick)' if quick else ''} ...", file=sys.stderr)
        table = _load(path).run(quick=quick).strip()
        section = f"### {path.stem}\n\n{table}\n"
        print(section, flush=True)
        sections.append(section)
    if out is not None:
        Path(out).write_text("\n".join(sections))
        print(f"Wrote the tables to {Path(out).resolve()}")
    return 0


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
    return run_bench(args.quick, args.out, args.benchmarks_dir, full=args.full)


if __name__ == "__main__":
    sys.exit(main())
