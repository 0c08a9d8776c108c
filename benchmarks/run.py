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
import datetime
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

START = time.monotonic()  # the time budget counts from here (JAX comes later)
BENCHMARKS_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCHMARKS_DIR / "results"

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
}


# ------------------------------------------------------------------ helpers


def _load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"_optax_accum_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_script(path: Path) -> Any:
    module = _load(path)
    missing = [
        f for f in ("measure", "markdown") if not callable(getattr(module, f, None))
    ]
    if missing:
        raise AttributeError(
            f"{path} has no `measure(quick) -> dict` and `markdown(data) -> str` "
            f"(missing: {', '.join(missing)})"
        )
    return module


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "device"


def _out_paths(out: str | None, default_dir: Path, stem: str) -> tuple[Path, Path]:
    """``(markdown, json)``: ``out`` if it names a ``.md`` file, else in the
    folder ``out`` (default ``default_dir``) as ``<stem>.md``."""
    if out is not None and out.endswith(".md"):
        md = Path(out)
    else:
        md = (Path(out) if out is not None else default_dir) / f"{stem}.md"
    return md, md.with_suffix(".json")


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and getattr(x, "shape", None) == ():
        return x.item()
    return x


def _device_info() -> dict[str, Any]:
    import jax
    import jaxlib
    import optax

    device = jax.devices()[0]
    try:
        stats = dict(device.memory_stats() or {})
    except Exception:  # a backend that raises instead of returning None
        stats = {}
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
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
    }


def _log(line: str) -> None:
    stamp = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{stamp} +{time.monotonic() - START:6.1f} s] {line}", flush=True)


# ------------------------------------------------------ bench_*.py scripts


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
    info = _device_info() if full else {}
    sections, results, modules = [], {}, {}
    for path in scripts:
        print(f"Running {path.name}{' (quick)' if quick else ''} ...", file=sys.stderr)
        module = modules[path.stem] = _load_script(path)
        data = module.measure(quick=quick)
        section = f"### {path.stem}\n\n{module.markdown(data).strip()}\n"
        print(section, flush=True)
        sections.append(section)
        results[path.stem] = data
    if not full:
        if out is not None:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text("\n".join(sections))
            print(f"Wrote the tables to {Path(out).resolve()}")
        return 0
    md, js = _out_paths(
        out, benchmarks_dir / "results", f"bench_{_slug(str(info['device']))}"
    )
    md.parent.mkdir(parents=True, exist_ok=True)
    for stem, module in modules.items():
        if callable(getattr(module, "write_full", None)):
            module.write_full(results[stem], md.parent)
    head = (
        f"## Benchmarks on {info['device']} ({info['backend']}, "
        f"{info['device_count']} device(s))\n\njax {info['jax']}, optax "
        f"{info['optax']}, {info['date']}{', quick sizes' if quick else ''}. "
        f"Command: `python benchmarks/run.py --full{' --quick' if quick else ''}`.\n"
    )
    md.write_text("\n".join([head, *sections]))
    js.write_text(json.dumps(_jsonable({**info, "benchmarks": results}), indent=1))
    print(f"Wrote {md.resolve()} and {js.resolve()}")
    return 0


# -------------------------------------------------------------- device run


class Section:
    """One part of the device run: a title, a runner, a renderer, an estimate."""

    def __init__(
        self,
        name: str,
        title: str,
        run: Callable[[float], dict],
        render: Callable[[dict], str],
        estimate_s: float,
    ):
        self.name, self.title, self.run, self.render = name, title, run, render
        self.estimate_s = estimate_s
        self.status, self.seconds, self.data = "not started", 0.0, None
        self.error: str | None = None

    def record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "status": self.status,
            "estimate_s": self.estimate_s,
            "seconds": self.seconds,
            "error": self.error,
            "data": self.data,
        }

    def markdown(self) -> str:
        text = f"### {self.title}\n\n"
        if self.status == "ok":
            return text + self.render(self.data).strip() + "\n"
        if self.status == "error":
            return text + f"Failed after {self.seconds:.0f} s: `{self.error}`\n"
        return text + self.status[:1].upper() + self.status[1:] + ".\n"


