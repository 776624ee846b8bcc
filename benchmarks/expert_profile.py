"""Where the time of one MoE layer's training step goes: `torch.profiler` over moepass's single form.

    python benchmarks/expert_profile.py           # writes benchmarks/results/expert_profile.json

The layer of issue 12: a hand-written ModuleList MoE (`samples.models.LoopMoE`), 512 tokens, D=256,
SwiGLU F=512, E=8, K=2, fp32, 1 thread; loss = (y * probe).sum(), gradients set to None before every
step (as `optimizer.zero_grad()` does). Profiles `--steps` steps after a warm-up and reports each
op's self CPU time as a share of the total, the GEMM share (`aten::mm` under `aten::_grouped_mm` and
the router's), and the share of allocation and fill ops (`aten::empty*`, `aten::zeros*`, `aten::fill_`,
`aten::zero_`): the pattern issue 12 removed (a zero-filled full-size gradient per expert) showed as
60 % `fill_`/`zeros`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT = Path(__file__).resolve().parent / "results" / "expert_profile.json"
ALLOC_FILL = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
              "aten::zeros", "aten::zeros_like", "aten::new_zeros", "aten::fill_", "aten::zero_")
GEMM = ("aten::mm", "aten::bmm", "aten::addmm")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    import moepass
    from samples.models import LoopMoE

    torch.set_num_threads(1)
    torch.manual_seed(0)
    T, D, F, E, K = 512, 256, 512, 8, 2
    compiled = moepass.compile(LoopMoE(D, F, E, K), moepass.Plan(form="single", keep_original_if_slower=False))
    x = torch.randn(T, D, requires_grad=True)
    probe = torch.randn(T, D)

    def step() -> None:
        for param in compiled.parameters():
            param.grad = None
        x.grad = None
        (compiled(x) * probe).sum().backward()

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows)
    share = {e.key: e.self_cpu_time_total / total for e in rows}
    doc = {
        "layer": {"T": T, "D": D, "F": F, "E": E, "K": K, "dtype": "float32", "threads": 1, "steps": args.steps},
        "step_ms": total / args.steps / 1e3,
        "gemm_share": sum(share.get(k, 0.0) for k in GEMM),
        "alloc_fill_share": sum(share.get(k, 0.0) for k in ALLOC_FILL),
        "alloc_fill_ops": {k: share[k] for k in ALLOC_FILL if k in share},
        "top_ops": [{"op": e.key, "share": share[e.key], "ms_per_step": e.self_cpu_time_total / args.steps / 1e3,
                     "calls_per_step": e.count / args.steps} for e in rows[:15]],
        "load1": os.getloadavg()[0],
        "torch": torch.__version__,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"step {doc['step_ms']:.1f} ms (profiled) | GEMM {doc['gemm_share']:.1%} | allocation+fill "
          f"{doc['alloc_fill_share']:.1%} | load {doc['load1']:.2f}")
    for row in doc["top_ops"]:
        print(f"  {row['op']:<55} {row['share']:6.1%} {row['ms_per_step']:7.2f} ms {row['calls_per_step']:6.1f}x")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
