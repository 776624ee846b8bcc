"""Detection and compile time of a large sample: 32 MoE layers × 64 experts, D=256.

    python benchmarks/compile_time.py [--layers 32 --experts 64 --dim 256 --style loop --threads 1]

Also measured at a quarter and half of the layers (linear in layers: identical blocks are checked once),
and `compile(inplace=True)`, which skips the deep copy of the model that `compile` makes by default.
Writes benchmarks/results/compile_time.json (figures in seconds, plus the machine and its load average:
on a shared machine the figures vary with the load, and more threads than free cores slow torch down).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from pathlib import Path

import torch

import moepass
from samples.models import SampleConfig, TinyMoELM

OUT = Path(__file__).parent / "results" / "compile_time.json"


def measure(layers: int, experts: int, dim: int, style: str, repeats: int) -> dict:
    torch.manual_seed(0)
    cfg = SampleConfig(dim=dim, ffn_dim=2 * dim, num_experts=experts, top_k=2, layers=layers, style=style, heads=4)
    model = TinyMoELM(cfg)
    detect_s, compile_s, inplace_s = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        report = moepass.detect(model)
        detect_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiled = moepass.compile(model, moepass.Plan(form="single"), report=report)
        compile_s.append(time.perf_counter() - start)
        fresh = copy.deepcopy(model)
        start = time.perf_counter()
        moepass.compile(fresh, moepass.Plan(form="single"), report=report, inplace=True)
        inplace_s.append(time.perf_counter() - start)
    assert len(report.blocks) == layers, report.summary()
    per_block_hypotheses = sum(len(d.tried) for d in report.details) / layers
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens), model(tokens), rtol=1e-4, atol=1e-5)
    return {
        "config": {"layers": layers, "experts": experts, "dim": dim, "ffn_dim": 2 * dim, "top_k": 2, "style": style},
        "parameters": sum(p.numel() for p in model.parameters()),
        "detect_seconds": min(detect_s),
        "compile_seconds_given_report": min(compile_s),
        "compile_inplace_seconds_given_report": min(inplace_s),
        "total_seconds": min(detect_s) + min(compile_s),
        "total_inplace_seconds": min(detect_s) + min(inplace_s),
        "detect_ms_per_block": 1e3 * min(detect_s) / layers,
        "hypotheses_checked_per_block": per_block_hypotheses,
        "repeats": repeats,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--style", default="loop", choices=["loop", "fused", "gshard", "mixed"])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the figures do not depend on idle cores)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    styles = [args.style] if args.style != "mixed" else ["loop", "fused", "gshard"]
    layer_counts = sorted({max(1, args.layers // 4), max(1, args.layers // 2), args.layers})
    machine = {"cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
               "processor": platform.machine(), "threads": args.threads, "load_average": os.getloadavg()}
    runs = [measure(layers, args.experts, args.dim, style, args.repeats) for style in styles for layers in layer_counts]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": machine, "runs": runs}, indent=2) + "\n")
    for run in runs:
        c = run["config"]
        print(f"{c['style']:>7}: {c['layers']} layers x {c['experts']} experts, D={c['dim']}: "
              f"detect {run['detect_seconds']:.2f} s ({run['detect_ms_per_block']:.0f} ms/block, "
              f"{run['hypotheses_checked_per_block']:.2f} hypotheses/block), compile {run['compile_seconds_given_report']:.2f} s "
              f"({run['compile_inplace_seconds_given_report']:.2f} s inplace): total {run['total_seconds']:.2f} s "
              f"({run['total_inplace_seconds']:.2f} s inplace)")
    print(f"load average {machine['load_average']}, {args.threads} torch thread(s)")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
