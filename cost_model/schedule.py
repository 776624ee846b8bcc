"""Lina's chunked, pipelined and prioritised all-to-all: time as a function of the chunk count n.

One MoE layer pass (forward, or backward with twice the compute) is a three-stage flow: dispatch
all-to-all, expert compute, combine all-to-all. Cutting the tokens into n chunks lets the compute of
chunk j overlap the transfer of chunk j+1. Per chunk:

    t_a = alpha + transfer / n      (one all-to-all chunk: latency + bytes / bandwidth)
    t_c = compute / n

Dispatch and combine share the network, so the network needs 2 t_a per chunk and the compute t_c;
the slower of the two sets the pace after the first chunk has gone through all three stages:

    time(n) = 2 t_a + t_c + (n - 1) * max(t_c, 2 t_a)

n = 1 is the unchunked layer (2 alpha + 2 transfer + compute). The backward is pipelined the same
way (moepass/runtime/collectives.py, "Pipelined backward"), the expert backward as the compute.
When compute dominates, chunking hides transfer; when latency dominates, every extra chunk costs 2 alpha. With alpha > 0 the network-
bound branch is 2 n alpha + 2 transfer + compute / n, minimal at sqrt(compute / (2 alpha)); see
`optimal_chunks_continuous`.

Priority (Lina): a gradient all-reduce micro-op is launched only when no all-to-all is queued, so
an all-to-all waits behind at most one micro-op; under fair sharing it runs at a fraction of the
bandwidth for as long as the all-reduce is active.

Contention (`a2a_with_allreduce`, `lina_ablation`): one MoE layer's backward while the dense gradient
all-reduce wants the same link for `allreduce` seconds (its bytes / bandwidth). Fair share: while
both are active each gets half the link, so an all-to-all of t seconds takes t + min(t, r) with r
the all-reduce seconds left during it. Priority: it waits for the all-reduce unit already in flight
(a whole DDP bucket without partitioning, one micro-op with it), then has the link alone: t + min(u,
r). Pipelined, each of the 2n all-to-all chunks may wait one micro-op, at most the all-reduce's
seconds in all. These are worst cases (an all-reduce unit in flight whenever an all-to-all starts).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import sympy

from cost_model.symbols import smax, smin

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


def a2a_with_allreduce(transfer, allreduce, policy: str, unit=0.0):
    """Seconds an all-to-all of `transfer` seconds (alone on the link) takes while a gradient all-reduce
    with `allreduce` seconds of traffic wants the link: policy "fair" (half the link each while both
    run) or "priority" (waits for one in-flight unit of `unit` seconds, then alone)."""
    if policy == "fair":
        return transfer + smin(transfer, allreduce)
    if policy == "priority":
        return transfer + smin(unit, allreduce)
    raise ValueError(f"a2a_with_allreduce(policy={policy!r}) is invalid: use 'fair' or 'priority'")


def lina_ablation(transfer, compute, alpha, allreduce, bucket, micro_op, packed_transfer=None,
                  candidates: Iterable[int] = DEFAULT_CHUNKS) -> dict[str, tuple[float, int]]:
    """Backward seconds of one MoE layer (dispatch- and combine-backward of `transfer` seconds each,
    expert backward `compute`) with a concurrent dense all-reduce of `allreduce` seconds, adding Lina's
    ingredients one at a time -> {row: (seconds, chunks)}: "plain" (fair share, one chunk), "priority"
    (whole `bucket` units), "+ partitioning" (`micro_op` units), "+ pipelining" (best n of `candidates`),
    "+ packing" (the same with `packed_transfer`, the packed layout's transfer). Worst cases (module doc)."""

    def serial(units: float, policy: str, per_a2a: float) -> float:
        return float(2 * alpha + 2 * a2a_with_allreduce(transfer, per_a2a, policy, units) + compute)

    def pipelined(t: float) -> tuple[float, int]:
        def time(n: int) -> float:
            return float(pipeline_time(n, t, compute, alpha) + min(2 * n * micro_op, allreduce))

        best = min(sorted(candidates), key=time)
        return time(best), best

    rows = {"plain": (serial(0.0, "fair", allreduce / 2), 1),  # the all-reduce overlaps both directions
            "priority": (serial(bucket, "priority", allreduce), 1),
            "+ partitioning": (serial(micro_op, "priority", allreduce), 1),
            "+ pipelining": pipelined(transfer)}
    rows["+ packing"] = pipelined(transfer if packed_transfer is None else packed_transfer)
    return rows
