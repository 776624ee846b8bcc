"""Microbenchmarks for this machine's cost-model figures -> a JSON profile.

- gloo `all_to_all_single` at W=2 (two spawned processes, one thread each, loopback) over message
  sizes: fits t = alpha + bytes / bandwidth, where bytes are what one rank SENDS to the other rank
  (size * (W-1)/W: the rank's own slice stays local), the convention of `cost_model.ep`.
- fp32 matmul throughput by size: fits t = overhead + flops / rate -> effective FLOP/s.
- host overheads of moepass's EP layer (`cost_model.ep.host_time`), each from its own microbenchmark,
  none from the configurations `benchmarks/cost_fidelity.py` checks:
  * the EP layer (2 gloo ranks, `moepass.compile(FusedMoE, Plan(form="ep"))`, forward + backward) at a
    vanishing size (T=16, D=F=16, K=1) for E = 2..64 experts: t = intercept + slope * E/2 local experts.
    intercept - 5 alpha -> `layer_overhead` (graph, router, split-size syncs, DTensor wrapping; the 5
    all-to-alls' latency is alpha's). The slope is the grouped engine's per-expert cost at that size, which
    no layer worth pricing runs: not used;
  * the data movement around the experts (moe.permute -> local permute -> unpermute x2 -> combine,
    forward + backward) over routed elements rows x D: slope -> `row_cost`;
  * the expert FFN kernel's GEMMs on one expert (x @ W^T forward; g @ W and g^T @ a backward; the
    kernel's own layouts) at width D in GEMM_D (F = 2D) and M rows in GEMM_M: FLOP/s by (D, M) ->
    `gemm`, as an efficiency relative to a 256^3 square matmul timed in the same window (so the
    table does not move with the load between cells); `Hardware.gemm_rate` interpolates it and
    multiplies by `flops` (small D or M run below the square-matmul rate);
  * the expert FFN kernel's time beyond its GEMMs (activation, copies, the per-expert loop), forward + backward,
    at sizes where it runs expert by expert -> `expert_overhead` (per local expert) and `act_cost` (per hidden
    element rows x F) (`cost_model.calibrate_ffn`).
  * first-touch page faults: one fresh buffer of FRESH_BYTES (above glibc's largest mmap threshold, 32 MiB, so
    every allocation is a new mapping) filled, minus the same fill into a buffer already touched, over the
    minor page faults the fresh fill took (getrusage) -> `page_cost`, s per minor fault;
  * FSEP's restore re-layout on the rank's own thread (`moepass.runtime.fsep_ops`: gather_slices, assemble,
    the backward's restore again, the gradient's assemble backward and slice_grads into the shards; the
    exchanges themselves are the all-to-all figures) over the restored elements C x S_e -> `restore_cost`.
  * the router per token (gate GEMM + moe.route, forward + backward) -> `route_cost` (`cost_model.calibrate_route`);
  * the helper threads' CPU (gloo's transfer threads) around all-to-alls between matmuls, per byte sent and per
    call, and the cores the ranks share -> `xfer_byte_cost`, `xfer_call_cost`, `helper_threads`, `cores`
    (`cost_model.calibrate_threads`, priced by `cost_model.helper_cpu`).
  These run on WORLD concurrent ranks with sustained timings, like the workload (see `_host_worker`).

Usage: `python -m cost_model.calibrate [--out PATH] [--quick]` (moepass wires `python -m moepass
calibrate` to `main`). A full run takes well under a minute here; the profile goes to
`~/.cache/moepass/profile.json` unless `--out` says otherwise, and `presets.this_machine()` reads it
(the default of `Plan.hardware`; pass `Plan(hardware=path)` to use a profile written elsewhere).
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

from cost_model import calibrate_allreduce, calibrate_ffn, calibrate_route, calibrate_threads
from cost_model.fits import fit_latency_rate
from cost_model.presets import DEFAULT_PROFILE

WORLD = 2
FULL_SIZES = tuple(4096 * 4**i for i in range(7))  # 4 KiB .. 16 MiB per all_to_all_single input
QUICK_SIZES = (4096, 65536, 1 << 20)
MATMUL_SIZES = (64, 128, 256, 512, 1024)
LAYER_EXPERTS = (2, 8, 16, 32, 64)  # E of the vanishing-size EP layer (E/2 local experts per rank)
SUSTAIN_S = 0.08  # seconds per timed repetition of the concurrent host benchmarks (see _host_worker.timed)
ROW_SIZES = ((1024, 64), (4096, 64), (4096, 128), (16384, 128))  # (routed rows, D)
GEMM_D = (64, 128, 256, 512)  # width D of the expert GEMM benchmark (F = 2D)
GEMM_M = (64, 256, 1024)  # rows per expert
GEMM_REF = 256  # the square matmul each expert-GEMM timing is taken relative to
FRESH_BYTES = 64 << 20  # the first-touch buffer: above glibc's largest dynamic mmap threshold (32 MiB)
RESTORE_SIZES = ((2, 64, 128), (4, 128, 256), (4, 192, 384), (6, 256, 512))  # (C slots, D, F) of the restore
FIXED_HOST_ITEMS = len(RESTORE_SIZES) + 3  # host results beside the sized ones: restores, fresh and warm fills, faults


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sent_bytes(input_bytes: float) -> float:
    """What one of WORLD ranks sends the others in an all_to_all_single of `input_bytes` (its own slice stays)."""
    return input_bytes * (WORLD - 1) / WORLD


def a2a_figures(timings: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(alpha, bandwidth) of t = alpha + sent bytes / bandwidth over [(input bytes per rank, seconds)]."""
    return fit_latency_rate([sent_bytes(size) for size, _ in timings], [seconds for _, seconds in timings])


