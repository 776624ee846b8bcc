"""The CPU a rank's helper threads burn beside its main thread, and when that CPU lengthens the step.

A collective library moves an exchange's bytes on threads of its own: gloo's transfer threads (ProcessGroupGloo's
worker and its TCP device loop copy every all-to-all through the kernel's socket buffers), NCCL's proxy thread.
Their CPU is

    t_cpu = c_xb * bytes + c_xc * exchanges

per step and rank, `bytes` what the rank sends in all its exchanges of the step (each received byte is another
rank's sent one: c_xb prices both ends), `exchanges` the collective calls: the all-to-alls and every piece of a
gradient all-reduce (a DDP bucket, one of Lina's micro-ops: `cost_model.ep.allreduce_calls`). FSEP's planner solves
on a thread of its own once per step (`planner_cpu`: c_plan + c_plan_e per [W, E] count entry).

When it counts: a node runs `ranks` ranks (n_rank, default G), each a main thread plus n_help helper threads busy
around its exchanges, on n_core cores. With

    n_rank * (1 + n_help) <= n_core

every thread has a core of its own: the helpers run beside the main threads and the term is 0. That is the GPU
presets' case (their figures 0 and n_core unbounded: NCCL's proxy threads run on the host's free cores while the
GPU computes). Otherwise (gloo ranks filling a CPU's cores) the helpers run on the cores the main threads compute
on: their CPU comes out of the main threads' time, and each thread an exchange wakes (the helpers, then the main
thread again) waits for a core a main thread holds. What an exchange then adds to the step beyond the link time the
model already prices (`cost_model.ep.a2a_time`, measured between otherwise idle ranks) is at least its helper CPU
and is measured directly as

    t_wait = c_wb * bytes + c_wc * exchanges

the wall time all-to-alls add to a loop of matmuls on every rank, minus their link time. The step pays
`LayerTerms.threads` = max(t_cpu, t_wait) + the planner's CPU. `cost_model.calibrate_threads` measures c_xb, c_xc
(process CPU minus the main thread's), c_wb, c_wc (the wall) in that loop, the planner's solve, n_help and n_core.

All figures are optional symbols: a figure dict without them (or without n_core) prices no helper term, and a
layout in symbols (G, n_help or n_core) none either: whether threads outnumber cores is decided on numbers.
"""

from __future__ import annotations

import math
from typing import Any

import sympy

from cost_model.symbols import smax


def thread_cpu(sent_bytes: Any, exchanges: Any, c_xb: Any, c_xc: Any) -> Any:
    """Seconds per step and rank at c_xb per byte sent and c_xc per exchange (collective call): the helper
    threads' CPU, or with c_wb, c_wc the busy-core wait (module doc)."""
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


def thread_figures(x: dict[str, Any], other: Any = 0) -> tuple[Any, Any, Any, Any] | None:
    """(c_xb, c_xc, c_wb, c_wc) when the helper threads' time reaches the critical path (module doc): the node is
    oversubscribed (x's n_rank, default G, n_help and n_core) and a figure or `other` is not 0; else None."""
    figures = tuple(x.get(k, 0) for k in ("c_xb", "c_xc", "c_wb", "c_wc"))
    if all(f == 0 for f in (*figures, other)):  # numbers or sympy zero (structural ==: no symbol is 0)
        return None
    layout = [x.get("n_rank", x.get("G", 1)), x.get("n_help", 0), x.get("n_core", 0) or 0]
    if any(isinstance(v, sympy.Basic) and not v.is_number for v in layout):
        return None  # ranks, threads or cores in symbols: a discrete choice of the plan, priced with numbers only
    if not oversubscribed(*(float(v) for v in layout)):
        return None
    return figures  # type: ignore[return-value]


def exposed_thread_cpu(x: dict[str, Any], sent_bytes: Any, exchanges: Any, other: Any = 0) -> Any:
    """The helper-thread time added to a step's critical path (module doc): max(`thread_cpu`, the busy-core wait)
    of the step's `sent_bytes` and `exchanges`, plus `other` seconds of helper-thread CPU (FSEP's planner,
    `planner_cpu`), when `thread_figures` says it counts, else 0."""
    figures = thread_figures(x, other)
    if figures is None:
        return 0
    c_xb, c_xc, c_wb, c_wc = figures
    return smax(thread_cpu(sent_bytes, exchanges, c_xb, c_xc), thread_cpu(sent_bytes, exchanges, c_wb, c_wc)) + other
