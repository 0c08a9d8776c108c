# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The benchmark runner: every ``benchmarks/bench_*.py``, or one device run.

``python benchmarks/run.py [--quick] [--full] [--out PATH]``
  Runs each ``bench_*.py`` of this folder (or ``--benchmarks-dir``): its
  ``measure(quick=...)`` returns its rows as data, its ``markdown(data)``
  renders them. Prints the Markdown; ``--out FILE.md`` also writes it.
  ``--full`` runs every script at the sizes of the backend found and writes
  one Markdown and one JSON file (default
  ``benchmarks/results/bench_<device>.md`` and ``.json``); a script with
  ``write_full(data, out_dir)`` adds its own files there (plots).

``python benchmarks/run.py --device [--smoke] [--budget-s 420] [--out PATH]``
  One run sized for one NVIDIA H200, written to
  ``benchmarks/results/<device>.md`` and ``.json`` after every section:

  1. `accumulate` vs ``optax.MultiSteps``: time per update, compiled memory
     (``bench_accumulate``, an 8x4096 MLP);
  2. `microbatch` vs a hand-written ``lax.scan`` vs
     ``optax.microbatching.microbatch`` (``bench_microbatch``, a 4x4096 MLP);
  3. the memory map of the ``gpt2_small`` GPT of ``examples/gpt.py``: remat x
     compute dtype x k, the measured peak (one fresh process per variant) next
     to the compiled estimate;
  4. time per token at micro-batch 8 x 1024 tokens, bf16;
  5. accumulation's cost over the plain step at the largest batch that fits.

  A section starts only if its estimated time fits in what is left of the
  budget; the output says which did not. ``--smoke`` runs the same code on a
  tiny config on the CPU (about 35 s of CPU time; ``tests/integration`` runs
  it).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

START = time.monotonic()  # the time budget counts from here (JAX comes later)
BENCHMARKS_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCHMARKS_DIR / "results"
if str(BENCHMARKS_DIR) not in sys.path:  # the harness, beside this file
    sys.path.insert(0, str(BENCHMARKS_DIR))

import device_run  # noqa: E402
import harness  # noqa: E402
from device_sizes import DEVICE, SMOKE  # noqa: E402


