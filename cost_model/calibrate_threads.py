"""Calibration of the helper threads' CPU (`cost_model.helper_cpu`): gloo all-to-alls between matmuls.

WORLD spawned gloo ranks (one main thread each, `torch.set_num_threads(1)`, as `cost_model.calibrate`'s other
benchmarks) run, per message size, `REPS` iterations of [BUSY_MATMULS fp32 BUSY_N^3 matmuls, one
`all_to_all_single`], so every core holds a rank's main thread when the exchange's transfer threads need one, as in
a training step; and the same iterations without the exchange; BLOCKS such pairs, interleaved. Per exchange, the
busier rank's, median over the blocks:

- helper CPU = (process CPU - main-thread CPU) with the exchange, minus the same without it (`time.process_time`
  minus `time.thread_time`): a line over the bytes a rank sends -> `xfer_call_cost` (s per exchange, the
  intercept) and `xfer_byte_cost` (s per byte, the slope);
- helper threads: the threads besides the main one whose CPU (/proc/self/task/*/schedstat) grew by at least
  `BUSY_SHARE` of the helper CPU at the largest size -> `helper_threads`;
- busy-core wait = the wall time each iteration gained with the exchange, minus the exchange's link time from the
  calibrated all-to-all figures (alpha + bytes / bandwidth, timed between otherwise idle ranks): a line over the
  bytes sent -> `xfer_wait_call_cost` (s per exchange) and `xfer_wait_byte_cost` (s per byte).

`cores`: the CPUs the process may run on (`os.sched_getaffinity`), the n_core of `helper_cpu`'s rule.

FSEP's planner (`moepass.runtime.placement.plan`, on its controller's worker thread once per step and FSEP layer):
its thread CPU per solve on random [W, E] counts at PLANNER_SIZES (W, E, C), a line over the W*E count entries ->
`planner_cost` (s per solve) and `planner_entry_cost` (s per entry); `planner_times` takes the solve as an argument
(`cost_model.calibrate` hands it the runtime's planner).
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from cost_model.fits import fit_line

SIZES = (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 23)  # all_to_all_single input bytes per rank (W=2: half is sent)
REPS, BLOCKS = 10, 21  # iterations per block; per size, BLOCKS blocks without and with the exchange (medians)
BUSY_N, BUSY_MATMULS = 256, 8  # the main thread's work between two exchanges (~2-4 ms here)
BUSY_SHARE = 0.1  # a thread counts as a helper when it burned this share of the helper CPU
PLANNER_SIZES = ((2, 8, 4), (2, 32, 16), (4, 64, 16), (8, 128, 16))  # (W, E, C) of the timed planner solves
UNITS = {
    "xfer_byte_cost": "s of helper-thread CPU (process CPU minus the main thread's) per byte a rank sends in an "
                      "all-to-all, the ranks' main threads busy between the exchanges",
    "xfer_call_cost": "s of helper-thread CPU per all-to-all call (the same fit's intercept)",
    "xfer_wait_byte_cost": "s per byte sent that an all-to-all among busy cores adds to the step beyond its link time "
                           "(wall gain of the same loop minus alpha + bytes / bandwidth: the slope)",
    "xfer_wait_call_cost": "s per all-to-all call that it adds beyond its link time (the same fit's intercept)",
    "helper_threads": "threads besides the main one that burned CPU during those all-to-alls",
    "cores": "CPUs this process may run on (os.sched_getaffinity)",
    "planner_cost": "s of thread CPU per FSEP planner solve (the intercept over W*E count entries)",
    "planner_entry_cost": "s of thread CPU per [W, E] count entry of an FSEP planner solve (the slope)",
}


def thread_cpu_ns() -> dict[int, int]:
    """{thread id: ns on a CPU} of this process's threads (/proc/self/task/*/schedstat's first field)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return out


