# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The memory map's plot: peak memory against the effective batch."""

from __future__ import annotations

from pathlib import Path

from .setup import MiB

COLORS = {"none": "C0", "dots": "C1", "full": "C2"}
STYLES = {"f32": "-", "bf16": "--"}
WIDTHS = {"none": 4.0, "dots": 2.5, "full": 1.2}
MARKERS = {"none": "o", "dots": "s", "full": "D"}


def _panel(ax, data: dict, mode: str, full: list[dict]) -> None:
    lines: dict[tuple, list] = {}
    for r in data["grid"]:
        if r["mode"] == mode:
            lines.setdefault((r["remat"], r["dtype"]), []).append(r)
    for (remat, dtype), rs in lines.items():
        ax.plot(
            [r["effective_batch"] for r in rs],
            [r["memory"]["peak"] / MiB for r in rs],
            STYLES[dtype],
            color=COLORS[remat],
            # Wider lines under narrower ones: equal peaks stay visible.
            linewidth=WIDTHS[remat],
            marker=MARKERS[remat],
            markersize=2 + 2 * WIDTHS[remat],
            alpha=0.8,
            label=f"remat {remat}, {dtype}",
        )
    ax.plot(
        [r["effective_batch"] for r in full],
        [r["memory"]["peak"] / MiB for r in full],
        ":",
        color="k",
        marker="^",
        label="full batch, no remat, f32",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("effective batch (sequences)")
    ax.set_title(f"`{mode}`, micro-batch {data['sizes']['micro']}")
    ax.grid(True, which="both", alpha=0.3)


def plot(data: dict, path: Path) -> Path:
    """Peak memory vs effective batch, one line per combination."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    full = sorted(
        (r for r in data["anchors"] if r["mode"] == "full"),
        key=lambda r: r["effective_batch"],
    )
    for ax, mode in zip(axes, ("microbatch", "accumulate"), strict=True):
        _panel(ax, data, mode, full)
    axes[0].set_ylabel("compiled peak memory per device (MiB)")
    axes[1].legend(fontsize=8)
    m = data["model"]
    fig.suptitle(
        f"GPT {m['preset']} ({m['params'] / 1e6:.1f}M params) on {data['device']}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
