"""Lina's chunked, pipelined and prioritised all-to-all: time as a function of the chunk count n.

One MoE layer pass (forward, or backward with twice the compute) is a three-stage flow: dispatch
all-to-all, expert compute, combine all-to-all. Cutting the tokens into n chunks lets the compute of
chunk j overlap the transfer of chunk j+1. Per chunk:

    t_a = alpha + transfer / n      (one all-to-all chunk: latency + bytes / bandwidth)
    t_c = compute / n

Dispatch and combine share the network, so the network needs 2 t_a per chunk and the compute t_c;
the slower of the two sets the pace after the first chunk has gone through all three stages:

    time(n) = 2 t_a + t_c + (n - 1) * max(t_c, 2 t_a)

n = 1 is the unchunked layer (2 alpha + 2 transfer + compute). When compute dominates, chunking
hides transfer; when latency dominates, every extra chunk costs 2 alpha. With alpha > 0 the network-
bound branch is 2 n alpha + 2 transfer + compute / n, minimal at sqrt(compute / (2 alpha)); see
`optimal_chunks_continuous`.

Priority (Lina): a gradient all-reduce micro-op is launched only when no all-to-all is queued, so
an all-to-all waits behind at most one micro-op; under fair sharing it runs at a fraction of the
bandwidth for as long as the all-reduce is active.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import sympy

from cost_model.symbols import smax

DEFAULT_CHUNKS = (1, 2, 4, 8, 16, 32)


def pipeline_time(n, transfer, compute, alpha):
    """Seconds of one chunked layer pass (see the module docstring)."""
    t_a = alpha + transfer / n
    t_c = compute / n
    return 2 * t_a + t_c + (n - 1) * smax(t_c, 2 * t_a)


def exposed_a2a(n, transfer, compute, alpha):
    """The part of `pipeline_time` not hidden behind compute."""
    return pipeline_time(n, transfer, compute, alpha) - compute


def optimal_chunks(transfer: float, compute: float, alpha: float, candidates: Iterable[int] = DEFAULT_CHUNKS) -> int:
    """argmin over `candidates` of the forward + backward pipeline time (ties: fewer chunks)."""

    def total(n: int) -> float:
        return float(pipeline_time(n, transfer, compute, alpha) + pipeline_time(n, transfer, 2 * compute, alpha))

    return min(sorted(candidates), key=total)


def optimal_chunks_continuous(transfer, compute, alpha):
    """The real-valued argmin of `pipeline_time` (forward pass), for alpha > 0.

    While compute-bound (n <= (compute - 2 transfer) / (2 alpha)) the time 2 alpha + 2 transfer/n +
    compute falls with n; once network-bound it is 2 n alpha + 2 transfer + compute/n, minimal at
    sqrt(compute / (2 alpha)). The optimum is the larger of the two points.
    """
    if isinstance(transfer + compute + alpha, sympy.Basic):
        return sympy.Max(sympy.sqrt(compute / (2 * alpha)), (compute - 2 * transfer) / (2 * alpha))
    return max(math.sqrt(compute / (2 * alpha)), (compute - 2 * transfer) / (2 * alpha))


def priority_wait(micro_op_bytes, B, alpha):
    """Worst-case delay of an all-to-all under priority: one all-reduce micro-op already in flight."""
    return alpha + micro_op_bytes / B
