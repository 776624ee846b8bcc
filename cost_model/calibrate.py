"""Microbenchmarks for this machine's cost-model figures -> a JSON profile.

- gloo `all_to_all_single` at W=2 (two spawned processes, one thread each, loopback) over message
  sizes: fits t = alpha + bytes / bandwidth, where bytes are what one rank SENDS to the other rank
  (size * (W-1)/W: the rank's own slice stays local), the convention of `cost_model.ep`.
- fp32 matmul throughput by size: fits t = overhead + flops / rate -> effective FLOP/s.

Usage: `python -m cost_model.calibrate [--out PATH] [--quick]` (moepass wires `python -m moepass
calibrate` to `main`). A full run takes well under a minute here; the profile goes to
`~/.cache/moepass/profile.json` unless `--out` says otherwise, and `presets.this_machine()` reads it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cost_model.presets import DEFAULT_PROFILE

WORLD = 2
FULL_SIZES = tuple(4096 * 4**i for i in range(7))  # 4 KiB .. 16 MiB per all_to_all_single input
QUICK_SIZES = (4096, 65536, 1 << 20)
MATMUL_SIZES = (64, 128, 256, 512, 1024)


def fit_latency_rate(amounts: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Fit t = latency + amount / rate (weighted by 1/t so small sizes count): (latency, rate).

    The latency is clamped at 0 (a negative fit means the latency is below the noise); the rate is
    then refit through the origin.
    """
    x = np.asarray(amounts, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if x.shape != t.shape or x.size < 2:
        raise ValueError(f"need >= 2 (amount, seconds) pairs of equal length, got {x.size} and {t.size}")
    w = 1.0 / t
    A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (latency, inv_rate), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    if latency < 0:
        latency = 0.0
        inv_rate = float(np.sum(w * w * x * t) / np.sum(w * w * x * x))
    if inv_rate <= 0:
        raise ValueError("timings do not grow with size: cannot fit a rate")
    return float(latency), float(1.0 / inv_rate)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _a2a_worker(rank: int, port: int, sizes: Sequence[int], reps: int, results: Any, timeout_s: float) -> None:
    """One gloo rank: time all_to_all_single per size; rank 0 reports (size, median of per-rep max)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        for size in sizes:
            numel = max(WORLD, size // 4 // WORLD * WORLD)
            x_in = torch.randn(numel)
            x_out = torch.empty_like(x_in)
            n = max(3, min(reps, int(reps * (1 << 20) / max(size, 1 << 20))))
            times = []
            for i in range(n + 2):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_to_all_single(x_out, x_in)
                if i >= 2:  # two warm-up calls
                    times.append(time.perf_counter() - t0)
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
            if rank == 0:
                results.put(("a2a", numel * 4, float(slowest.median())))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_a2a(
    sizes: Sequence[int], reps: int = 20, timeout_s: float = 60.0, progress: Any = None
) -> list[tuple[int, float]]:
    """[(input bytes per rank, seconds)] of gloo all_to_all_single at W=2, in spawned processes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_a2a_worker, args=(r, port, tuple(sizes), reps, results, timeout_s), daemon=True)
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    out: list[tuple[int, float]] = []
    try:
        while len(out) < len(sizes):
            try:
                _, size, seconds = results.get(timeout=timeout_s)
            except queue.Empty as e:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                raise TimeoutError(f"no all_to_all timing within {timeout_s:.0f} s (worker exit codes {dead})") from e
            out.append((size, seconds))
            if progress is not None:
                progress.update(1)
        for p in procs:
            p.join(timeout=timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    return out


def measure_matmul(sizes: Sequence[int] = MATMUL_SIZES, reps: int = 5, progress: Any = None) -> list[tuple[int, float]]:
    """[(n, seconds)] of an fp32 n x n @ n x n matmul, fastest of `reps`, on one thread (like a rank of
    the all-to-all benchmark; on shared cores a multi-threaded GEMM stalls on descheduled threads)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _time_matmuls(sizes, reps, progress)
    finally:
        torch.set_num_threads(threads)


def _time_matmuls(sizes: Sequence[int], reps: int, progress: Any) -> list[tuple[int, float]]:
    import torch

    out = []
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t0)
        out.append((n, min(times)))
        if progress is not None:
            progress.update(1)
    return out


def calibrate(
    sizes: Sequence[int] = FULL_SIZES,
    reps: int = 20,
    timeout_s: float = 60.0,
    matmul_sizes: Sequence[int] = MATMUL_SIZES,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Run both microbenchmarks and return the profile (not yet written)."""
    import torch
    from tqdm import tqdm

    with tqdm(total=len(sizes) + len(matmul_sizes), desc="calibrate", unit="size", disable=not show_progress) as bar:
        a2a = measure_a2a(sizes, reps, timeout_s, progress=bar)
        mm = measure_matmul(matmul_sizes, progress=bar)
    sent = [size * (WORLD - 1) / WORLD for size, _ in a2a]
    alpha, bandwidth = fit_latency_rate(sent, [s for _, s in a2a])
    _, flops = fit_latency_rate([2.0 * n**3 for n, _ in mm], [s for _, s in mm])
    return {
        "version": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.machine(),
        "torch": torch.__version__,
        "backend": "gloo",
        "world_size": WORLD,
        "alpha": alpha,
        "bandwidth": bandwidth,
        "flops": flops,
        "matmul_threads": 1,
        "units": {
            "alpha": "s per all_to_all_single call",
            "bandwidth": "bytes sent per rank per s",
            "flops": "fp32 FLOP/s (effective)",
        },
        "samples": {
            "a2a": [{"input_bytes": s, "sent_bytes": b, "seconds": t} for (s, t), b in zip(a2a, sent)],
            "matmul": [{"n": n, "seconds": t, "flops": 2.0 * n**3 / t} for n, t in mm],
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cost_model.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_PROFILE, help=f"profile path (default {DEFAULT_PROFILE})")
    parser.add_argument("--quick", action="store_true", help="3 message sizes, 3 matmul sizes, few repetitions")
    parser.add_argument("--reps", type=int, default=20, help="all_to_all repetitions per size (fewer for large sizes)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a stuck worker is an error")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        profile = calibrate(
            sizes=QUICK_SIZES if args.quick else FULL_SIZES,
            reps=5 if args.quick else args.reps,
            timeout_s=args.timeout,
            matmul_sizes=MATMUL_SIZES[:3] if args.quick else MATMUL_SIZES,
            show_progress=not args.no_progress,
        )
    except (TimeoutError, RuntimeError, ValueError) as e:
        print(f"calibration failed: {e}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile, indent=2) + "\n")
    print(
        f"alpha = {profile['alpha'] * 1e6:.1f} us, bandwidth = {profile['bandwidth'] / 1e9:.3f} GB/s "
        f"(gloo all_to_all_single, W={WORLD}), matmul = {profile['flops'] / 1e9:.2f} GFLOP/s fp32 "
        f"({profile['matmul_threads']} threads) -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