def a2a_worker(rank: int, port: int | None, sizes: Sequence[int], reps: int, results: Any, timeout_s: float) -> None:
    """One gloo rank: time all_to_all_single per size; rank 0 reports (size, median of per-rep max). `port` None:
    MASTER_ADDR / MASTER_PORT are already set (a rank in a network namespace, `benchmarks/netns.py`)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if port is not None:
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


def _rows_step(ops: Any, x: Any, experts_TK: Any, weights_TK: Any, local_N1: Any, E: int, K: int) -> None:
    """The EP graph's data movement around the experts, forward + backward: moe.permute (T*K rows) ->
    local permute -> unpermute (K=1) -> unpermute (K) -> weighted combine."""
    x_ND, _, order_N = ops.permute(x, experts_TK, E)
    x_MD, _, order_M = ops.permute(x_ND, local_N1, E // 2)
    y_ND = ops.unpermute(x_MD, order_M, 1).flatten(0, 1)
    ops.combine(ops.unpermute(y_ND, order_N, K), weights_TK).sum().backward()


def restore_step(slots: int, D: int, F: int, E: int = 8, peers: int = WORLD) -> tuple[Any, list[Any]]:
    """FSEP's restore work on one rank without its exchanges (an equal all_to_all keeps the buffer's shape, so
    the send buffer stands in for the received one), forward + backward as `moepass.rewrite.fsep` runs it:
    gather_slices + assemble (the forward restore), the same under no_grad (the backward's `Restore.run`), and
    the weights' gradients through assemble's backward and gather_slices' (slice_grads into the shards). Three
    SwiGLU weights of [F, D] per expert; C*S_e = slots * 3 * D * F restored elements. Returns the step and the
    shards it leaves gradients on."""
    import torch

    from moepass.runtime.fsep_ops import assemble, gather_slices

    shapes = ((F, D), (F, D), (D, F))
    shards = [torch.randn(E, s[0] // peers, s[1], requires_grad=True) for s in shapes]
    slot_expert_U = torch.arange(peers * slots) % E
    grads = [torch.randn(slots, *s) for s in shapes]

    def step() -> None:
        for shard in shards:
            shard.grad = None
        weights = assemble(gather_slices(shards, slot_expert_U), peers, shapes)
        with torch.no_grad():
            assemble(gather_slices([s.detach() for s in shards], slot_expert_U), peers, shapes)
        torch.autograd.backward(weights, grads)

    return step, shards


def fresh_fill(nbytes: int) -> tuple[float, int]:
    """(seconds, minor page faults) of filling a freshly mapped buffer of `nbytes`."""
    import resource

    import torch

    f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t0 = time.perf_counter()
    torch.empty(nbytes // 4).fill_(1.0)
    return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0


def _host_worker(rank: int, port: int, matmul_sizes: Sequence[int], row_sizes: Sequence[tuple[int, int]],
                 ffn_sizes: Sequence[tuple[int, int, int, int]], gemm_dims: Sequence[int], gemm_rows: Sequence[int],
                 experts: Sequence[int], reps: int, results: Any, timeout_s: float) -> None:
    """One of WORLD gloo ranks running the same microbenchmark AT THE SAME TIME (the workload's process
    layout: W single-threaded ranks sharing this machine); per size, the median over repetitions of
    the slower rank's time: fp32 matmuls, the data movement around the experts, and moepass's EP
    layer at a vanishing size per expert count. Rank 0 reports (kind, size, seconds). Sustained
    timings (see `timed`): on shared cores a rank is descheduled for a fraction of a long step that a
    single short call can miss."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=timeout_s))

    def sustained(step: Any, warmup: int) -> int:
        """Back-to-back calls of `step` that take >= SUSTAIN_S (the same count on every rank)."""
        t_est = torch.zeros((), dtype=torch.float64)
        for _ in range(warmup):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            t_est.fill_(time.perf_counter() - t0)
        dist.all_reduce(t_est, op=dist.ReduceOp.MAX)
        return max(1, int(np.ceil(SUSTAIN_S / max(float(t_est), 1e-7))))

    def timed(kind: str, size: int, step: Any, warmup: int = 2, ref: Any = None, excess: bool = False) -> None:
        """Sustained timing: each repetition runs `step` back to back for >= SUSTAIN_S (the same count
        on every rank), so a time-sliced share of a busy CPU shows as it does in a whole training step.
        With `ref`, each repetition also runs `ref` right after and the result is the time ratio
        step / ref: a relative figure that a load change between repetitions does not move (`excess`:
        the difference step - ref, in seconds per call, instead)."""
        inner = sustained(step, warmup)
        inner_ref = sustained(ref, warmup) if ref is not None else 0
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                step()
            t1 = time.perf_counter()
            for _ in range(inner_ref):
                ref()
            times.append([(t1 - t0) / inner, (time.perf_counter() - t1) / max(inner_ref, 1)])
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        value = slowest[:, 0]
        if ref is not None:
            value = value - slowest[:, 1] if excess else value / slowest[:, 1]
        if rank == 0:
            results.put((kind, size, float(value.median())))

    try:
        import moepass
        from samples.models import FusedMoE

        for n in matmul_sizes:
            a, b = torch.randn(n, n), torch.randn(n, n)
            timed("matmul", n, lambda a=a, b=b: torch.mm(a, b))
        ops, E, K = torch.ops.moe, 8, 2
        for rows, D in row_sizes:
            gen = torch.Generator().manual_seed(rows + D + rank)
            x = torch.randn(rows // K, D, generator=gen).requires_grad_()
            experts_TK = torch.rand(rows // K, E, generator=gen).topk(K, dim=1).indices
            weights_TK = torch.rand(rows // K, K, generator=gen)
            local_N1 = (torch.arange(rows) % (E // 2)).unsqueeze(1)
            timed("rows", rows * D, lambda x=x, e=experts_TK, w=weights_TK, i=local_N1: _rows_step(ops, x, e, w, i, E, K))
        ref_a = torch.randn(GEMM_REF, GEMM_REF)
        for D in gemm_dims:
            for M in gemm_rows:
                gen = torch.Generator().manual_seed(D + M + rank)
                x, w, g = torch.randn(M, D, generator=gen), torch.randn(2 * D, D, generator=gen), torch.randn(M, 2 * D)

                def gemms(x: Any = x, w: Any = w, g: Any = g) -> None:
                    torch.nn.functional.linear(x, w)  # forward: [M, D] @ [D, F]
                    g @ w  # backward d(input): [M, F] @ [F, D]
                    g.t() @ x  # backward d(weight): [F, M] @ [M, D]

                timed("gemm", D * 100_000 + M, gemms, ref=lambda a=ref_a: torch.mm(a, a))
        for i, (E_local, N, D, F) in enumerate(ffn_sizes):
            kernel, gemms = calibrate_ffn.ffn_steps(E_local, N, D, F, seed=i + rank)
            timed("ffn", i, kernel, ref=gemms, excess=True)
        for n in calibrate_route.TOKENS:
            timed("route", n, calibrate_route.route_step(n, seed=n + rank)[0])
        for C, D, F in RESTORE_SIZES:
            torch.manual_seed(C + D + F + rank)
            timed("restore", C * 3 * D * F, restore_step(C, D, F)[0])
        warm = torch.empty(FRESH_BYTES // 4)
        warm.fill_(0.0)
        faults = []
        for _ in range(reps):  # first-touch: the fresh fill's faults, then both fills timed together
            faults.append(fresh_fill(FRESH_BYTES)[1])
        timed("fresh", FRESH_BYTES, lambda: fresh_fill(FRESH_BYTES))
        timed("warm", FRESH_BYTES, lambda w=warm: w.fill_(1.0))
        fault_count = torch.tensor(float(np.median(faults)))
        dist.all_reduce(fault_count, op=dist.ReduceOp.MIN)
        if rank == 0:
            results.put(("faults", FRESH_BYTES, float(fault_count)))
        for j, E in enumerate((experts[0], *experts)):  # the first run warms the process up: discarded
            torch.manual_seed(0)
            plan = moepass.Plan(form="ep", topology=moepass.Topology(1, WORLD), a2a_chunks=1)
            layer = moepass.compile(FusedMoE(16, 16, E, 1), plan)
            x = torch.randn(16, 16, generator=torch.Generator().manual_seed(rank)).requires_grad_()

            def step(layer: Any = layer, x: Any = x) -> None:
                for p in layer.parameters():
                    p.grad = None
                layer(x).sum().backward()

            if j == 0:
                for _ in range(3):
                    step()
            else:
                timed("layer", E, step, warmup=3)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_ranks(worker: Any, args: tuple, messages: int, what: str, timeout_s: float, progress: Any = None,
                world: int = WORLD) -> list[Any]:
    """Run `worker(rank, port, *args, results, timeout_s)` on `world` spawned gloo ranks; the first
    `messages` items they put on `results`, in order. A rank silent for `timeout_s` raises TimeoutError;
    every process is joined or terminated on the way out."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, port, *args, results, timeout_s), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: list[Any] = []
    try:
        while len(out) < messages:
            try:
                out.append(results.get(timeout=timeout_s))
            except queue.Empty as e:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                raise TimeoutError(f"no {what} within {timeout_s:.0f} s (worker exit codes {dead})") from e
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


def measure_host(
    matmul_sizes: Sequence[int] = MATMUL_SIZES,
    row_sizes: Sequence[tuple[int, int]] = ROW_SIZES,
    experts: Sequence[int] = LAYER_EXPERTS,
    ffn_sizes: Sequence[tuple[int, int, int, int]] = calibrate_ffn.SIZES,
    gemm_dims: Sequence[int] = GEMM_D,
    gemm_rows: Sequence[int] = GEMM_M,
    reps: int = 5,
    timeout_s: float = 120.0,
    progress: Any = None,
) -> dict[str, list[tuple[int, float]]]:
    """{kind: [(size, seconds)]} from `_host_worker` on WORLD concurrent ranks: "matmul" (n), "rows"
    (routed elements rows*D), "ffn" (index into ffn_sizes: the expert FFN's seconds beyond its GEMMs), "layer" (E,
    at T=16, D=F=16, K=1)."""
    args = (tuple(matmul_sizes), tuple(row_sizes), tuple(ffn_sizes), tuple(gemm_dims), tuple(gemm_rows),
            tuple(experts), reps)
    count = (len(matmul_sizes) + len(row_sizes) + len(ffn_sizes) + len(gemm_dims) * len(gemm_rows) + len(experts)
             + FIXED_HOST_ITEMS + len(calibrate_route.TOKENS))
    out: dict[str, list[tuple[int, float]]] = {"matmul": [], "rows": [], "ffn": [], "gemm": [], "layer": [],
                                               "restore": [], "fresh": [], "warm": [], "faults": [], "route": []}
    for kind, size, seconds in spawn_ranks(_host_worker, args, count, "host timing", timeout_s, progress):
        out[kind].append((size, seconds))
    return out


def measure_a2a(
    sizes: Sequence[int], reps: int = 20, timeout_s: float = 60.0, progress: Any = None
) -> list[tuple[int, float]]:
    """[(input bytes per rank, seconds)] of gloo all_to_all_single at W=2, in spawned processes."""
    timings = spawn_ranks(a2a_worker, (tuple(sizes), reps), len(sizes), "all_to_all timing", timeout_s, progress)
    return [(size, seconds) for _, size, seconds in timings]


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
    host: bool = True,
    layer_experts: Sequence[int] = LAYER_EXPERTS,
    row_sizes: Sequence[tuple[int, int]] = ROW_SIZES,
) -> dict[str, Any]:
    """Run both microbenchmarks and return the profile (not yet written)."""
    import torch
    from tqdm import tqdm

    total = len(sizes) + len(calibrate_allreduce.SIZES) + len(matmul_sizes) * (2 if host else 1)
    total += (len(layer_experts) + len(row_sizes) + len(calibrate_ffn.SIZES) + len(GEMM_D) * len(GEMM_M)
              + FIXED_HOST_ITEMS + len(calibrate_threads.SIZES) + len(calibrate_route.TOKENS)) if host else 0
    with tqdm(total=total, desc="calibrate", unit="size", disable=not show_progress) as bar:
        a2a = measure_a2a(sizes, reps, timeout_s, progress=bar)
        allreduce = spawn_ranks(calibrate_allreduce.worker, (WORLD, calibrate_allreduce.SIZES, 2 * reps),  # means
                                len(calibrate_allreduce.SIZES), "all_reduce timing", timeout_s, bar)
        mm = measure_matmul(matmul_sizes, progress=bar)
        concurrent = (
            measure_host(matmul_sizes, row_sizes, layer_experts, timeout_s=max(timeout_s, 120.0), progress=bar)
            if host
            else {}
        )
        threads = spawn_ranks(calibrate_threads.worker, (WORLD, calibrate_threads.SIZES, calibrate_threads.REPS),
                              len(calibrate_threads.SIZES), "helper-thread timing", timeout_s, bar) if host else []
    alpha, bandwidth = a2a_figures(a2a)
    _, flops_one = fit_latency_rate([2.0 * n**3 for n, _ in mm], [s for _, s in mm])
    flops = flops_one
    extra: dict[str, Any] = {"flops_one_process": flops_one, **calibrate_allreduce.figures(allreduce, WORLD)}
    if host:
        mm_w = concurrent["matmul"]
        _, flops = fit_latency_rate([2.0 * n**3 for n, _ in mm_w], [s for _, s in mm_w])
        layer, moves = concurrent["layer"], concurrent["rows"]
        intercept, _ = calibrate_threads.fit_line([E / WORLD for E, _ in layer], [s for _, s in layer])
        _, row_rate = fit_latency_rate([n for n, _ in moves], [s for _, s in moves])
        _, restore_rate = fit_latency_rate([n for n, _ in concurrent["restore"]],
                                           [s for _, s in concurrent["restore"]])
        _, route_rate = fit_latency_rate([n for n, _ in concurrent["route"]], [s for _, s in concurrent["route"]])
        (_, fresh_s), (_, warm_s), (_, faults) = concurrent["fresh"][0], concurrent["warm"][0], concurrent["faults"][0]
        extra.update({
            "layer_overhead": max(0.0, intercept - 5 * alpha),
            "layer_intercept": intercept,
            "row_cost": 1.0 / row_rate,
            **calibrate_ffn.figures(concurrent["ffn"]),
            "restore_cost": 1.0 / restore_rate,
            "page_cost": max(0.0, fresh_s - warm_s) / max(faults, 1.0),
            "route_cost": 1.0 / route_rate,
            **calibrate_threads.figures(threads, WORLD, alpha, bandwidth),
            **calibrate_threads.planner_figures(calibrate_threads.planner_times(planner_solve)),
            "gemm": [
                {"D": key // 100_000, "M": key % 100_000, "time_ratio": ratio,
                 "efficiency": 3 * 2.0 * (key % 100_000) * (key // 100_000) * 2 * (key // 100_000)
                 / (2.0 * GEMM_REF**3) / ratio}
                for key, ratio in concurrent["gemm"]
            ],
        })
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
        **extra,
        "units": {
            "alpha": "s per all_to_all_single call",
            "bandwidth": "bytes sent per rank per s",
            "flops": "fp32 FLOP/s per rank (effective), measured on W concurrent single-threaded ranks",
            "flops_one_process": "fp32 FLOP/s of one single-threaded process alone",
            "layer_overhead": "s per EP layer step (fwd+bwd), besides 5 alpha",
            "row_cost": "s per routed element (rows x D) per EP layer step (fwd+bwd)",
            "restore_cost": "s per restored expert element (C x S_e) per FSEP layer step: the restore's re-layout "
                            "on the rank's thread (forward, the backward's restore again, the gradient slices)",
            "page_cost": "s per minor page fault: a fresh buffer's fill minus a touched one's, over its faults",
            **calibrate_allreduce.UNITS, **calibrate_threads.UNITS, **calibrate_route.UNITS, **calibrate_ffn.UNITS,
            "gemm": "efficiency of the expert FFN GEMM trio at width D (F = 2D), M rows per expert: its FLOP/s "
                    "over the 256^3 matmul's, timed back to back on WORLD concurrent ranks",
        },
        "load_average": list(os.getloadavg()),
        "samples": {
            "a2a": [{"input_bytes": s, "sent_bytes": sent_bytes(s), "seconds": t} for s, t in a2a],
            "matmul_one_process": [{"n": n, "seconds": t, "flops": 2.0 * n**3 / t} for n, t in mm],
            **(
                {}
                if host
                else {"matmul": [{"n": n, "seconds": t, "flops": 2.0 * n**3 / t} for n, t in mm]}
            ),
            **(
                {
                    "matmul": [{"n": n, "seconds": t, "flops": 2.0 * n**3 / t} for n, t in concurrent["matmul"]],
                    "layer": [{"experts": E, "local_experts": E // WORLD, "seconds": t} for E, t in concurrent["layer"]],
                    "rows": [{"elements": n, "seconds": t} for n, t in concurrent["rows"]],
                    "ffn": [{"local_experts": calibrate_ffn.SIZES[i][0], "rows": calibrate_ffn.SIZES[i][1],
                             "D": calibrate_ffn.SIZES[i][2], "F": calibrate_ffn.SIZES[i][3], "excess_seconds": t}
                            for i, t in concurrent["ffn"]],
                    "restore": [{"elements": n, "seconds": t} for n, t in concurrent["restore"]],
                    "first_touch": [{"bytes": FRESH_BYTES, "fresh_seconds": fresh_s, "warm_seconds": warm_s,
                                     "faults": faults}],
                }
                if host
                else {}
            ),
        },
    }


def planner_solve(W: int, E: int, C: int) -> Any:
    """FSEP's planner solve for (W, E, C) on one node, as `cost_model.calibrate_threads.planner_times` times it."""
    from moepass.runtime import placement

    config = placement.PlannerConfig(E=E, W=W, C=C, ranks_per_node=W)
    return lambda counts: placement.plan(counts, config)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The calibration's options, on its own parser and on `moepass calibrate`'s."""
    parser.add_argument("--out", type=Path, default=DEFAULT_PROFILE, help=f"profile path (default {DEFAULT_PROFILE})")
    parser.add_argument("--quick", action="store_true", help="3 message sizes, 3 matmul sizes, few repetitions")
    parser.add_argument("--reps", type=int, default=20, help="all_to_all repetitions per size (fewer for large sizes)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a stuck worker is an error")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-host", action="store_true", help="skip the EP-layer host-overhead benchmarks")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cost_model.calibrate", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Calibrate as `args` (from `add_arguments`) say; write the profile; the exit status."""
    try:  # the output path first: a run takes minutes
        if args.out.is_dir():
            raise IsADirectoryError(f"{args.out} is a folder")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(args.out.parent, os.W_OK):
            raise PermissionError(f"{args.out.parent} is not writable")
    except OSError as e:
        print(f"calibrate: --out {args.out}: cannot write the profile there ({e}): give a writable file path",
              file=sys.stderr)
        return 1
    try:
        profile = calibrate(
            sizes=QUICK_SIZES if args.quick else FULL_SIZES,
            reps=5 if args.quick else args.reps,
            timeout_s=args.timeout,
            matmul_sizes=MATMUL_SIZES[:3] if args.quick else MATMUL_SIZES,
            show_progress=not args.no_progress,
            host=not args.no_host,
            layer_experts=LAYER_EXPERTS[::2] if args.quick else LAYER_EXPERTS,
            row_sizes=ROW_SIZES[:2] if args.quick else ROW_SIZES,
        )
    except (TimeoutError, RuntimeError, ValueError) as e:
        print(f"calibration failed: {e}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile, indent=2) + "\n")
    print(
        f"alpha = {profile['alpha'] * 1e6:.1f} us, bandwidth = {profile['bandwidth'] / 1e9:.3f} GB/s "
        f"(gloo all_to_all_single, W={WORLD}), all_reduce = {profile['allreduce_alpha'] * 1e6:.0f} us + bytes sent "
        f"/ {profile['allreduce_bandwidth'] / 1e9:.3f} GB/s (the mean of its calls), matmul = "
        f"{profile['flops'] / 1e9:.2f} GFLOP/s fp32 "
        f"per rank ({profile['matmul_threads']} thread, {WORLD} concurrent ranks; alone "
        f"{profile['flops_one_process'] / 1e9:.2f})"
        + (
            f", layer overhead = {profile['layer_overhead'] * 1e3:.2f} ms, row cost = {profile['row_cost'] * 1e9:.2f} "
            f"ns/element, expert FFN beyond its GEMMs = {profile['expert_overhead'] * 1e6:.0f} us/local expert + "
            f"{profile['act_cost'] * 1e9:.2f} ns/hidden element, FSEP restore re-layout = "
            f"{profile['restore_cost'] * 1e9:.2f} ns/element, page fault = {profile['page_cost'] * 1e6:.2f} us, "
            f"expert GEMMs "
            + " ".join(f"D{g['D']}/M{g['M']}:{g['efficiency']:.2f}" for g in profile["gemm"])
            + " x the 256^3 matmul rate"
            if "row_cost" in profile
            else ""
        )
        + f" -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
