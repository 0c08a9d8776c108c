# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The ``python -m optax_accum demo`` run: accumulation against a true large batch.

A Flax nnx MLP learns scikit-learn's bundled 8x8 digits (no download) four
ways from the same initial parameters and the same example order: a small
batch ``b``; ``k`` micro-batches of ``b`` through `accumulate`; the same
through `microbatch`; and one true batch of ``k * b``. The accumulated runs
must end with the large batch's parameters up to float32 rounding. The
`accumulate` run also measures the gradient noise scale (`noise_scale`), the
batch size beyond which a larger batch buys little, early and at the end.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._accumulate import accumulate, noise_scale
from ._extras import install_command
from ._learning_rate import scale_learning_rate
from ._microbatch import microbatch

PLOT_NAME = "optax_accum_demo.png"
# What the demo imports beyond jax and optax, all in the `examples` extra (the
# model, the data set, the progress bars, the plot): module -> package name.
REQUIREMENTS = {
    "flax": "flax",
    "sklearn": "scikit-learn",
    "tqdm": "tqdm",
    "matplotlib": "matplotlib",
}
INSTALL_HINT = install_command("examples")
_DECAY = 0.9  # the noise scale's EMA in the `accumulate` run


def missing_requirements() -> list[str]:
    """The packages of `REQUIREMENTS` whose module cannot be imported here."""
    return [
        package
        for module, package in REQUIREMENTS.items()
        if importlib.util.find_spec(module) is None
    ]


@dataclass
class RunResult:
    name: str
    params: Any
    losses: list[float] = field(default_factory=list)
    seconds_per_update: float = 0.0
    temp_bytes: int = 0
    final_loss: float = 0.0
    accuracy: float = 0.0
    max_param_diff: float | None = None
    # (update, B_simple in examples), when the optimizer measures it.
    noise: list[tuple[int, float]] = field(default_factory=list)


