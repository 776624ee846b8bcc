"""Lina's chunked, pipelined and prioritised all-to-all: time as a function of the chunk count n.

One MoE layer pass (forward, or backward with twice the compute) is a three-stage flow: dispatch
all-to-all, expert compute, combine all-to-all. Cutting the tokens into n chunks lets the compute of
chunk j overlap the transfer of chunk j+1. Per chunk:

    t_a = alpha + transfer / n      (one all-to-all chunk: latency + bytes / bandwidth)
    t_c = compute / n

Dispatch and combine share one network stream, issued d0 d1 c0 d2 c1 ... d(n-1) c(n-2) c(n-1) (the
schedule pass's order, `moepass.passes.schedule`). The pass then takes the longest of three paths:

    time(n) = max(2 t_a + n t_c,                  compute-bound: first dispatch, n chunks, last combine
                  2 (n - 1) t_a + min(n, 2) t_c,  the network waits for chunk 0's and the last chunk's compute
                  2 n t_a)                        network-bound: 2n chunks back to back

which is exact for that issue order on one serial network stream (tests/test_cost_model_lina.py checks
it against `cost_model.timeline`). n = 1 is the unchunked layer (2 alpha + 2 transfer + compute). The
backward is pipelined the same way (moepass/runtime/collectives.py, "Pipelined backward"), the expert
backward as the compute. When compute dominates, chunking hides transfer; when latency dominates,
every extra chunk costs 2 alpha; see `optimal_chunks_continuous`.

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

What the plan search prices (`cost_model.ep.ep_step`) is sharper: under priority a piece starts only
in the link's idle gaps before a combine, so the pass loses what the gaps leave of the pieces
(`wait_in_gap`, `pipelined_priority_wait`); `cost_model.simulate`'s timeline is the reference
(tests/test_cost_model_lina.py: the search's chunks and packing are its best within 2.5 %).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import sympy

from cost_model.symbols import sceil, smax, smin, spositive

DEFAULT_CHUNKS = (1, 2, 4, 8, 16, 32)
POLICIES = ("fair", "priority")  # how the all-to-all and the gradient all-reduce share a link
DDP_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket_cap_mb=25: the all-reduce unit under "fair"


def pipeline_time(n, transfer, compute, alpha):
    """Seconds of one chunked layer pass (see the module docstring)."""
    t_a = alpha + transfer / n
    t_c = compute / n
    return smax(2 * t_a + n * t_c, 2 * (n - 1) * t_a + smin(n, 2) * t_c, 2 * n * t_a)


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

    The compute-bound path f1 = 2 alpha + 2 transfer/n + compute falls with n, the network-bound f3 =
    2 n alpha + 2 transfer grows, and the middle f2 = 2 (n-1) alpha + 2 transfer (n-1)/n + 2 compute/n
    is convex with its minimum at sqrt((compute - transfer) / alpha) (it only grows when compute <=
    transfer). The argmin of their maximum is that minimum, or where f1 crosses f2 (the positive root of
    2 alpha n^2 + (2 transfer - 4 alpha - compute) n + 2 compute - 4 transfer), or where f1 crosses f3
    (of 2 alpha n^2 + (2 transfer - 2 alpha - compute) n - 2 transfer). Symbolically: the larger of the
    first two (f3 below f2 there, i.e. alpha < compute - transfer).
    """
    b12, c12 = 2 * transfer - 4 * alpha - compute, 2 * compute - 4 * transfer
    b13 = 2 * transfer - 2 * alpha - compute
    if isinstance(transfer + compute + alpha, sympy.Basic):
        root = (-b12 + sympy.sqrt(b12**2 - 8 * alpha * c12)) / (4 * alpha)
        return sympy.Max(sympy.sqrt(smax(0, compute - transfer) / alpha), root)
    points = [math.sqrt(max(0.0, compute - transfer) / alpha),
              (-b12 + math.sqrt(max(0.0, b12**2 - 8 * alpha * c12))) / (4 * alpha),
              (-b13 + math.sqrt(b13**2 + 16 * alpha * transfer)) / (4 * alpha)]
    return min((p for p in points if p > 0), key=lambda p: float(pipeline_time(p, transfer, compute, alpha)))


