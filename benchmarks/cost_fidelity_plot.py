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


def label(config: dict) -> str:
    """A config's form as the table shows it: FSEP with its slots, Lina's control (no priority) as "fair"."""
    if config["form"] == "fsep":
        return f"fsep{config['slots']}"
    if config["form"] == "lina" and not config.get("priority", True):
        return "fair"
    return config["form"]


def print_summary(out: dict, rows: list[dict], calibrations: int) -> None:
    """The run's table (per config: predicted, measured, the errors, per phase) and its summary lines."""
    def line(name: str, f: dict) -> str:
        return (f"{name}: median |rel err| {100 * f['median_abs_rel_error']:.1f}%, worst "
                f"{100 * f['worst_abs_rel_error']:.1f}%, {f['within_15pct']}/{f.get('configs', len(rows))} within 15%")

    print(f"{'form':>8} {'T':>5} {'D':>4} {'F':>4} {'E':>3} {'K':>2} {'cap':>5} {'factor':>6} {'pred ms':>8} "
          f"{'meas ms':>8} {'err':>7} {'fwd err':>7} {'bwd err':>7} {'fwd p/wall/cpu ms':>18} {'bwd p/wall/cpu ms':>18}")
    for r in rows:
        c, p, m = r["config"], r["predicted"], r["measured"]
        print(f"{label(c):>8} {c['tokens']:>5} {c['D']:>4} {c['F']:>4} {c['E']:>3} {c['K']:>2} {str(c['capacity']):>5} "
              f"{p['factor']:>6.3f} {p['step_s'] * 1e3:>8.2f} {m['step_s'] * 1e3:>8.2f} {100 * r['rel_error']:>+6.1f}% "
              f"{100 * r['rel_error_fwd']:>+6.1f}% {100 * r['rel_error_bwd']:>+6.1f}% "
              f"{p['fwd_s'] * 1e3:>6.1f}/{m['fwd_s'] * 1e3:>5.1f}/{m['fwd_cpu_s'] * 1e3:>5.1f} "
              f"{p['bwd_s'] * 1e3:>6.1f}/{m['bwd_s'] * 1e3:>5.1f}/{m['bwd_cpu_s'] * 1e3:>5.1f}")
    print(f"Spearman = {out['spearman']:.3f}, median |rel err| = {100 * out['median_abs_rel_error']:.1f}% (uniform "
          f"routing: {100 * out['median_abs_rel_error_uniform_routing']:.1f}%), measured spread "
          f"{out['measured_spread']:.2f}x, load {out['load_average_before'][0]:.2f} -> {out['load_average_after'][0]:.2f}")
    for form, f in out["by_form"].items():
        print(line(form, f))
    for form, f in out["by_form_without_helper_cpu"].items():
        print(line(f"{form} without the helper threads' CPU (threads_s = 0)", f))
    if out["cpu_share_in_run"] is not None:
        print(f"in-run CPU share (calibration's 256^3 matmul time / the same beside each config), median over the "
              f"configs: {out['cpu_share_in_run']:.3f}")
        for form, f in out["by_form_at_run_share"].items():
            print(line(f"{form} at the in-run share", f))
    for i, a in enumerate(out.get("calibrations", [])):
        print(line(f"calibration {i + 1} of {calibrations} alone (load {a['load_average'][0]:.2f})", a))
