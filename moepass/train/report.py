"""What a training run shows: a progress line per logged step, a JSON log and a loss-curve PNG."""

from __future__ import annotations

import json
import os
from typing import Any


def progress_line(rec: dict[str, Any], total: int) -> str:
    ref = rec.get("ref_loss")
    line = (f"step {rec['step']:>5}/{total}  loss {rec['loss']:.5f}"
            + (f"  ref {ref:.5f}  |dloss| {abs(rec['loss'] - ref):.2e}" if ref is not None else "")
            + f"  lr {rec['lr']:.2e}  {rec['tokens_per_s']:,.0f} tok/s")
    if rec.get("a2a_bytes"):
        line += f"  a2a {rec['a2a_bytes'] / 1024:.1f} KiB"
    if rec.get("restore_bytes"):
        line += f"  restore {rec['restore_bytes'] / 1024:.1f} KiB"
    return line


def write_json(path: str, log: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(log, f, indent=1)


def plot(path: str, curves: dict[str, list[tuple[int, float]]], title: str) -> str:
    """Loss against step for each labelled curve; a second panel with |loss - reference| when a curve is
    labelled "reference". Returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = dict(curves.get("reference", []))
    fig, axes = plt.subplots(2 if ref else 1, 1, figsize=(8, 6 if ref else 4), squeeze=False)
    for label, points in curves.items():
        axes[0][0].plot([s for s, _ in points], [v for _, v in points], label=label,
                        linestyle="--" if label == "reference" else "-")
    axes[0][0].set_ylabel("loss (nats/byte)")
    axes[0][0].set_title(title)
    axes[0][0].legend()
    if ref:
        for label, points in curves.items():
            if label == "reference":
                continue
            diffs = [(s, abs(v - ref[s])) for s, v in points if s in ref]
            axes[1][0].semilogy([s for s, _ in diffs], [max(d, 1e-12) for _, d in diffs], label=label)
        axes[1][0].set_ylabel("|loss - reference|")
        axes[1][0].legend()
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