def available_cores() -> int:
    """The CPUs this process may run on (its affinity set; `os.cpu_count()` where that is not available)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def worker(rank: int, port: int | None, world: int, sizes: Sequence[int], reps: int, results: Any,
           timeout_s: float) -> None:
    """One of `world` gloo ranks (`cost_model.calibrate.spawn_ranks` starts them): per size, the loop with and
    without the exchange; rank 0 reports per size (input bytes, helper CPU per exchange, wall gained per
    iteration, helper threads), each the max over the ranks."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if port is not None:  # else set already (a rank in a network namespace, `benchmarks/netns.py`)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        main = threading.get_native_id()
        a = torch.randn(BUSY_N, BUSY_N)
        for size in sizes:
            numel = max(world, size // 4 // world * world)
            x_in, x_out = torch.randn(numel), torch.empty(numel)
            for _ in range(2):  # warm-up
                torch.mm(a, a)
                dist.all_to_all_single(x_out, x_in)
            blocks = []  # per block: without the exchange (helper CPU, wall, threads), then with it
            for _ in range(BLOCKS):
                row = []
                for exchange in (False, True):
                    dist.barrier()
                    n0, c0, m0, t0 = thread_cpu_ns(), time.process_time(), time.thread_time(), time.perf_counter()
                    for _ in range(reps):
                        for _ in range(BUSY_MATMULS):
                            torch.mm(a, a)
                        if exchange:
                            dist.all_to_all_single(x_out, x_in)
                    wall = time.perf_counter() - t0
                    helper = (time.process_time() - c0) - (time.thread_time() - m0)
                    n1 = thread_cpu_ns()
                    grown = [n1[t] - n0[t] for t in n1 if t in n0 and t != main]
                    row += [helper / reps, wall / reps, float(sum(g >= BUSY_SHARE * max(helper, 1e-9) * 1e9
                                                                  for g in grown))]
                blocks.append(row)
            slowest = torch.tensor(blocks, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            idle_cpu, idle_wall, _, cpu, wall, threads = slowest.median(dim=0).values.tolist()
            if rank == 0:
                results.put((numel * 4, cpu - idle_cpu, wall - idle_wall, threads))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def figures(samples: Sequence[tuple[int, float, float, float]], world: int, alpha: float,
            bandwidth: float) -> dict[str, Any]:
    """The profile's helper-thread figures from `worker`'s samples [(input bytes per rank, helper CPU s per
    exchange, wall s gained per iteration, helper threads)] per size: the least-squares lines of the helper CPU and
    of the wall gain minus the link time (the all-to-all's own alpha and bandwidth) over the bytes sent, slopes and
    intercepts clamped at 0."""
    sent = [size * (world - 1) / world for size, *_ in samples]
    if len(samples) < 2:
        raise ValueError(f"need >= 2 message sizes to fit the helper-thread CPU, got {len(samples)}")
    link = [alpha + b / bandwidth for b in sent]
    intercept, slope = fit_line(sent, [cpu for _, cpu, _, _ in samples])
    wait_intercept, wait_slope = fit_line(sent, [wall - t for (_, _, wall, _), t in zip(samples, link)])
    return {
        "xfer_byte_cost": max(0.0, slope),
        "xfer_call_cost": max(0.0, intercept),
        "xfer_wait_byte_cost": max(0.0, wait_slope),
        "xfer_wait_call_cost": max(0.0, wait_intercept),
        "helper_threads": float(samples[-1][3]),
        "cores": available_cores(),
        "threads_samples": [{"input_bytes": size, "sent_bytes": b, "helper_cpu_s": cpu, "wall_gain_s": wall,
                             "link_s": t, "helper_threads": n}
                            for (size, cpu, wall, n), b, t in zip(samples, sent, link)],
    }


def planner_times(solver: Any, sizes: Sequence[tuple[int, int, int]] = PLANNER_SIZES,
                  reps: int = 20) -> list[tuple[int, float]]:
    """[(W*E, thread CPU s of one solve, median of `reps`)] per (W, E, C) in `sizes`; `solver(W, E, C)` returns a
    function of a [W, E] int64 count tensor that runs one solve."""
    import torch

    out = []
    for W, E, C in sizes:
        solve = solver(W, E, C)
        gen = torch.Generator().manual_seed(W * E)
        counts = [torch.randint(0, 4096, (W, E), generator=gen, dtype=torch.int64) for _ in range(reps + 2)]
        times = []
        for i, c in enumerate(counts):
            t0 = time.thread_time()
            solve(c)
            if i >= 2:  # two warm-up solves
                times.append(time.thread_time() - t0)
        out.append((W * E, float(np.median(times))))
    return out


def planner_figures(samples: Sequence[tuple[int, float]]) -> dict[str, Any]:
    """`planner_cost` and `planner_entry_cost` from `planner_times`' samples: the least-squares line of the solve's
    CPU over the count entries (both clamped at 0)."""
    intercept, slope = fit_line([n for n, _ in samples], [t for _, t in samples])
    return {"planner_cost": max(0.0, intercept), "planner_entry_cost": max(0.0, slope),
            "planner_samples": [{"entries": n, "seconds": t} for n, t in samples]}