def _log(line: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    print(f"[{stamp} +{time.monotonic() - START:6.1f} s] {line}", flush=True)


def _load_script(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"_optax_accum_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [
        f for f in ("measure", "markdown") if not callable(getattr(module, f, None))
    ]
    if missing:
        raise AttributeError(
            f"{path} has no `measure(quick) -> dict` and `markdown(data) -> str` "
            f"(missing: {', '.join(missing)})"
        )
    return module


# ------------------------------------------------------ bench_*.py scripts


def _full_head(info: dict[str, Any], quick: bool) -> str:
    return (
        f"## Benchmarks on {info['device']} ({info['backend']}, "
        f"{info['device_count']} device(s))\n\njax {info['jax']}, optax "
        f"{info['optax']}, {info['date']}{', quick sizes' if quick else ''}. "
        f"Command: `python benchmarks/run.py --full{' --quick' if quick else ''}`.\n"
    )


def run_scripts(
    quick: bool, out: str | None, benchmarks_dir: Path, full: bool = False
) -> int:
    """Runs every ``bench_*.py`` of ``benchmarks_dir``; see the module docstring."""
    scripts = (
        sorted(benchmarks_dir.glob("bench_*.py")) if benchmarks_dir.is_dir() else []
    )
    if not scripts:
        print(
            f"error: no bench_*.py found in {benchmarks_dir} (pass "
            "--benchmarks-dir, or run from a source checkout)",
            file=sys.stderr,
        )
        return 2
    sections, results, modules = [], {}, {}
    for path in scripts:
        print(f"Running {path.name}{' (quick)' if quick else ''} ...", file=sys.stderr)
        module = modules[path.stem] = _load_script(path)
        results[path.stem] = data = module.measure(quick=quick)
        sections.append(f"### {path.stem}\n\n{module.markdown(data).strip()}\n")
        print(sections[-1], flush=True)
    if not full:
        if out is not None:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text("\n".join(sections))
            print(f"Wrote the tables to {Path(out).resolve()}")
        return 0
    info = harness.device_info()
    stem = f"bench_{harness.report.slug(str(info['device']))}"
    md, _ = harness.report.out_paths(out, benchmarks_dir / "results", stem)
    md.parent.mkdir(parents=True, exist_ok=True)
    for stem, module in modules.items():
        if callable(getattr(module, "write_full", None)):
            module.write_full(results[stem], md.parent)
    text = "\n".join([_full_head(info, quick), *sections])
    command = f"python benchmarks/run.py --full{' --quick' if quick else ''}"
    md, js = harness.write_results(md, text, {**info, "benchmarks": results}, command)
    print(f"Wrote {md.resolve()} and {js.resolve()}")
    return 0


# -------------------------------------------------------------- device run


def _setup_jax(smoke: bool) -> None:
    # Before JAX starts: take device memory as needed, not 75% up front, so
    # that the memory map's measuring processes fit next to this one.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if smoke:  # numbers that mean nothing, so compile fast (workers inherit it)
        flags = "--xla_backend_optimization_level=0"
        flags += " --xla_llvm_disable_expensive_passes=true"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    import jax

    if smoke:
        jax.config.update("jax_platforms", "cpu")
    sys.dont_write_bytecode = True  # no __pycache__ in benchmarks/


def _chosen(todo: list, only: list[str] | None) -> list:
    names = [s.name for s in todo]
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        raise SystemExit(f"error: no section {unknown}; the sections: {names}")
    return [s for s in todo if s.name in only] if only else todo


def run_device(
    smoke: bool,
    budget_s: float,
    out: str | None,
    cache_dir: str | None,
    only: list[str] | None = None,
    threads: int | None = None,
    workers: int | None = None,
    command: str = "python benchmarks/run.py --device",
) -> int:
    """The device run (``--device``); see the module docstring.

    ``only``: the names of the sections to run (default all); ``threads`` and
    ``workers`` replace the config's concurrent compilations and measuring
    processes; ``command`` is what the report says was run.
    """
    _setup_jax(smoke)
    cfg = dict(SMOKE if smoke else DEVICE)
    cfg["threads"], cfg["workers"] = (
        threads or cfg["threads"],
        workers or cfg["workers"],
    )
    own_cache = cache_dir is None
    cache_dir = cache_dir or tempfile.mkdtemp(prefix="optax_accum_jax_cache_")
    harness.use_compilation_cache(cache_dir)
    try:
        info = harness.device_info()
        stem = harness.report.slug(str(info["device"])) + ("_smoke" if smoke else "")
        md, js = harness.report.out_paths(out, RESULTS_DIR, stem)
        limit = info["bytes_limit"]
        _log(
            f"{info['device']} ({info['backend']}, {info['device_count']} device(s)), "
            f"jax {info['jax']}, memory limit "
            + (f"{limit / 2**30:.1f} GiB" if limit else "not reported")
            + f"; budget {budget_s:g} s; writing {md}"
        )
        ctx = device_run.Context(cfg, cache_dir, _log)
        todo = _chosen(device_run.sections(ctx), only)
        _log(
            "plan: "
            + ", ".join(f"{s.name} ~{s.estimate_s:.0f} s" for s in todo)
            + f" (total ~{sum(s.estimate_s for s in todo):.0f} s)"
        )
        write = device_run.writer(md, info, command, smoke, budget_s, START)
        outcomes = device_run.run_sections(todo, START, budget_s, write, _log)
        _log(f"wrote {md} and {js}")
        return 1 if any(o.status == "error" for o in outcomes) else 0
    finally:
        if own_cache:
            shutil.rmtree(cache_dir, ignore_errors=True)


def _device_options(parser: argparse.ArgumentParser) -> None:
    """The options that go with ``--device``."""
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="with --device: no section starts that would end after this many "
        "seconds from the start (default 420)",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="with --device: JAX's compilation cache (default: a new temporary folder)",
    )
    parser.add_argument(
        "--only",
        default=None,
        metavar="NAMES",
        help="with --device: only these sections, comma-separated (accumulate, "
        "microbatch, memory_map, time_per_token, overhead, offload, pipeline)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="with --device: concurrent compilations (default 6; 2 with --smoke)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="with --device: concurrent peak-measuring processes (default 4; 2 "
        "with --smoke)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/run.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI")
    parser.add_argument(
        "--full",
        action="store_true",
        help="every benchmark at the sizes of the backend found, written to one "
        "Markdown and one JSON file (default: benchmarks/results/"
        "bench_<device>.md and .json)",
    )
    parser.add_argument(
        "--device",
        action="store_true",
        help="the one-command device run (one H200): benchmarks/results/"
        "<device>.md and .json",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="with --device: the same code on a tiny config, on the CPU",
    )
    _device_options(parser)
    parser.add_argument(
        "--out",
        help="a Markdown file (its JSON goes next to it), or with --full and "
        "--device a folder",
    )
    parser.add_argument(
        "--benchmarks-dir",
        type=Path,
        default=BENCHMARKS_DIR,
        help=f"where the bench_*.py scripts are (default: {BENCHMARKS_DIR})",
    )
    return parser


def _device_command(args: argparse.Namespace) -> str:
    """What ran, for the report (where the files went is left out)."""
    shown = ["--device", *["--smoke"] * args.smoke]
    for flag, value in (
        ("--budget-s", None if args.budget_s == 420 else f"{args.budget_s:g}"),
        ("--only", args.only),
        ("--threads", args.threads),
        ("--workers", args.workers),
    ):
        shown += [flag, str(value)] if value is not None else []
    return "python benchmarks/run.py " + " ".join(shown)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.smoke and not args.device:
        parser.error("--smoke goes with --device")
    if args.device:
        if args.quick or args.full:
            parser.error("--device has its own sizes: no --quick or --full")
        return run_device(
            args.smoke,
            args.budget_s,
            args.out,
            args.cache_dir,
            only=args.only.split(",") if args.only else None,
            threads=args.threads,
            workers=args.workers,
            command=_device_command(args),
        )
    sys.dont_write_bytecode = True
    return run_scripts(args.quick, args.out, args.benchmarks_dir, full=args.full)


if __name__ == "__main__":
    sys.exit(main())
