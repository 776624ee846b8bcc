"""benchmarks/cost_fidelity.py's summary and plot: Spearman's rank correlation, the predicted-vs-measured log-log plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(v: list[float]) -> np.ndarray:
        arr = np.asarray(v, dtype=np.float64)
        order = arr.argsort()
        r = np.empty_like(arr)
        r[order] = np.arange(len(arr), dtype=np.float64)
        for value in np.unique(arr):  # ties share the mean rank
            r[arr == value] = r[arr == value].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def plot(rows: list[dict], path: Path, rho: float, med: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    pred = [r["predicted"]["step_s"] * 1e3 for r in rows]
    meas = [r["measured"]["step_s"] * 1e3 for r in rows]
    fig, ax = plt.subplots(figsize=(5, 5))
    lo, hi = min(pred + meas) / 1.3, max(pred + meas) * 1.3
    ax.fill_between([lo, hi], [lo / 1.25, hi / 1.25], [lo / 0.75, hi / 0.75], color="0.9",
                    label="|predicted - measured| <= 25% of measured")
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="measured = predicted")
    ax.loglog(pred, meas, "o")
    for i, (p, m) in enumerate(zip(pred, meas)):
        ax.annotate(str(i + 1), (p, m), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    ticks = [t for t in (20, 30, 50, 70, 100, 150, 200, 300, 500) if lo <= t <= hi]
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    ax.set_title(f"MoE layer fwd+bwd (EP, FSEP, HP, locality), W=2 gloo, {len(rows)} configs (numbered as in "
                 f"the JSON)\n"
                 f"Spearman {rho:.2f}, median |rel err| {100 * med:.0f}%", fontsize=8)
    ax.set_xlabel("predicted ms / step (cost model, calibrated profile)")
    ax.set_ylabel("measured ms / step (median)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
