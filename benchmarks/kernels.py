"""Grouped-GEMM expert FFN kernels: analytic FLOPs/bytes per kernel and, on a GPU, measured time vs roofline.

    python benchmarks/kernels.py                 # writes benchmarks/results/kernels.json
    python benchmarks/kernels.py --tokens 8192   # another micro-batch size
    TRITON_INTERPRET=1 python benchmarks/kernels.py --smoke   # run the timing path on tiny CPU shapes

Shapes: T tokens, K experts per token, N = T*K routed rows, D model width, F expert hidden width,
E experts. Proxy layers (SwiGLU, no biases, bf16, uniform routing: N/E rows per expert):
Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3 (routed experts only).

Bytes are compulsory traffic: every operand read once and every result written once (what a kernel
with perfect cache reuse moves); the roofline time is max(FLOPs / peak FLOP/s, bytes / peak B/s).
On a GPU each kernel is timed with `triton.testing.do_bench` (autotuned first) and reported as
achieved TFLOP/s, GB/s and fraction of the roofline. Without a GPU the timing is skipped, with the
reason, and only the analytic figures are written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULT = ROOT / "benchmarks" / "results" / "kernels.json"


@dataclass(frozen=True)
class Shape:
    name: str
    D: int
    F: int
    E: int
    K: int


SHAPES = (
    Shape("mixtral-8x7b", D=4096, F=14336, E=8, K=2),
    Shape("qwen3-30b-a3b", D=2048, F=768, E=128, K=8),
    Shape("deepseek-v3", D=7168, F=2048, E=256, K=8),
)
# Dense bf16 tensor-core peak and HBM bandwidth (vendor data sheets, SXM parts).
HARDWARE = {
    "A100-SXM4-80GB": {"bf16_tflops": 312.0, "hbm_tbps": 2.039},
    "H100-SXM5-80GB": {"bf16_tflops": 989.0, "hbm_tbps": 3.35},
}


def kernel_costs(D: int, F: int, E: int, N: int, gated: bool = True, elem: int = 2) -> list[dict]:
    """FLOPs and compulsory bytes of each kernel launch of one expert-FFN forward and backward.

    Mirrors lowering/grouped_gemm/ (host.py): forward = gate_up_kernel + rows_kernel (down); backward =
    gate_up_kernel.backward (recomputes gate/up, grad_a, activation backward) + rows_kernel (dX) +
    wgrad_kernel for w_gate, w_up (if gated) and w_down.
    """
    P = 2 if gated else 1  # gate (and up) projections
    x, a, w = N * D, N * F, E * F * D  # elements of an activation row block, the hidden, one weight
    rows = [
        ("forward", "gate_up_kernel", 2 * N * D * F * P, x + P * w + a),
        ("forward", "rows_kernel (down)", 2 * N * F * D, a + w + x),
        ("backward", "gate_up_kernel.backward", 2 * N * D * F * (P + 1), 2 * x + (P + 1) * w + (1 + P) * a),
        ("backward", "rows_kernel (grad_x)", 2 * N * F * D * P, P * a + P * w + x),
        ("backward", "wgrad_kernel (w_gate)", 2 * N * F * D, a + x + w),
        *([("backward", "wgrad_kernel (w_up)", 2 * N * F * D, a + x + w)] if gated else []),
        ("backward", "wgrad_kernel (w_down)", 2 * N * D * F, x + a + w),
    ]
    return [{"pass": p, "kernel": k, "flops": f, "bytes": b * elem} for p, k, f, b in rows]


def roofline(flops: int, nbytes: int) -> dict:
    out = {}
    for hw, peak in HARDWARE.items():
        t_compute = flops / (peak["bf16_tflops"] * 1e12)
        t_memory = nbytes / (peak["hbm_tbps"] * 1e12)
        out[hw] = {"us": 1e6 * max(t_compute, t_memory), "bound": "compute" if t_compute >= t_memory else "memory"}
    return out


def analytic(shape: Shape, tokens: int) -> dict:
    N = tokens * shape.K
    kernels = kernel_costs(shape.D, shape.F, shape.E, N)
    for k in kernels:
        k["intensity_flop_per_byte"] = round(k["flops"] / k["bytes"], 1)
        k["roofline"] = roofline(k["flops"], k["bytes"])
    totals = {}
    for p in ("forward", "backward"):
        flops = sum(k["flops"] for k in kernels if k["pass"] == p)
        nbytes = sum(k["bytes"] for k in kernels if k["pass"] == p)
        totals[p] = {"flops": flops, "bytes": nbytes, "roofline": roofline(flops, nbytes)}
    return {**asdict(shape), "T": tokens, "N": N, "rows_per_expert": N // shape.E, "kernels": kernels,
            "totals": totals}


def timing_blocker() -> str | None:
    import torch

    from lowering import codegen

    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False): timing needs a GPU"
    if codegen.is_interpreted():
        return "TRITON_INTERPRET=1: interpreted kernels are not timed"
    return None


def launches(shape: Shape, tokens: int, device: str, dtype):
    """{kernel name: zero-argument callable launching it} on uniform-routing tensors of `shape`."""
    import torch

    from lowering import grouped_gemm as gg

    D, F, E, N = shape.D, shape.F, shape.E, tokens * shape.K
    t = dict(device=device, dtype=dtype)
    x_ND, grad_y_ND = torch.randn(N, D, **t), torch.randn(N, D, **t)
    counts_E = torch.full((E,), N // E, device=device, dtype=torch.int64)
    counts_E[: N - int(counts_E.sum())] += 1
    w_gate_EFD, w_up_EFD = torch.randn(E, F, D, **t) / D**0.5, torch.randn(E, F, D, **t) / D**0.5
    w_down_EDF = torch.randn(E, D, F, **t) / F**0.5
    args = (x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, None, None, None, "swiglu", 7.0, 1.702)
    spec = gg.spec_of(*args)
    a_NF, grad_gate_NF, grad_up_NF = gg.gate_up_launch(spec, x_ND, grad_y_ND, counts_E, w_gate_EFD, w_up_EFD,
                                                        w_down_EDF, None, None, 7.0, 1.702)
    y_ND = torch.empty_like(x_ND)
    return {
        "gate_up_kernel": lambda: gg.gate_up_launch(spec, x_ND, None, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF,
                                                     None, None, 7.0, 1.702),
        "rows_kernel (down)": lambda: gg.rows_launch(spec, y_ND, a_NF, w_down_EDF, None, None, None, counts_E,
                                                      transpose_b=True),
        "gate_up_kernel.backward": lambda: gg.gate_up_launch(spec, x_ND, grad_y_ND, counts_E, w_gate_EFD,
                                                              w_up_EFD, w_down_EDF, None, None, 7.0, 1.702),
        "rows_kernel (grad_x)": lambda: gg.rows_launch(spec, y_ND, grad_gate_NF, w_gate_EFD, grad_up_NF, w_up_EFD,
                                                        None, counts_E, transpose_b=False),
        "wgrad_kernel (w_gate)": lambda: gg.wgrad_launch(spec, grad_gate_NF, x_ND, counts_E, False),
        "wgrad_kernel (w_up)": lambda: gg.wgrad_launch(spec, grad_up_NF, x_ND, counts_E, False),
        "wgrad_kernel (w_down)": lambda: gg.wgrad_launch(spec, grad_y_ND, a_NF, counts_E, False),
    }


def measure(entry: dict, fns: dict, bench) -> None:
    """Add measured ms, TFLOP/s, GB/s and roofline fraction to each kernel of `entry`."""
    for k in entry["kernels"]:
        fn = fns[k["kernel"]]
        fn()  # autotune outside the timed region
        ms = bench(fn)
        seconds = ms * 1e-3
        k["measured"] = {
            "ms": ms,
            "tflops": k["flops"] / seconds / 1e12,
            "gbps": k["bytes"] / seconds / 1e9,
            "roofline_fraction": {hw: r["us"] * 1e-6 / seconds for hw, r in k["roofline"].items()},
        }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens T per micro-batch (default 4096)")
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--smoke", action="store_true", help="run the timing path on tiny shapes (CPU, interpreted)")
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke()

    result = {
        "generated_by": "benchmarks/kernels.py",
        "dtype": "bfloat16",
        "activation": "swiglu",
        "routing": "uniform (N/E rows per expert)",
        "bytes": "compulsory traffic: each operand read once, each result written once",
        "hardware": HARDWARE,
        "shapes": [analytic(s, args.tokens) for s in SHAPES],
    }
    blocker = timing_blocker()
    result["timing"] = {"ran": blocker is None, "reason": blocker}
    if blocker is None:
        import torch
        import triton.testing

        result["timing"]["device"] = torch.cuda.get_device_name()
        for shape, entry in zip(SHAPES, result["shapes"]):
            measure(entry, launches(shape, args.tokens, "cuda", torch.bfloat16), lambda fn: triton.testing.do_bench(fn))
    else:
        print(f"skipping kernel timing: {blocker}. Writing analytic FLOPs/bytes only.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for entry in result["shapes"]:
        fwd, bwd = entry["totals"]["forward"], entry["totals"]["backward"]
        h100 = "H100-SXM5-80GB"
        print(f"{entry['name']:>14}: N={entry['N']:>6}  forward {fwd['flops'] / 1e12:7.2f} TFLOP "
              f"{fwd['bytes'] / 1e9:6.2f} GB (H100 roofline {fwd['roofline'][h100]['us']:8.1f} us)  backward "
              f"{bwd['flops'] / 1e12:7.2f} TFLOP {bwd['bytes'] / 1e9:6.2f} GB "
              f"({bwd['roofline'][h100]['us']:8.1f} us)")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return result


def smoke() -> dict:
    """The GPU timing path on tiny shapes with a CPU timer (needs TRITON_INTERPRET=1); writes nothing."""
    import torch

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--smoke runs interpreted kernels on CPU: set TRITON_INTERPRET=1")
    shape, tokens = Shape("tiny", D=32, F=48, E=4, K=2), 16

    def cpu_bench(fn):
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)

    entry = analytic(shape, tokens)
    measure(entry, launches(shape, tokens, "cpu", torch.bfloat16), cpu_bench)
    for k in entry["kernels"]:
        print(f"{k['kernel']:>26}: {k['measured']['ms']:8.1f} ms interpreted ({k['flops']} FLOP, {k['bytes']} B)")
    return entry


if __name__ == "__main__":
    main()
