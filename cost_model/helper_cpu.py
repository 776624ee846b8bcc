"""The CPU a rank's helper threads burn beside its main thread, and when that CPU lengthens the step.

A collective library moves an exchange's bytes on threads of its own: gloo's transfer threads (ProcessGroupGloo's
worker and its TCP device loop copy every all-to-all through the kernel's socket buffers), NCCL's proxy thread.
Their CPU is

    t_threads = c_xb * bytes + c_xc * exchanges

per step and rank, `bytes` what the rank sends in all its exchanges of the step (each received byte is another
rank's sent one: c_xb prices both ends), `exchanges` the collective calls. `cost_model.calibrate_threads` measures
c_xb and c_xc on this machine: the process's CPU minus the main thread's during all-to-alls interleaved with
matmuls on every rank, so the cores are busy as in a training step. FSEP's planner solves on a thread of its own
once per step (`planner_cpu`: c_plan + c_plan_e per [W, E] count entry, also calibrated there).

When it counts: a node runs `ranks` ranks (n_rank, default G), each a main thread plus n_help helper threads busy
around its exchanges, on n_core cores. With

    n_rank * (1 + n_help) <= n_core

every thread has a core of its own: the helpers run beside the main threads and the term is 0. That is the GPU
presets' case (their c_xb = c_xc = 0 and n_core unbounded: NCCL's proxy threads run on the host's free cores while
the GPU computes). Otherwise (gloo ranks filling a CPU's cores) the helpers run on the cores the main threads
compute on, and their CPU comes out of the main threads' time: it is added to the step's critical path, as a
`LayerTerms.threads` term beside the link time the exchanges already pay (`cost_model.ep.a2a_time`, measured
between otherwise idle ranks, when the helpers had the cores to themselves).

All figures are optional symbols: a figure dict without c_xb, c_xc or n_core prices no helper CPU.
"""

from __future__ import annotations

import math
from typing import Any


def thread_cpu(sent_bytes: Any, exchanges: Any, c_xb: Any, c_xc: Any) -> Any:
    """Seconds of helper-thread CPU per step and rank: c_xb per byte sent, c_xc per exchange (collective call)."""
    return c_xb * sent_bytes + c_xc * exchanges


def oversubscribed(ranks: float, helpers: float, cores: float) -> bool:
    """Whether the node's threads outnumber its cores: ranks x (1 main + helpers) > cores. Unknown cores
    (None, 0 or infinite) are never oversubscribed."""
    if not cores or math.isinf(cores):
        return False
    return ranks * (1 + helpers) > cores


def planner_cpu(W: Any, E: Any, c_plan: Any, c_plan_e: Any) -> Any:
    """Seconds of FSEP's planner thread per step and FSEP layer: one solve on the [W, E] counts, c_plan plus
    c_plan_e per count entry (`cost_model.calibrate_threads.planner_times`)."""
    return c_plan + c_plan_e * W * E


def exposed_thread_cpu(x: dict[str, Any], sent_bytes: Any, exchanges: Any, other: Any = 0) -> Any:
    """The helper-thread CPU added to a step's critical path (module doc): `thread_cpu` of the step's `sent_bytes`
    and `exchanges`, plus `other` seconds of helper-thread CPU (FSEP's planner, `planner_cpu`), when the node is
    oversubscribed (x's n_rank, default G, n_help and n_core), else 0."""
    c_xb, c_xc = x.get("c_xb", 0), x.get("c_xc", 0)
    if isinstance(c_xb + c_xc + other, (int, float)) and c_xb == 0 and c_xc == 0 and other == 0:
        return 0
    ranks = x.get("n_rank", x.get("G", 1))
    if not oversubscribed(float(ranks), float(x.get("n_help", 0)), float(x.get("n_core", 0) or 0)):
        return 0
    return thread_cpu(sent_bytes, exchanges, c_xb, c_xc) + other