def _section_budget(sections: list[Section], i: int, end: float) -> float:
    """When section ``i`` must stop starting work: the budget's end, less the
    estimates of the sections after it."""
    return end - sum(s.estimate_s for s in sections[i + 1 :])


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
    cfg = dict(SMOKE if smoke else DEVICE)
    cfg["threads"] = threads or cfg["threads"]
    cfg["workers"] = workers or cfg["workers"]
    sys.dont_write_bytecode = True  # no __pycache__ in benchmarks/
    bt = _load(BENCHMARKS_DIR / "bench_transformer.py")
    ba = _load(BENCHMARKS_DIR / "bench_accumulate.py")
    bm = _load(BENCHMARKS_DIR / "bench_microbatch.py")
    own_cache = cache_dir is None
    cache_dir = cache_dir or tempfile.mkdtemp(prefix="optax_accum_jax_cache_")
    bt.use_compilation_cache(cache_dir)
    try:
        return _run_sections(
            smoke, budget_s, out, cache_dir, only, cfg, bt, ba, bm, command
        )
    finally:
        if own_cache:
            shutil.rmtree(cache_dir, ignore_errors=True)


def _run_sections(
    smoke: bool,
    budget_s: float,
    out: str | None,
    cache_dir: str,
    only: list[str] | None,
    cfg: dict[str, Any],
    bt: Any,
    ba: Any,
    bm: Any,
    command: str,
) -> int:
    """`run_device`'s sections, with JAX set up and the scripts loaded."""
    info = _device_info()
    stem = _slug(str(info["device"])) + ("_smoke" if smoke else "")
    md_path, json_path = _out_paths(out, RESULTS_DIR, stem)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    _log(
        f"{info['device']} ({info['backend']}, {info['device_count']} device(s)), "
        f"jax {info['jax']}, memory limit "
        + (
            f"{info['bytes_limit'] / 2**30:.1f} GiB"
            if info["bytes_limit"]
            else "not reported"
        )
        + f"; budget {budget_s:g} s; writing {md_path}"
    )
    end = START + budget_s
    holder: dict[str, Any] = {}

    def bench() -> Any:  # the GPT's parameters, made once for sections 3-5
        if "bench" not in holder:
            holder["bench"] = bt.Bench(cfg["transformer"], log=_log)
        return holder["bench"]

    common = {"threads": cfg["threads"], "log": _log}

    def memory_map(deadline: float) -> dict:
        return bt.memory_map(
            bench(),
            **cfg["memory_map"]["args"],
            workers=cfg["workers"],
            worker_timeout_s=cfg["worker_timeout_s"],
            cache_dir=cache_dir,
            deadline=deadline,
            **common,
        )

    def tokens(deadline: float) -> dict:
        return bt.time_per_token(
            bench(), **cfg["time_per_token"]["args"], deadline=deadline, **common
        )

    def overhead(deadline: float) -> dict:
        c = cfg["overhead"]
        budget = c["budget_bytes"]
        if budget is None:
            stats = bt.memory_stats()
            if "bytes_limit" not in stats:
                raise RuntimeError("the device reports no memory limit")
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            budget = int(c["budget_fraction"] * free)
        return bt.overhead(
            bench(), **c["args"], budget=budget, deadline=deadline, **common
        )

    a, m = cfg["accumulate"]["config"], cfg["microbatch"]["config"]
    mm, tt = cfg["memory_map"]["args"], cfg["time_per_token"]["args"]
    oh = cfg["overhead"]["args"]
    preset = cfg["transformer"]["preset"]
    sections = [
        Section(
            "accumulate",
            f"`accumulate` vs `optax.MultiSteps`: {a['depth']}x{a['width']} MLP, "
            f"micro-batch {a['micro']}, k={a['k']}, Adam, 1 device",
            lambda _: ba.measure(config=a, log=_log),
            ba.markdown,
            cfg["accumulate"]["estimate_s"],
        ),
        Section(
            "microbatch",
            f"`microbatch` vs a hand-written `lax.scan` vs "
            f"`optax.microbatching.microbatch`: {m['layers']}x{m['width']} MLP, "
            f"micro-batch {m['micro']}, k={m['k']}, Adam, 1 device",
            lambda _: bm.measure(config=m, log=_log),
            bm.markdown,
            cfg["microbatch"]["estimate_s"],
        ),
        Section(
            "memory_map",
            f"Memory map: {preset}, remat {'/'.join(mm['remats'])} x "
            f"{'/'.join(mm['dtypes'])} x k={'/'.join(map(str, mm['ks']))}, "
            f"micro-batch {mm['micro']}, measured vs compiled peak",
            memory_map,
            bt.markdown_memory_map,
            cfg["memory_map"]["estimate_s"],
        ),
        Section(
            "time_per_token",
            f"Time per token: {preset}, {tt['dtype']}, micro-batch {tt['micro']}, "
            f"k={tt['k']}",
            tokens,
            bt.markdown_time_per_token,
            cfg["time_per_token"]["estimate_s"],
        ),
        Section(
            "overhead",
            f"Accumulation overhead at the largest plain batch that fits: "
            f"{preset}, {oh['dtype']}, remat {oh['remat']}, k={oh['k']}",
            overhead,
            bt.markdown_overhead,
            cfg["overhead"]["estimate_s"],
        ),
    ]
    names = [s.name for s in sections]
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        raise SystemExit(f"error: no section {unknown}; the sections: {names}")
    if only:
        sections = [s for s in sections if s.name in only]
    _log(
        "plan: "
        + ", ".join(f"{s.name} ~{s.estimate_s:.0f} s" for s in sections)
        + f" (total ~{sum(s.estimate_s for s in sections):.0f} s)"
    )

    def write() -> None:
        elapsed = time.monotonic() - START
        spent = [s for s in sections if s.status.startswith("not run")]
        head = [
            f"## Benchmarks on {info['device']} ({info['backend']}, "
            f"{info['device_count']} device(s))",
            "",
            f"jax {info['jax']} (jaxlib {info['jaxlib']}), optax {info['optax']}, "
            f"{info['platform_version'] or info['platform']}, memory limit "
            + (
                f"{info['bytes_limit'] / 2**30:.1f} GiB"
                if info["bytes_limit"]
                else "not reported"
            )
            + f", {info['date']}. Command: `{command}`. Time budget "
            f"{budget_s:g} s, {elapsed:.0f} s used"
            + (
                "; not started for lack of time: " + ", ".join(s.name for s in spent)
                if spent
                else ""
            )
            + f". Matmul precision: {info['default_matmul_precision'] or 'default'}"
            ". Every ratio is the median of interleaved rounds in one process.",
            "",
        ]
        summary = [
            "### Sections",
            "",
            "| section | status | seconds | estimate (s) | compilations |",
            "|---|---|---:|---:|---:|",
            *(
                f"| {s.name} | {s.status} | {s.seconds:.1f} | {s.estimate_s:.0f} | "
                f"{(s.data or {}).get('compilations', '-')} |"
                for s in sections
            ),
        ]
        parts = ["\n".join(head), *(s.markdown() for s in sections), *summary]
        md_path.write_text("\n".join(parts) + "\n")
        record = {
            **info,
            "command": command,
            "smoke": smoke,
            "budget_s": budget_s,
            "elapsed_s": elapsed,
            "sections": [s.record() for s in sections],
        }
        json_path.write_text(json.dumps(_jsonable(record), indent=1))

    for i, section in enumerate(sections):
        left = end - time.monotonic()
        if section.estimate_s > left:
            section.status = f"not run: the time budget of {budget_s:g} s " + (
                f"has {left:.0f} s left, this section needs ~{section.estimate_s:.0f} s"
                if left > 0
                else f"was spent ({time.monotonic() - START:.0f} s used)"
            )
            _log(f"{section.name}: {section.status}")
            write()
            continue
        _log(f"{section.name}: start ({section.title})")
        t0 = time.monotonic()
        try:
            section.data = section.run(_section_budget(sections, i, end))
            section.status = "ok"
        except Exception as e:  # keep the other sections' results
            section.status = "error"
            section.error = (
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            )
            traceback.print_exc()
        section.seconds = time.monotonic() - t0
        _log(f"{section.name}: {section.status} in {section.seconds:.1f} s")
        if section.status == "ok":
            print(section.render(section.data), flush=True)
        write()
    _log(f"wrote {md_path} and {json_path}")
    return 1 if any(s.status == "error" for s in sections) else 0


def main(argv: list[str] | None = None) -> int:
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
        "microbatch, memory_map, time_per_token, overhead)",
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
    args = parser.parse_args(argv)
    if args.smoke and not args.device:
        parser.error("--smoke goes with --device")
    if args.device:
        if args.quick or args.full:
            parser.error("--device has its own sizes: no --quick or --full")
        only = args.only.split(",") if args.only else None
        # What ran, for the report (where the files went is left out).
        shown = ["--device", *["--smoke"] * args.smoke]
        for flag, value in (
            ("--budget-s", None if args.budget_s == 420 else f"{args.budget_s:g}"),
            ("--only", args.only),
            ("--threads", args.threads),
            ("--workers", args.workers),
        ):
            shown += [flag, str(value)] if value is not None else []
        return run_device(
            args.smoke,
            args.budget_s,
            args.out,
            args.cache_dir,
            only=only,
            threads=args.threads,
            workers=args.workers,
            command="python benchmarks/run.py " + " ".join(shown),
        )
    sys.dont_write_bytecode = True
    return run_scripts(args.quick, args.out, args.benchmarks_dir, full=args.full)


if __name__ == "__main__":
    sys.exit(main())
