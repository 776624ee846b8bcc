"""Calibration of the gradient all-reduce: gloo `all_reduce` between WORLD ranks, per message size.

The all-to-all's figures do not price it. At W=2 on this machine's loopback (2026-11-27, 40 calls per size, load 0.4)
a gloo all-reduce of 64 KiB to 1 MiB took 0.44-0.91 ms at the median but 4.0-4.4 ms at the 90th percentile (max 9 ms),
against 0.18-0.58 ms and 0.46-1.03 ms for an all-to-all of the same size: the ring's steps each wait for the peer and
gloo reduces on its own threads, and a thread that loses its core waits for the next scheduler tick (4 ms here).
Lina's micro-ops are all-reduces of tens to hundreds of KiB, ten or more a step: the step pays the sum, so the
calibration takes the mean, stalls included, not the median.

`worker`, per size in SIZES: `reps` calls (two warm-up calls first), each between barriers, the slower rank's time;
rank 0 reports the mean. `figures` fits t = allreduce_alpha + sent / allreduce_bandwidth over the bytes a rank
sends in a ring all-reduce (`cost_model.ep.allreduce_sent`: 2 (W-1)/W of the tensor), the same weighted fit as the
all-to-all's (`cost_model.fits.fit_latency_rate`). `cost_model.ep.allreduce_figures` prices every gradient
all-reduce with them (the rate capped by the link's bandwidth); profiles without them price it at the all-to-all's.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Sequence
from typing import Any

from cost_model.ep import allreduce_sent
from cost_model.fits import fit_latency_rate

SIZES = (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)  # tensor bytes per rank: a micro-op's range and a DDP bucket's
REPS = 40  # calls per size (`cost_model.calibrate` runs twice its all-to-all's repetitions: 40 by default)
UNITS = {
    "allreduce_alpha": "s per gloo all_reduce call (the fit's latency)",
    "allreduce_bandwidth": "bytes a rank sends in a ring all-reduce (2 (W-1)/W of the tensor) per s",
}


def worker(rank: int, port: int | None, world: int, sizes: Sequence[int], reps: int, results: Any,
           timeout_s: float) -> None:
    """One of `world` gloo ranks (`cost_model.calibrate.spawn_ranks` starts them; `port` None: MASTER_ADDR and
    MASTER_PORT are set already, a rank in a network namespace): per size, rank 0 reports (tensor bytes, mean of
    the per-call max over the ranks)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        for size in sizes:
            tensor = torch.randn(max(1, size // 4))
            times = []
            for i in range(reps + 2):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(tensor)
                if i >= 2:  # two warm-up calls
                    times.append(time.perf_counter() - t0)
                tensor.div_(world)  # keep the values bounded
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
            if rank == 0:
                results.put((tensor.numel() * 4, float(slowest.mean())))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def figures(timings: Sequence[tuple[int, float]], world: int) -> dict[str, Any]:
    """`allreduce_alpha`, `allreduce_bandwidth` and the samples from `worker`'s [(tensor bytes, seconds)]."""
    sent = [float(allreduce_sent(size, world)) for size, _ in timings]
    alpha, bandwidth = fit_latency_rate(sent, [seconds for _, seconds in timings])
    return {"allreduce_alpha": alpha, "allreduce_bandwidth": bandwidth,
            "allreduce_samples": [{"tensor_bytes": size, "sent_bytes": s, "seconds": t}
                                  for (size, t), s in zip(timings, sent)]}