def priority_wait(micro_op_bytes, B, alpha):
    """Worst-case delay of an all-to-all under priority: one all-reduce micro-op already in flight."""
    return alpha + micro_op_bytes / B


def wait_in_gap(gap, unit, queued):
    """(seconds, all-reduce seconds used) of an all-to-all ready `gap` seconds after the link went idle,
    while `queued` seconds of all-reduce wait in pieces of at most `unit` seconds under priority: they
    start back to back from the idle moment (ceil(gap / unit) of them, the last one the shorter), and
    the all-to-all waits for the one in flight when it is ready (none when they are all done by then)."""
    if not isinstance(unit, sympy.Basic) and unit <= 0:
        return 0, 0  # nothing queued
    idle = spositive(gap)
    used = smin(smax(0, queued), sceil(gap / unit) * unit) * idle
    return smax(0, used - gap) * idle, used


def pipelined_priority_wait(n: int, t_a, t_c, unit, allreduce, in_flight=0, in_flight_used=0):
    """Seconds one pipelined pass (n chunks: all-to-all chunks of t_a, expert chunks of t_c, issued as in
    the module doc) is delayed by a gradient all-reduce of `allreduce` seconds queued as pieces of at most
    `unit` seconds under priority: a piece starts only while no all-to-all is ready or running, and is
    not pre-empted.

    The link idles before a combine while its expert chunk computes: g_0 = t_c - t_a before the first
    (t_c when n = 1), g = t_c - 2 t_a before the middle ones (none when <= 0: network-bound), g_0 less the
    wait before it before the last; the combine waits for the piece started in the gap (`wait_in_gap`).
    What that costs the pass:

    - `in_flight`: a piece running when the pass starts (`in_flight_used` seconds of the all-reduce);
    - the first combine's wait w_0, less the gap of the next one, which the next expert chunk fills
      (g_0 - w_0 is the last one's gap when n = 2; g otherwise; nothing fills it when n = 1);
    - the middle combines, while the all-reduce lasts: in the steady state the link never idles, so a
      chunk takes 2 t_a + p u for a piece rate p >= g/u: p = k/(k+1), k = ceil(g/(u - g)), when a piece
      is longer than the gap (each wait shortens the next gap: k waits, then a combine without one),
      p = g/u when pieces fit in the gaps; the compute stalls p u - g per chunk;
    - the last combine's wait: nothing left to overlap it.
    """
    if not isinstance(unit, sympy.Basic) and unit <= 0:
        return in_flight  # no all-reduce: nothing to wait for
    left = allreduce - in_flight_used
    if n == 1:
        wait, _ = wait_in_gap(t_c, unit, left)
        return in_flight + wait
    g_0, g = t_c - t_a, t_c - 2 * t_a
    w_0, used = wait_in_gap(g_0, unit, left)
    left = left - used
    first = smax(0, w_0 - smax(0, g_0 if n == 2 else g))
    if n == 2:
        last, _ = wait_in_gap(g_0 - w_0, unit, left)
        return in_flight + first + last
    symbolic = isinstance(g - unit, sympy.Basic)  # then assume compute-bound, a piece longer than the gap
    if not symbolic and g <= 0:
        middle, used = 0, 0
    else:
        k = sceil(g / (unit - g)) if symbolic or g < unit else 1
        rate = k / (k + 1) if symbolic or g < unit else g / unit
        chunks = smin(n - 2, smax(0, left) / (rate * unit))
        middle, used = smax(0, rate * unit - g) * chunks, rate * unit * chunks
    last, _ = wait_in_gap(g_0, unit, left - used)
    return in_flight + first + middle + last


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
