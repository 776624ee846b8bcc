"""Cost-model fidelity: predicted vs measured EP layer time on this machine (W=2, gloo).

SKELETON: the prediction half runs today (`--predict-only`); the measurement half needs moepass's EP
runtime (`moepass.compile(block, Plan(form="ep", ...))` under a gloo process group, and
`moepass.comm_stats()`), which is being written. Once it lands:

    python -m cost_model.calibrate --out benchmarks/results/cost_profile.json   # alpha, bandwidth, FLOP/s
    python benchmarks/cost_fidelity.py                                          # 10 configs, ~1-2 min

For each of the 10 configurations below: two spawned gloo ranks (one thread each) run a bare fused
MoE block (samples.models.FusedMoE) rewritten to EP over both ranks, time forward+backward (median
of a few steps after warm-up), and read the dispatch/combine byte counters. The result: Spearman's
rank correlation of predicted vs measured time (the claim to check: >= 0.8, i.e. the model orders
plans correctly even if absolute times are off), the ratio measured/predicted per config, bytes
measured vs the K*T*D*(W-1)/W formula, a JSON (benchmarks/results/cost_fidelity.json) and a
log-log scatter plot (benchmarks/results/cost_fidelity.png).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cost_model import ep as cm
from cost_model.presets import Hardware, this_machine

RESULTS = Path(__file__).resolve().parent / "results"
PROFILE = RESULTS / "cost_profile.json"


@dataclass(frozen=True)
class Config:
    tokens: int  # T per rank
    D: int
    F: int
    E: int
    K: int
    chunks: int


# Spread over the regimes the model distinguishes: latency-bound, bandwidth-bound, compute-bound,
# chunking that helps and chunking that hurts. Small enough for 2 CPU ranks (<= ~1 s per step).
CONFIGS = (
    Config(256, 64, 128, 4, 1, 1),
    Config(256, 64, 128, 4, 2, 1),
    Config(1024, 128, 256, 4, 2, 1),
    Config(1024, 128, 256, 4, 2, 4),
    Config(2048, 256, 512, 8, 2, 1),
    Config(2048, 256, 512, 8, 2, 4),
    Config(2048, 256, 512, 8, 4, 2),
    Config(4096, 256, 1024, 8, 2, 1),
    Config(4096, 256, 1024, 8, 2, 8),
    Config(1024, 512, 2048, 4, 1, 2),
)


def predict(cfg: Config, hw: Hardware, W: int = 2) -> dict[str, float]:
    """Cost-model step time of one EP layer (fwd+bwd) and the dispatch bytes per rank, uniform routing."""
    x = {
        **hw.values(),
        "T": cfg.tokens,
        "K": cfg.K,
        "D": cfg.D,
        "F": cfg.F,
        "m": 3,
        "E": cfg.E,
        "G": W,
        "rho": 1.0,
        "c_f": 1.0,
    }
    terms = cm.ep_layer(x, ep=W, n=cfg.chunks, dp=1, dropless=True, cross_node_dp=False)
    return {"step_s": float(terms.step), "dispatch_bytes": float(terms.a2a_bytes)}


def measure(cfg: Config, W: int = 2) -> dict[str, float]:
    """Measured step time and dispatch bytes per rank. Needs the EP runtime (see the docstring)."""
    import moepass

    if not hasattr(moepass, "comm_stats"):
        raise NotImplementedError("moepass.comm_stats / the EP runtime is not available yet: run --predict-only")
    # TODO(EP runtime): spawn W gloo ranks (cost_model.calibrate's worker pattern: set_num_threads(1),
    # timeout, barrier before destroy_process_group); in each: FusedMoE(D, F, E, K) with a shared seed,
    # cm = moepass.compile(block, moepass.Plan(form="ep", ep_size=W, a2a_chunks=cfg.chunks,
    # topology=moepass.Topology(1, W))); 2 warm-up steps, then median of 5 timed fwd+bwd steps after a
    # barrier; moepass.reset_comm_stats() before one step and comm_stats()["dispatch"] after it.
    raise NotImplementedError("measurement is wired once the EP runtime lands")


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


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pred = [r["predicted"]["step_s"] * 1e3 for r in rows]
    meas = [r["measured"]["step_s"] * 1e3 for r in rows]
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.loglog(pred, meas, "o")
    lo, hi = min(pred + meas) / 1.5, max(pred + meas) * 1.5
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="measured = predicted")
    ax.set_xlabel("predicted ms / step")
    ax.set_ylabel("measured ms / step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--predict-only", action="store_true", help="print predictions; no measurement")
    parser.add_argument("--profile", type=Path, default=PROFILE)
    args = parser.parse_args(argv)
    hw = this_machine(args.profile if args.profile.is_file() else None)
    rows = [{"config": asdict(c), "predicted": predict(c, hw)} for c in CONFIGS]
    if args.predict_only:
        for r in rows:
            print(r["config"], f"{r['predicted']['step_s'] * 1e3:.3f} ms", f"{r['predicted']['dispatch_bytes']:.0f} B")
        return 0
    try:
        for r, c in zip(rows, CONFIGS):
            r["measured"] = measure(c)
    except NotImplementedError as e:
        print(f"cost_fidelity: {e}", file=sys.stderr)
        return 2
    rho = spearman([r["predicted"]["step_s"] for r in rows], [r["measured"]["step_s"] for r in rows])
    out = {"hardware": hw.name, "calibrated": hw.calibrated, "spearman": rho, "configs": rows}
    (RESULTS / "cost_fidelity.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(rows, RESULTS / "cost_fidelity.png")
    print(f"Spearman(predicted, measured) = {rho:.3f} over {len(rows)} configurations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
