"""Host cost of a Triton launch: `kernel[grid](...)` against `lowering.launcher.launcher(kernel)[grid](...)` (issue 29,
item 8: the Triton path's host overhead). Needs a GPU (compiled kernels; interpreted, both are Triton's path).

    PYTHONPATH=. python3 benchmarks/launch_overhead.py [--rounds 5] [--launches 2000] [--out F.json]

Cases, each timed both ways in alternating rounds in one process (plain first on even rounds):
  jit        a one-block vector add (4096 fp32), a plain `triton.jit` kernel
  autotuned  the same kernel under `triton.autotune` (two configs, keyed on N)
  expert_ffn moepass's grouped-GEMM expert FFN forward (`lowering.grouped_gemm.host.expert_ffn_forward`: argument
             checks + two autotuned kernel launches) at the layer case (512 tokens x K=2 rows, D=256, F=512, E=8,
             SwiGLU, fp32); its "plain" side is the same call with MOEPASS_PLAIN_TRITON_LAUNCH=1 (the launchers
             rebuilt in each mode by `launcher.cache_clear()`).
Per case and side: host microseconds per launch (wall time of `--launches` launches, then one synchronize; the
kernels are a few microseconds of device time, so the enqueue rate is what is timed; median over rounds, range),
the device time per launch (CUDA events around the same loop), Python calls per launch (cProfile over 200),
and that both sides' outputs are bit-identical. Writes JSON to --out (default: print only).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowering.launcher import launcher  # noqa: E402


@triton.jit
def add_one_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < N
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=ok) + 1.0, mask=ok)


add_one_tuned = triton.autotune(configs=[triton.Config({"BLOCK": 1024}, num_warps=4),
                                         triton.Config({"BLOCK": 4096}, num_warps=8)],
                                key=["N"])(triton.jit(add_one_kernel.fn))


def python_calls(call: Callable[[], object], n: int = 200) -> float:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        call()
    profiler.disable()
    return pstats.Stats(profiler).total_calls / n  # type: ignore[attr-defined]


def timed(call: Callable[[], object], launches: int) -> tuple[float, float]:
    """(host us, device us) per call."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(launches):
        call()
    end.record()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / launches * 1e6, start.elapsed_time(end) / launches * 1e3


def set_mode(plain: bool) -> None:
    os.environ["MOEPASS_PLAIN_TRITON_LAUNCH"] = "1" if plain else "0"
    launcher.cache_clear()


def cases() -> dict[str, Callable[[bool], Callable[[], torch.Tensor]]]:
    x = torch.randn(4096, device="cuda")
    out = torch.empty_like(x)

    def jit(plain: bool):
        grid = (triton.cdiv(4096, 1024),)
        run = add_one_kernel if plain else launcher(add_one_kernel)

        def call():
            run[grid](x, out, 4096, BLOCK=1024)
            return out
        return call

    def tuned(plain: bool):
        grid = lambda meta: (triton.cdiv(4096, meta["BLOCK"]),)  # noqa: E731
        run = add_one_tuned if plain else launcher(add_one_tuned)

        def call():
            run[grid](x, out, 4096)
            return out
        return call

    from lowering.grouped_gemm.host import expert_ffn_forward

    g = torch.Generator(device="cuda").manual_seed(0)
    T, K, D, F, E = 512, 2, 256, 512, 8
    x_ND = torch.randn(T * K, D, device="cuda", generator=g)
    counts_E = torch.full((E,), T * K // E, dtype=torch.int32, device="cuda")
    w_gate, w_up = (torch.randn(E, F, D, device="cuda", generator=g) * 0.05 for _ in range(2))
    w_down = torch.randn(E, D, F, device="cuda", generator=g) * 0.05

    def ffn(plain: bool):
        set_mode(plain)
        return lambda: expert_ffn_forward(x_ND, counts_E, w_gate, w_up, w_down, None, None, None, "swiglu", 0.0, 1.0)

    return {"jit": jit, "autotuned": tuned, "expert_ffn": ffn}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--launches", type=int, default=2000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_overhead: needs a CUDA device (interpreted kernels always take Triton's path)")
        return 2
    results = {}
    for name, make in cases().items():
        samples: dict[str, dict[str, list[float]]] = {side: {"host_us": [], "device_us": []} for side in ("plain", "direct")}
        outputs = {}
        calls = {}
        for r in range(args.rounds):
            for side in (("plain", "direct") if r % 2 == 0 else ("direct", "plain")):
                call = make(side == "plain")
                for _ in range(20):
                    outputs[side] = call().clone()
                host, device = timed(call, args.launches)
                samples[side]["host_us"].append(host)
                samples[side]["device_us"].append(device)
                if r == 0:
                    calls[side] = python_calls(call)
        row = {side: {"host_us": statistics.median(s["host_us"]), "host_us_range": [min(s["host_us"]), max(s["host_us"])],
                      "device_us": statistics.median(s["device_us"]), "python_calls": calls[side]}
               for side, s in samples.items()}
        ratios = [d / p for d, p in zip(samples["direct"]["host_us"], samples["plain"]["host_us"])]
        row["direct_over_plain_host"] = {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
        row["bit_identical"] = bool(torch.equal(outputs["plain"], outputs["direct"]))
        results[name] = row
        print(f"{name:11s} host us/launch plain {row['plain']['host_us']:7.2f} direct {row['direct']['host_us']:7.2f} "
              f"(ratio {row['direct_over_plain_host']['median']:.3f} [{min(ratios):.3f}, {max(ratios):.3f}]); "
              f"device us {row['plain']['device_us']:.2f} / {row['direct']['device_us']:.2f}; Python calls "
              f"{calls['plain']:.0f} / {calls['direct']:.0f}; bit-identical {row['bit_identical']}", flush=True)
    set_mode(False)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "rounds": args.rounds, "launches": args.launches}
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
