"""Soak: thousands of training steps at W=2 for EP and FSEP, with the process's memory sampled.

    python benchmarks/soak.py                       # 2,000 steps per form, W=2, gloo (CPU)
    python benchmarks/soak.py --steps 200 --out /tmp/soak.json      # a short run
    python benchmarks/soak.py --backend nccl        # on GPUs: torch's allocated memory is sampled too

What runs: the demo LM (`samples.models.tiny_mixtral`, fused style: D=32, F=64, E=8, K=2, 2 layers,
vocab 64), batch 4 x seq 32 per rank, AdamW, `moepass.GradientSync` for the replicated gradients,
compiled with `Plan(form="ep")` and with `Plan(form="fsep", slots_per_device=5, planner="auto")`.
Each form runs in its own fresh pool of W spawned ranks (`moepass.runtime.workers.Pool`), so one
form's memory does not count against the other.

Routing is skewed and drifts, so FSEP's load-adaptive planner keeps changing the placement: each
rank's tokens are drawn from Zipf(1.2) over the vocabulary with a seeded permutation that changes
every `--phase` steps (a new set of frequent tokens, hence of busy experts). The number of steps
whose table differed from the previous step's is counted per block.

Sampled every `--every` steps on every rank: RSS (/proc/self/statm; `resource` peak where there is
no /proc) and, on CUDA, `torch.cuda.memory_allocated`. Growth after warm-up (the first 10 % of
the steps): the median of the last 5 samples over the median of the first 5 after warm-up, minus
one, per rank; the goal is <= 1 %. Also: the largest sample after warm-up over that baseline, the
least-squares slope after warm-up (bytes per step: a steady leak, unlike a one-off step, keeps one),
the step time, the length of every FSEP block's decision log, and with `--trace` the Python
allocations that grew most after warm-up (tracemalloc, by line; slows the steps ~2x). Writes
benchmarks/results/soak.json (unless --out).
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
OUT = BENCH / "results" / "soak.json"
CFG = dict(vocab_size=64, dim=32, ffn_dim=64, num_experts=8, top_k=2, layers=2, heads=4, style="fused")
BATCH, SEQ = 4, 32
ZIPF_S = 1.2
GOAL = 0.01


def rss_bytes() -> int:
    """This process's resident set size now (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def growth(steps: list[int], samples: list[int], warmup_index: int) -> dict[str, float]:
    """After warm-up: median(last 5) / median(first 5) - 1, max / that baseline - 1, and the least-squares
    slope in bytes per step (a steady leak shows as a slope; a one-off step as growth without one)."""
    xs, after = steps[warmup_index:], samples[warmup_index:]
    if len(after) < 2:
        return {"growth": float("nan"), "max_over_baseline": float("nan"), "baseline": float("nan"),
                "slope_bytes_per_step": float("nan")}
    n = min(5, len(after) // 2)
    base = statistics.median(after[:n])
    slope = statistics.linear_regression(xs, after).slope
    if base == 0:
        return {"growth": 0.0, "max_over_baseline": 0.0, "baseline": 0, "slope_bytes_per_step": slope}
    return {"growth": statistics.median(after[-n:]) / base - 1, "max_over_baseline": max(after) / base - 1,
            "baseline": base, "slope_bytes_per_step": slope}


def skewed_tokens(step: int, rank: int, phase: int, vocab: int, device: str):
    """[BATCH, SEQ+1] tokens from Zipf(ZIPF_S) over a permutation of the vocabulary that changes every `phase` steps."""
    import torch

    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(7_000 + step // phase))
    p = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** ZIPF_S
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    draws = torch.multinomial(p, BATCH * (SEQ + 1), replacement=True, generator=g)
    return perm[draws].reshape(BATCH, SEQ + 1).to(device)


def case_soak(rank: int, world: int, form: str, steps: int, every: int, phase: int, trace: bool = False) -> dict:
    """One rank's soak: `steps` training steps of `form`; memory sampled every `every` steps. `trace`:
    tracemalloc from the end of warm-up; the Python allocations that grew most until the end, by line."""
    import gc
    import tracemalloc

    import torch

    import moepass
    from samples.models import tiny_mixtral

    device = f"cuda:{torch.cuda.current_device()}" if torch.distributed.get_backend() == "nccl" else "cpu"
    cuda = device != "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = tiny_mixtral(**CFG)
    extra = dict(slots_per_device=5, planner="auto") if form == "fsep" else {}
    cm = moepass.compile(model, moepass.Plan(form=form, topology=moepass.Topology(1, world), **extra))
    sync = moepass.GradientSync(cm)  # replicated gradients averaged at the end of each backward
    opt = torch.optim.AdamW(cm.parameters(), lr=1e-3)
    controllers = [m for m in cm.modules() if hasattr(m, "decisions") and hasattr(m, "slot_expert")]
    samples: list[dict] = []
    losses: list[float] = []
    heap: list[dict] = []
    snapshot = None
    start = time.perf_counter()
    for step in range(steps):
        if trace and step == steps // 10:
            tracemalloc.start(8)
        if trace and step == steps // 10 + every:  # after the first steps traced (one-off allocations)
            snapshot = tracemalloc.take_snapshot()
        tokens = skewed_tokens(step, rank, phase, CFG["vocab_size"], device)
        opt.zero_grad(set_to_none=True)
        loss = cm.loss(tokens)
        loss.backward()
        opt.step()
        if step % every == 0 or step == steps - 1:
            losses.append(loss.detach().item())
            gc.collect()
            samples.append({"step": step, "rss": rss_bytes(), "t": time.perf_counter() - start,
                            "allocated": torch.cuda.memory_allocated() if cuda else None})
            if rank == 0 and step % (every * 10) == 0:
                print(f"[soak {form}] step {step}/{steps} rss {samples[-1]['rss'] / 2**20:.1f} MiB "
                      f"loss {losses[-1]:.3f} {samples[-1]['t']:.0f} s", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - start
    sync.close()
    if snapshot is not None:
        for stat in tracemalloc.take_snapshot().compare_to(snapshot, "traceback")[:8]:
            frames = [f"{f.filename}:{f.lineno}" for f in stat.traceback if "/moepass/" in f.filename or
                      "/lowering/" in f.filename] or [f"{f.filename}:{f.lineno}" for f in stat.traceback][-2:]
            heap.append({"bytes": stat.size_diff, "blocks": stat.count_diff, "where": frames[-3:]})
        tracemalloc.stop()
    tables = []
    for c in controllers:
        tables.append({"block": c.block, "decisions_installed": c.installed, "decisions_kept": len(c.decisions),
                       "table_changes": c.table_changes,
                       "final_table": list(c.decisions[-1].table)})
    warm = next(i for i, s in enumerate(samples) if s["step"] >= steps // 10)
    at = [s["step"] for s in samples]
    out = {"rank": rank, "steps": steps, "step_s": elapsed / steps, "samples": samples, "losses": losses,
           "rss": growth(at, [s["rss"] for s in samples], warm), "warmup_steps": samples[warm]["step"],
           "fsep_blocks": tables, "python_heap_growth": heap}
    if cuda:
        out["allocated"] = growth(at, [s["allocated"] for s in samples], warm)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=20, help="sample memory every N steps")
    parser.add_argument("--phase", type=int, default=100, help="steps between changes of the frequent tokens")
    parser.add_argument("--forms", nargs="+", default=["ep", "fsep"], choices=["ep", "fsep"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--trace", action="store_true", help="tracemalloc after warm-up: where Python memory grew")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    sys.path[:0] = [str(REPO), str(BENCH)]
    import torch

    from benchmarks.common import write_json
    from moepass.runtime.workers import Pool

    case = importlib.import_module("soak").case_soak  # by module name: the ranks import it as soak.case_soak
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    results = {"what": __doc__.split("\n\n")[0], "config": {**CFG, "batch": BATCH, "seq": SEQ, "zipf_s": ZIPF_S,
                                                           "steps": args.steps, "every": args.every,
                                                           "phase": args.phase, "world": args.world,
                                                           "backend": args.backend},
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                           "load_avg_1min_before": os.getloadavg()[0]},
               "goal_growth": GOAL, "forms": {}}
    for form in args.forms:
        pool = Pool(args.world, backend=args.backend, env=env, paths=(str(REPO), str(BENCH)), threads=1,
                    pg_timeout=300.0)
        try:
            ranks = pool.run(case, form, args.steps, args.every, args.phase, args.trace, timeout=48 * 3600.0)
        finally:
            pool.close()
        worst = max(r["rss"]["growth"] for r in ranks)
        results["forms"][form] = {"ranks": ranks, "rss_growth_worst_rank": worst, "meets_goal": worst <= GOAL,
                                  "load_avg_1min_after": os.getloadavg()[0]}
        line = (f"{form}: {args.steps} steps, {1e3 * statistics.median(r['step_s'] for r in ranks):.1f} ms/step; "
                f"RSS growth after warm-up per rank " + ", ".join(f"{100 * r['rss']['growth']:+.2f} %" for r in ranks)
                + " (max over baseline " + ", ".join(f"{100 * r['rss']['max_over_baseline']:+.2f} %" for r in ranks)
                + "); slope " + ", ".join(f"{r['rss']['slope_bytes_per_step'] / 1024:.2f}" for r in ranks)
                + " KiB/step")
        if "allocated" in ranks[0]:
            line += "; allocated " + ", ".join(f"{100 * r['allocated']['growth']:+.2f} %" for r in ranks)
        for b in ranks[0]["fsep_blocks"]:
            line += f"; {b['block']}: {b['table_changes']} table changes, {b['decisions_logged']} decisions logged"
        print(line, flush=True)
        for h in ranks[0]["python_heap_growth"][:4]:
            print(f"    python heap +{h['bytes'] / 1024:.1f} KiB in {h['blocks']} blocks at {h['where']}", flush=True)
    results["machine"]["load_avg_1min_after"] = os.getloadavg()[0]
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
