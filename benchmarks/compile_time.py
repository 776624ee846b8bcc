"""Detection and compile time of a large sample: 32 MoE layers × 64 experts, D=256.

    python benchmarks/compile_time.py [--layers 32 --experts 64 --dim 256 --style loop]

Writes benchmarks/results/compile_time.json (figures in seconds, plus the machine).
"""

from __future__ import annotations

import argparse
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
    detect_s, compile_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        report = moepass.detect(model)
        detect_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiled = moepass.compile(model, moepass.Plan(form="single"), report=report)
        compile_s.append(time.perf_counter() - start)
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
        "total_seconds": min(detect_s) + min(compile_s),
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
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    results = {
        "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "processor": platform.machine()},
        "runs": [measure(args.layers, args.experts, args.dim, style, args.repeats)
                 for style in ([args.style] if args.style != "mixed" else ["loop", "fused", "gshard"])],
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    for run in results["runs"]:
        c = run["config"]
        print(f"{c['style']:>7}: {c['layers']} layers x {c['experts']} experts, D={c['dim']}: "
              f"detect {run['detect_seconds']:.2f} s ({run['detect_ms_per_block']:.0f} ms/block, "
              f"{run['hypotheses_checked_per_block']:.1f} hypotheses/block), compile {run['compile_seconds_given_report']:.2f} s")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
