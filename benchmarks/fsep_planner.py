"""FSEP placement planner: solve time and load balance on Zipf-skewed counts.

    .venv/bin/python benchmarks/fsep_planner.py [--runs 12] [--threads 1]

Configurations: W=64 (E=64, C=2) and W=1024 (E=256, C=2 and C=4), 8 ranks per node, A100 figures,
Mixtral-8x7B expert shape (D=4096, F=14336). Counts: each rank routes T*K rows per step with expert
popularity Zipf(1.2) over a seeded permutation of the experts (multinomial, i.e. top-k with
replacement), summed over the planner's 5-step history; a fresh seed per run. For each run: the wall
time of `plan` (both candidates built, routed and priced), max/mean rows per device of the chosen
table under lite routing, and of plain EP (EP degree = the largest divisor of W dividing E) on the
same counts. Median and range over the runs.

"before": the first implementation priced each candidate from the dense [W, W*C] lite-routing matrix
(`lite_route_counts`, then `cost_model.fsep.rows_cost`); `plan` now prices from `route_totals`, which
never builds it. Both are timed here on the same tables, so the change is measured, not remembered.

Also the small case of tests/test_fsep_planner.py: W=2, E=8, top-2 of Zipf(1.2), C in {4, 5, 6}.

Threads: the planner runs on a background thread of a training process; `--threads 1` (default) is
the share it should take. On this 2-core machine torch's default 2 intra-op threads made small ops up
to 40x slower whenever the other core was busy (OpenMP barriers under contention), so the default
figures are single-threaded; the 1-minute load average is recorded with each configuration.
Writes benchmarks/results/fsep_planner.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import write_json  # noqa: E402
from cost_model import fsep as cf  # noqa: E402
from cost_model.presets import A100  # noqa: E402
from moepass.runtime.placement import (  # noqa: E402
    PlannerConfig,
    candidate_tables,
    device_rows,
    lite_route_counts,
    plan,
    table_cost,
)

RESULTS = REPO / "benchmarks" / "results"
CONFIGS = [  # (W, E, C, ranks per node, tokens per rank per step, top-k)
    (64, 64, 2, 8, 8192, 2),
    (1024, 256, 2, 8, 8192, 8),
    (1024, 256, 4, 8, 8192, 8),
]
ZIPF_S = 1.2
D, F = 4096, 14336


def zipf_counts(W: int, E: int, rows_per_rank: int, s: float, seed: int) -> torch.Tensor:
    """[W, E] int64: each rank's rows drawn from p_e ~ 1/rank^s (multinomial; ranks a seeded permutation)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, E + 1, dtype=np.float64) ** s
    p = p[rng.permutation(E)]
    return torch.from_numpy(rng.multinomial(rows_per_rank, p / p.sum(), size=W).astype(np.int64))


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_config(W: int, E: int, C: int, G: int, T: int, K: int, runs: int) -> dict:
    config = PlannerConfig.from_hardware(A100, E=E, W=W, C=C, ranks_per_node=G, D=D, F=F)
    load_before = os.getloadavg()[0]
    plan(zipf_counts(W, E, T * K * config.history, ZIPF_S, seed=10_000), config)  # warm-up (allocator, imports)
    solve, planner_mm, ep_mm, chosen, dense_price, totals_price = [], [], [], [], [], []
    for seed in range(runs):
        counts = zipf_counts(W, E, T * K * config.history, ZIPF_S, seed)
        start = time.perf_counter()
        decision = plan(counts, config)
        solve.append(time.perf_counter() - start)
        planner_mm.append(decision.max_over_mean)
        ep_mm.append(decision.ep_max_over_mean)
        chosen.append(decision.candidate)
        # before/after of the pricing step, on this run's candidate tables
        tables = candidate_tables(counts, config)
        start = time.perf_counter()
        dense_costs = {name: cf.rows_cost(device_rows(lite_route_counts(counts, t), C), G, config.bytes_per_token,
                                          config.time_per_token, config.intra_bw, config.inter_bw)
                       for name, t in tables.items()}
        dense_price.append(time.perf_counter() - start)
        start = time.perf_counter()
        fast_costs = {name: table_cost(counts, t, config)[0] for name, t in tables.items()}
        totals_price.append(time.perf_counter() - start)
        assert dense_costs == fast_costs, "the two pricing paths must agree exactly"
    result = {
        "W": W, "E": E, "C": C, "ranks_per_node": G, "tokens_per_rank": T, "top_k": K, "history": config.history,
        "runs": runs, "load_avg_1min_before": load_before,
        "solve_s": summary(solve),
        "solve_s_runs": solve,
        "pricing_both_candidates_s": {"before_dense_S": summary(dense_price), "after_route_totals": summary(totals_price)},
        "max_over_mean": {"ep": summary(ep_mm), "planner": summary(planner_mm)},
        "ep_size": max(d for d in range(1, W + 1) if W % d == 0 and E % d == 0),
        "chosen": {name: chosen.count(name) for name in ("even", "proportional")},
    }
    print(f"W={W:5d} E={E:3d} C={C}: solve median {result['solve_s']['median'] * 1e3:.1f} ms "
          f"[{result['solve_s']['min'] * 1e3:.1f}, {result['solve_s']['max'] * 1e3:.1f}] "
          f"(pricing both: dense S {statistics.median(dense_price) * 1e3:.1f} ms -> totals "
          f"{statistics.median(totals_price) * 1e3:.1f} ms); max/mean EP {statistics.median(ep_mm):.3f} "
          f"-> planner {statistics.median(planner_mm):.3f}; chosen {result['chosen']}; load {load_before:.1f}")
    return result


def small_case() -> list[dict]:
    """W=2, E=8, top-2 of Zipf(1.2) (4096 tokens per rank, one node): the test's case, C in {4, 5, 6}."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_fsep_planner import a100_config, zipf_topk_counts

    counts = zipf_topk_counts(2, 8, 4096, 2, 1.2, seed=0)
    out = []
    for C in (4, 5, 6):
        decision = plan(counts, a100_config(8, 2, C, ranks_per_node=2))
        out.append({"C": C, "ep_max_over_mean": decision.ep_max_over_mean,
                    "planner_max_over_mean": decision.max_over_mean, "candidate": decision.candidate})
        print(f"W=2 E=8 K=2 C={C}: max/mean EP {decision.ep_max_over_mean:.4f} -> planner "
              f"{decision.max_over_mean:.4f} ({decision.candidate})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, see docstring)")
    parser.add_argument("--out", type=Path, default=RESULTS / "fsep_planner.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {
        "what": "moepass.runtime.placement.plan on Zipf(1.2) counts summed over a 5-step history",
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "hardware_figures": "cost_model.presets.A100; expert D=4096 F=14336 (gated)",
        "zipf_s": ZIPF_S,
        "configs": [run_config(*cfg, runs=args.runs) for cfg in CONFIGS],
        "small_case_w2": small_case(),
    }
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
