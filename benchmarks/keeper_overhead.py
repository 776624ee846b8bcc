"""What running the user's own block through a compiled block costs on the host (issue 29, item 8).

Where `Plan(form="single")`'s keeper chose the user's block (`moepass.runtime.faster`), a step runs the same
kernels as the untouched block; anything on top is the path to it. On an H200 that path measured +0.05 to
+0.10 ms of host time per forward+backward (session 5, `never_slower.py`), against ~2-3 us per call on this
CPU: this benchmark takes it apart, on any device.

    python benchmarks/keeper_overhead.py                      # CPU, the sample blocks at tiny size (host-bound)
    python benchmarks/keeper_overhead.py --device cuda --sizes tiny,layer   # the GPU machine (gpu_check.sh: keeper)

(On this CPU the fused and gshard samples' own blocks take ~2 s a step at layer size: there the keeper keeps
the graph, and `--sizes layer` times nothing of interest.)

For each sample block (`loop`, `fused`, `gshard`) and size, five ways of running one forward+backward, timed in
interleaved rounds (the order rotating), host seconds per step (on CUDA the device drained before each step and
not waited for after it: the enqueue time, as `never_slower.py`'s `host_ms`):

    original      the user's untouched block
    compiled      `moepass.compile(block, Plan(form="single"))` with the keeper's choice forced to the user's
                  block (so the kept path runs whatever the timing would say): what a user's step runs
    kept_call     the user's block object inside the compiled copy, called as a module (`keeper.block(x)`):
                  the deep copy's parameters, no keeper, no GraphModule
    kept_forward  `keeper.block.forward(x)`: what the keeper calls (no module `__call__`)
    graph         the rewritten graph (`keep_original_if_slower=False`): for scale

Each row: the median host ms per step and range over rounds, and each way minus `original` in us (the median of
per-round differences). `--profile` adds, for `original` and `compiled`, the dispatcher ops per step
(torch.profiler) and the 12 functions with the most own time (cProfile), so an extra op or a Python function on
the kept path shows by name. JSON to --out (default benchmarks/results/keeper_overhead_<device>.json).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import moepass  # noqa: E402
from benchmarks.never_slower import SIZES, host_seconds, step  # noqa: E402
from moepass.runtime import faster  # noqa: E402
from samples.models import SampleConfig, make_moe  # noqa: E402

WAYS = ("original", "compiled", "kept_call", "kept_forward", "graph")


class Forward(nn.Module):
    """A module whose call is `fn(x)`: `keeper.block.forward` timed through the same `step`."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def kept(block: nn.Module, x: torch.Tensor, probe: torch.Tensor) -> nn.Module:
    """`block` compiled under form="single" with its keeper's choice forced to the user's block for the input
    signature of the timed steps."""
    real_measure = faster.measure
    faster.measure = lambda *a, **k: faster.Choice(original=True, ratio=float("nan"), ratios=(), steps=0)
    os.environ.pop("MOEPASS_ALWAYS_REWRITE", None)
    try:
        compiled = moepass.compile(copy.deepcopy(block), moepass.Plan(form="single"))
        step(compiled, x, probe)  # the first call of this signature decides (here: forced)
    finally:
        faster.measure = real_measure
    assert [c.original for c in faster.choices(compiled).values()] == [True], faster.choices(compiled)
    return compiled


def op_counts(fn, steps: int, device: torch.device) -> dict[str, float]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    names = Counter(e.name for e in prof.events())
    return {name: n / steps for name, n in names.most_common(25)}


def top_functions(fn, steps: int) -> list[dict]:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, function), (_, calls, own, total, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{'/'.join(Path(filename).parts[-2:])}:{line}:{function}", "calls": calls / steps,
                     "own_us": own / steps * 1e6, "total_us": total / steps * 1e6})
    return sorted(rows, key=lambda r: -r["own_us"])[:12]


def measure(style: str, size_name: str, device: torch.device, rounds: int, iters: int, profile: bool) -> dict:
    size = SIZES[size_name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        original = make_moe(style, SampleConfig(dim=size.D, ffn_dim=size.F, num_experts=size.E,
                                                top_k=size.K)).to(device)
        x = torch.randn(size.seqs, size.tokens // size.seqs, size.D, generator=torch.Generator().manual_seed(1))
        x = x.to(device).requires_grad_(True)
        probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(device)
        compiled = kept(original, x, probe)
        keeper = compiled.__dict__[faster.KEEPER]
        graph = moepass.compile(copy.deepcopy(original), moepass.Plan(form="single", keep_original_if_slower=False))
    blocks = {"original": original, "compiled": compiled, "kept_call": keeper.block,
              "kept_forward": Forward(keeper.block.forward), "graph": graph}
    for block in blocks.values():  # warm-up: kernels, caches, first-touch pages
        for _ in range(3):
            step(block, x, probe)
    per_round: list[dict[str, float]] = []
    for r in range(rounds):
        order = WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]
        per_round.append({way: host_seconds(blocks[way], x, probe, iters, device) for way in order})
    row: dict = {"case": f"{size_name} sample {style}", "device": device.type,
                 "host_ms": {way: statistics.median(r[way] for r in per_round) * 1e3 for way in WAYS},
                 "host_ms_range": {way: [min(r[way] for r in per_round) * 1e3, max(r[way] for r in per_round) * 1e3]
                                   for way in WAYS},
                 "over_original_us": {way: statistics.median((r[way] - r["original"]) * 1e6 for r in per_round)
                                      for way in WAYS if way != "original"}}
    if profile:
        row["ops_per_step"] = {way: op_counts(lambda b=blocks[way]: step(b, x, probe), 5, device)
                               for way in ("original", "compiled")}
        row["top_functions"] = {way: top_functions(lambda b=blocks[way]: step(b, x, probe), 20)
                                for way in ("original", "compiled")}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--styles", default="loop,fused,gshard")
    parser.add_argument("--sizes", default="tiny")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=None, help="steps per way and round (default: tiny 50, layer 10)")
    parser.add_argument("--profile", action="store_true", help="ops per step and the top functions (cProfile)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    rows = []
    for size_name in args.sizes.split(","):
        for style in args.styles.split(","):
            row = measure(style, size_name, device, args.rounds, args.iters or SIZES[size_name].iters, args.profile)
            rows.append(row)
            over = "  ".join(f"{way} {us:+.1f}" for way, us in row["over_original_us"].items())
            print(f"{row['case']:22s} original {row['host_ms']['original']:.3f} ms/step; us over it: {over}",
                  flush=True)
    out = args.out or ROOT / "benchmarks" / "results" / f"keeper_overhead_{device.type}.json"
    meta = {"argv": sys.argv[1:], "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "load": os.getloadavg()[0], "threads": torch.get_num_threads()}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