def _load_digits(seed: int) -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = len(x) // 5
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def _example_order(n: int, steps: int, batch: int, seed: int) -> np.ndarray:
    """Row indices, ``(steps, batch)``: shuffled epochs, shared by every run."""
    rng = np.random.default_rng(seed + 1)
    epochs = -(-steps * batch // n)
    return np.concatenate([rng.permutation(n) for _ in range(epochs)])[
        : steps * batch
    ].reshape(steps, batch)


def _make_model(seed: int) -> tuple[Any, Any]:
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.hidden = nnx.Linear(64, 128, rngs=rngs)
            self.out = nnx.Linear(128, 10, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.out(jax.nn.relu(self.hidden(x)))

    return nnx.split(MLP(nnx.Rngs(seed)))


def run_demo(
    k: int = 4,
    b: int = 32,
    steps: int = 200,
    seed: int = 0,
    learning_rate: float = 1e-3,
    out: str | Path = ".",
    tolerance: float = 1e-4,
    progress: bool = True,
) -> int:
    """Trains the four runs, prints the table, writes the plot.

    Returns:
      The exit status: 0 if both accumulated runs match the large batch
      within ``tolerance`` (largest absolute parameter difference), else 1.
    """
    from flax import nnx

    x_train, y_train, x_test, y_test = _load_digits(seed)
    order = _example_order(len(x_train), steps, k * b, seed)
    graphdef, params0 = _make_model(seed)

    def loss_fn(params, batch):
        x, y = batch
        model = nnx.merge(graphdef, params)
        logits = model(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    grad_fn = jax.value_and_grad(loss_fn)
    # Adam's usual square-root rule for the k-times larger batch.
    big_lr = scale_learning_rate(learning_rate, b, k * b, rule="sqrt")
    # (name, optimizer, value-and-grad, rows per call, calls per update)
    runs = [
        (f"small batch {b}", optax.adam(learning_rate), grad_fn, b, 1),
        (
            f"accumulate {k}x{b}",
            # A window of one micro-batch on one device measures nothing.
            accumulate(
                optax.adam(big_lr), k, noise_scale_decay=_DECAY if k > 1 else None
            ),
            grad_fn,
            b,
            k,
        ),
        (f"microbatch {k}x{b}", optax.adam(big_lr), microbatch(grad_fn, k), k * b, 1),
        (f"large batch {k * b}", optax.adam(big_lr), grad_fn, k * b, 1),
    ]
    # Host arrays, as a data loader would hand them over. The small batch
    # takes the first b rows of each large batch.
    xs, ys = x_train[order], y_train[order]
    results = []
    for name, tx, value_and_grad, size, calls in runs:
        result = _train(
            name, tx, value_and_grad, params0, xs, ys, size, calls, progress
        )
        result.final_loss = float(loss_fn(result.params, (x_train, y_train)))
        logits = nnx.merge(graphdef, result.params)(jnp.asarray(x_test))
        result.accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
        results.append(result)

    large = results[-1]
    for result in results[1:3]:
        diffs = jax.tree.map(
            lambda p, q: jnp.max(jnp.abs(p - q)), result.params, large.params
        )
        result.max_param_diff = float(max(jax.tree.leaves(diffs)))

    print()
    print(_table(results, k, b, steps, learning_rate, big_lr))
    print(_noise_line(results[1], k * b))
    path = _plot(results, Path(out), k, b)
    print(f"\nWrote the loss curves to {path}")

    return _verdict(results[1:3], results[-1].name, tolerance)


def _verdict(accumulated: list[RunResult], large: str, tolerance: float) -> int:
    """Prints whether each run matches the large batch; the exit status."""
    bad = [r for r in accumulated if not r.max_param_diff <= tolerance]  # NaN too
    if bad:
        names = ", ".join(f"{r.name} ({r.max_param_diff:.2e})" for r in bad)
        print(
            f"FAIL: {names} differ from the {large} run by more than "
            f"{tolerance:g} (max abs parameter difference, float32)."
        )
        return 1
    print(
        f"OK: the accumulated runs match the {large} run within "
        f"{tolerance:g} (max abs parameter difference, float32)."
    )
    return 0


def _noise_line(result: RunResult, batch: int) -> str:
    """The noise-scale readings, early and at the end (one if they coincide)."""
    if not result.noise:
        return (
            f"Gradient noise scale: not measured ({result.name}: a window of one "
            "micro-batch measures nothing; use -k 2 or more)."
        )
    reads = [f"{b_simple:.0f} after update {t + 1}" for t, b_simple in result.noise]
    reads[0] = reads[0].replace(" after", " examples after", 1)
    return (
        f"Gradient noise scale B_simple ({result.name}, EMA {_DECAY}): "
        f"{', '.join(reads)}; the batch is {batch}. It grows as the loss "
        "falls: a batch below it uses each example well; one far above it "
        "buys little per example."
    )


def _noise_reads(steps: int) -> list[int]:
    """The updates after which the noise scale is read (each read waits for
    the device): early, and at the end; once in a run of 5 updates or fewer."""
    return sorted({min(max(steps // 10, 4), steps - 1), steps - 1})


def _train(name, tx, value_and_grad, params, xs, ys, size, calls, progress):
    """One run: ``calls`` calls of ``size`` rows per update, timed."""
    from tqdm.auto import tqdm

    def step(params, opt_state, batch):
        loss, grads = value_and_grad(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = tx.init(params)
    batch_spec = (
        jax.ShapeDtypeStruct((size, 64), jnp.float32),
        jax.ShapeDtypeStruct((size,), jnp.int32),
    )
    compiled = jax.jit(step).lower(params, opt_state, batch_spec).compile()
    # One untimed call: the first run of an executable pays one-off costs.
    jax.block_until_ready(compiled(params, opt_state, (xs[0, :size], ys[0, :size])))
    steps = len(xs)
    losses, noise = [], []
    measures = _has_noise_scale(opt_state)
    read_at = _noise_reads(steps) if measures else ()
    start = time.perf_counter()
    for t in tqdm(range(steps), desc=f"{name:>18}", disable=not progress):
        for i in range(calls):
            rows = slice(i * size, (i + 1) * size)
            params, opt_state, loss = compiled(
                params, opt_state, (xs[t, rows], ys[t, rows])
            )
            losses.append(loss)
        if t in read_at:
            b_simple = noise_scale(opt_state, microbatch_size=size).b_simple
            noise.append((t, float(b_simple)))
    jax.block_until_ready(params)
    seconds = (time.perf_counter() - start) / steps
    return RunResult(
        name,
        params,
        losses=np.asarray(losses).reshape(steps, calls).mean(1).tolist(),
        seconds_per_update=seconds,
        temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
        noise=noise,
    )


def _has_noise_scale(opt_state: Any) -> bool:
    try:
        noise_scale(opt_state)
    except ValueError:
        return False
    return True


# One word for both, and what each measures: the table's number is taken on
# the whole training set at the end, the plot's curve on each update's batch.
TRAIN_LOSS_TABLE = "the mean over the whole training set, after the last update"
TRAIN_LOSS_PLOT = "the mean over the update's batch, before it"


def _table(results, k, b, steps, lr, big_lr) -> str:
    header = (
        "run",
        "train loss",
        "test acc",
        "max |Δparam| vs large",
        "ms / update",
        "temp memory",
    )
    rows = [
        (
            r.name,
            f"{r.final_loss:.4f}",
            f"{100 * r.accuracy:.1f}%",
            "-" if r.max_param_diff is None else f"{r.max_param_diff:.1e}",
            f"{1e3 * r.seconds_per_update:.2f}",
            f"{r.temp_bytes / 1024:.1f} KiB",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(row):
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        return "  ".join(cells)

    title = (
        f"digits, nnx MLP 64-128-10, Adam, {steps} updates; lr {lr:g} for "
        f"batch {b}, {big_lr:.3g} for {k}x{b} (sqrt rule)"
    )
    rule = "-" * len(line(header))
    note = (
        f"train loss: {TRAIN_LOSS_TABLE}; the plot shows {TRAIN_LOSS_PLOT}, per update."
    )
    return "\n".join([title, rule, line(header), rule, *map(line, rows), rule, note])


def _plot(results: list[RunResult], out: Path, k: int, b: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    styles = [
        {"color": "tab:gray", "alpha": 0.6, "lw": 1},
        {"color": "tab:blue", "lw": 2.5},
        {"color": "tab:orange", "lw": 1.5, "ls": "--"},
        {"color": "black", "lw": 1, "ls": ":"},
    ]
    for result, style in zip(results, styles, strict=True):
        ax.plot(
            np.arange(1, len(result.losses) + 1),
            result.losses,
            **style,
            label=result.name,
        )
    ax.set_yscale("log")
    ax.set_xlabel("update")
    ax.set_ylabel(f"train loss ({TRAIN_LOSS_PLOT})")
    ax.set_title(f"Accumulating {k}x{b} reproduces the batch of {k * b}")
    ax.legend()
    fig.tight_layout()
    path = (out / PLOT_NAME).resolve()
    fig.savefig(path)
    plt.close(fig)
    return path
