"""Expert parallel (EP): compute, all-to-all bytes and memory per rank.

Pure formula functions over the symbols of `cost_model.symbols`: pass symbols to get a sympy
expression, numbers to get a number. The last section counts bytes *exactly* from a routed-row
matrix, with the same conventions the runtime's counters use:

- dispatch: rank r sends the rows routed to experts on OTHER ranks of its EP group; rows routed to
  its own experts stay local and are not counted. Each row is D elements x b bytes.
- combine: the same counts travel back (dst -> src). The backward pass repeats both.
- under uniform routing that is K*T*D*(ep-1)/ep elements per rank per direction.

Zero-compute experts (LongCat-Flash: identity or zero experts beside the E FFN experts, R router
choices in all): only the phi share of the T*K assignments that picks an FFN expert is sent and computed
(`cost_model.symbols.phi`, E/R under uniform routing; 1 without them), so every routed-row figure below
is T*K*phi: the formulas take it as the optional figure "phi" or in `factor`.

EP groups are `ep` consecutive ranks (the innermost mesh dimension), nodes are `G` consecutive
ranks, and experts are placed contiguously: expert e lives on rank e // (E/ep) of its group.

Shape letters: `moepass.spec.SHAPES` (here P: ranks as sources and as destinations; numpy arrays).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import sympy

from cost_model.helper_cpu import thread_cpu, thread_figures
from cost_model.symbols import smax, smin, spositive

FWD_BWD = 3  # backward costs twice the forward: d(input) and d(weight) GEMMs
A2A_PER_LAYER = 4  # dispatch + combine, forward and backward


# ---- compute ------------------------------------------------------------------------------------


def matmuls(gated: bool) -> int:
    """Matmuls per expert FFN: gate, up, down when gated (SwiGLU, GeGLU); up, down otherwise."""
    return 3 if gated else 2


def routed_rows(T, K, *, rho=1, cf=None, phi=1):
    """Rows the busiest rank computes per layer.

    Dropless (cf None): its share of the T*K*phi routed FFN rows times the imbalance rho = max/mean.
    Capacity: static buffers of cf*T*K*phi/E slots per expert, computed whether full or not (padding).
    `phi`: the share of the assignments that reach FFN experts (module doc).
    """
    return T * K * phi * (rho if cf is None else cf)


def expert_flops(rows, D, F, m):
    """Forward FLOPs of the expert FFNs over `rows` routed rows: m matmuls of D x F, 2 FLOPs each."""
    return 2 * rows * D * F * m


def compute_time(rows, D, F, m, R, eta, *, recompute=0):
    """Forward + backward expert GEMM time on one rank.

    `recompute` = 1 when the backward recomputes the m-1 input-side GEMMs (gate, up) instead of keeping
    their outputs, so a step costs 3 + (m-1)/m forward passes of GEMMs instead of 3: the torch expert
    FFN (`moepass.grouped_ffn`) under `Plan(expert_recompute=True)`, and the Triton grouped GEMM
    (`lowering/grouped_gemm/`), which recomputes in registers. By default the torch path keeps them.
    """
    return (FWD_BWD + recompute * (m - 1) / m) * expert_flops(rows, D, F, m) / (R * eta)


HOST_FIGURES = ("c_layer", "c_expert", "c_row", "c_act", "c_page", "n_f", "c_route")  # `host_time`'s keywords


def host_figures(x: dict[str, Any]) -> dict[str, Any]:
    """`host_time`'s calibrated figures (and n_f) from a figure dict, 0 where absent."""
    return {name: x.get(name, 0) for name in HOST_FIGURES}


ROW_OPS_ROUTED, ROW_OPS_RECEIVED = 3, 2  # the row chain's ops on a rank's own routed rows / on its experts' rows


def host_time(rows, D, F, E, ep, *, c_layer=0, c_expert=0, c_row=0, c_act=0, c_page=0, n_f=0, c_route=0, tokens=0,
              routed=None):
    """Host-side time of one EP layer step (forward + backward) that is not GEMM FLOPs or all-to-all
    transfer; zero unless calibrated (`cost_model.calibrate`, CPU):

    - c_layer: fixed seconds per layer step: graph interpretation, router, top-k, host syncs for the
      split sizes, DTensor wrapping of the sharded weights (the EP layer's intercept at vanishing size,
      minus its 5 all-to-all latencies, which `alpha` models);
    - c_expert: seconds per local expert (E/ep of them): the per-expert loop of the expert FFN kernel
      forward and backward (~20 op launches per expert besides its GEMMs; `cost_model.calibrate_ffn`);
    - c_row: seconds per routed element and op of the row chain around the experts (permute, local permute,
      unpermute x2, weighted combine, forward and backward: memory traffic), times 5 in the calibration. Three of
      the five run on the rank's own routed rows before they leave it (`routed`: T*K*phi, the tokens' top-k
      assignments, those a capacity drops included -- the permute gathers them all and the combine reads them
      all back; default `rows`), the local permute and unpermute on the `rows` its experts compute;
    - c_act: seconds per hidden element (rows x F): the expert FFN's work beyond its GEMMs on [rows, F]
      tensors -- act(gate) * up forward, again when the backward recomputes it, its backward, the copies and
      in-place products around them: memory traffic the GEMM FLOPs do not count (the same calibration);
    - c_page: seconds per minor page fault, times n_f, the faults of one step (host memory touched for the first
      time: on a CPU, glibc returns large freed blocks to the OS and the next step faults them in again; how
      many depends on the allocator's state, so n_f is an input, 0 when absent; a GPU's caching allocator
      keeps its pages);
    - c_route: seconds per routed token (`tokens`: T, or T*H sub-tokens under HP): the router's gate GEMM and
      `moe.route` (score, top-k, renormalise) forward and backward, per-token work of a few elements that the
      per-element terms do not count.
    """
    chain = (ROW_OPS_ROUTED * (rows if routed is None else routed) + ROW_OPS_RECEIVED * rows) / (
        ROW_OPS_ROUTED + ROW_OPS_RECEIVED)
    return c_layer + c_expert * E / ep + c_row * chain * D + c_act * rows * F + c_page * n_f + c_route * tokens


# ---- all-to-all under uniform routing ------------------------------------------------------------


def a2a_elements(T, K, D, ep, *, factor=1):
    """Elements one rank sends per all-to-all direction: the rows bound for the other ep-1 ranks.

    `factor` scales the routed rows: rho for the busiest rank, cf for padded capacity buffers, times phi
    with zero-compute experts (module doc).
    """
    return factor * K * T * D * (ep - 1) / ep


def peer_split(ep, G):
    """(intra-node peers, inter-node peers) of a rank in an EP group of `ep` consecutive ranks."""
    local = smin(ep, G)
    return local - 1, ep - local


def a2a_bytes(T, K, D, ep, G, b, *, factor=1):
    """(intra-node bytes, inter-node bytes) one rank sends per direction under uniform routing."""
    intra, inter = peer_split(ep, G)
    per_peer = factor * K * T * D * b / ep
    return per_peer * intra, per_peer * inter


def a2a_time(intra_bytes, inter_bytes, B_intra, B_inter, alpha):
    """One all-to-all: one latency plus each link's bytes over its bandwidth (links summed, like
    LAER's T_comm = sum over destinations of bytes / bw)."""
    return alpha + intra_bytes / B_intra + inter_bytes / B_inter


# ---- parameters, gradient all-reduce, memory -------------------------------------------------------


def expert_params(E, D, F, m):
    """Expert parameters of one layer (weights only, no biases)."""
    return E * m * D * F


def allreduce_figures(x: dict[str, Any], B: Any) -> tuple[Any, Any]:
    """(bandwidth, latency) of a gradient all-reduce over a link of bandwidth `B`: capped by the all-reduce's own
    rate B_r and at its own latency alpha_r where the figure dict has them (gloo on a CPU reduces on its own thread
    and waits for the peer at every ring step: `cost_model.calibrate_allreduce`), else B and the all-to-all's alpha."""
    rate = x.get("B_r")
    return (B if rate is None else smin(B, rate)), x.get("alpha_r", x["alpha"])


def allreduce_time(nbytes, dp, B, alpha):
    """All-reduce of `nbytes` over dp ranks: one call's latency plus the ring's 2(dp-1)/dp bytes per rank
    (NCCL/gloo pipeline the ring steps and bucket the gradients, so the latency is paid per call)."""
    if not isinstance(dp, sympy.Basic) and dp == 1:
        return 0
    return alpha + 2 * (dp - 1) * nbytes / (dp * B)


def memory_per_rank(E, ep, D, F, m, s, rows, b):
    """Bytes one rank holds for one layer: its E/ep experts' weights, grads and optimizer state
    (s bytes per parameter) plus the activations kept for backward (estimate): the received rows
    (D), the m-1 or 1 hidden tensors of width F plus the activation output, and the combine input (D)."""
    return expert_params(E, D, F, m) / ep * s + rows * (2 * D + m * F) * b


# ---- one layer, one plan -----------------------------------------------------------------------


@dataclass(frozen=True)
class LayerTerms:
    """Seconds (and bytes for memory) of one MoE layer per step on the busiest rank."""

    compute: Any
    a2a_exposed: Any
    other_comm: Any
    memory: Any
    a2a_bytes: Any  # bytes sent per rank per direction (intra + inter), forward dispatch
    host: Any = 0  # host_time: fixed/per-expert/per-row overheads (0 unless calibrated)
    threads: Any = 0  # helper-thread CPU on an oversubscribed node (`cost_model.helper_cpu`; 0 otherwise)

    @property
    def step(self) -> Any:
        return self.compute + self.a2a_exposed + self.other_comm + self.host + self.threads

    def __add__(self, other: LayerTerms) -> LayerTerms:
        return LayerTerms(*(a + o for a, o in zip(self._tuple(), other._tuple())))

    def _tuple(self) -> tuple[Any, ...]:
        return (self.compute, self.a2a_exposed, self.other_comm, self.memory, self.a2a_bytes, self.host, self.threads)


def dense_flops(T, D, q=0):
    """Forward FLOPs of a layer's dense part: the four D x D attention projections and the scores (q keys
    per token, q = 0 when the sequence length is unknown)."""
    return 2 * T * (4 * D**2 + q * D)


def pieces(nbytes, unit=None):
    """How many pieces of at most `unit` bytes carry `nbytes` (None: one)."""
    if unit is None:
        return 1
    return sympy.ceiling(nbytes / unit) if isinstance(nbytes + unit, sympy.Basic) else max(1, math.ceil(nbytes / unit))


def allreduce_calls(nbytes, dp, unit=None):
    """Collective calls of an all-reduce of `nbytes` over dp ranks in pieces of at most `unit` bytes: none when
    there is nothing to reduce (dp = 1 or no bytes)."""
    if not isinstance(dp + nbytes, sympy.Basic) and (dp == 1 or nbytes == 0):
        return 0
    return pieces(nbytes, unit)


def allreduce_sent(nbytes, dp):
    """Bytes one rank sends in a ring all-reduce of `nbytes` over dp ranks: 2 (dp - 1) / dp of them."""
    return 2 * (dp - 1) * nbytes / dp


def bucketed_allreduce(nbytes, dp, B, alpha, unit=None):
    """(seconds, seconds of one piece) of an all-reduce of `nbytes` sent as equal pieces of at most `unit`
    bytes (DDP buckets, Lina's micro-ops; None: one call), each one call of `allreduce_time`."""
    if unit is None:
        whole = allreduce_time(nbytes, dp, B, alpha)
        return whole, whole
    count = pieces(nbytes, unit)
    piece = allreduce_time(nbytes / count, dp, B, alpha)
    return count * piece, piece


@dataclass(frozen=True)
class BackwardLink:
    """What one EP layer's backward puts on the link it shares with the gradient all-reduce, in seconds.

    window: the layer's backward on the compute stream (pipelined expert backward + dense backward), before
    any wait; link: its all-to-all's link time (2n latencies + dispatch and combine transfer), t_a and t_c
    per chunk (all-to-all, expert backward); expert_ar, dense_ar: the all-reduces of its expert-replica
    gradients (over dp, released after its expert backward) and of its dense gradients (over W, released
    after its dense backward), in pieces of expert_unit and dense_unit; dense_bwd: its dense backward."""

    window: Any
    link: Any
    t_a: Any
    t_c: Any
    expert_ar: Any
    dense_ar: Any
    expert_unit: Any
    dense_unit: Any
    dense_bwd: Any

    @property
    def unit(self) -> Any:
        return smax(self.expert_unit, self.dense_unit)

    @property
    def allreduce(self) -> Any:
        return self.expert_ar + self.dense_ar

    @property
    def tail(self) -> Any:
        """The all-reduce left when this is the last layer: the dense one, and what the dense backward
        does not hide of the expert one."""
        return self.dense_ar + smax(0, self.expert_ar - self.dense_bwd)

    def wait(self, before: BackwardLink, n: int, policy: str, backlog: Any = 0) -> Any:
        """Seconds this layer's backward all-to-all loses to the all-reduce `before` (the layer whose
        backward ran just before) released: fair share, min(link, all-reduce) (`a2a_with_allreduce`);
        priority, `pipelined_priority_wait`, its first dispatch behind the piece started in `before`'s
        dense backward, if `before`'s expert all-reduce or a `backlog` (seconds of all-reduce still
        queued when `before`'s backward ended) was queued then."""
        from cost_model.schedule import a2a_with_allreduce, pipelined_priority_wait, wait_in_gap

        if policy == "fair":
            return a2a_with_allreduce(self.link, before.allreduce, "fair") - self.link
        in_flight, used = wait_in_gap(before.dense_bwd, smax(before.expert_unit, spositive(backlog) * before.unit),
                                      before.expert_ar + backlog)
        return pipelined_priority_wait(n, self.t_a, self.t_c, before.unit, before.allreduce + backlog, in_flight, used)

    def backlog(self, before: BackwardLink, wait: Any) -> Any:
        """Seconds of `before`'s all-reduce still queued when this layer's backward (delayed by `wait`) ends."""
        return smax(0, self.link + before.allreduce - self.window - wait)


def dense_allreduce_tail(x: dict[str, Any], W: int, *, cross_node: bool) -> Any:
    """Seconds of the dense all-reduce of one layer (P_d elements over the W ranks, in pieces of u bytes)
    that no compute hides when it is the last to run its backward: every form pays it."""
    B, alpha = allreduce_figures(x, x["B_inter"] if cross_node else x["B_intra"])
    dense_bytes = x.get("P_d", 0) * x["b_g"]
    if not isinstance(dense_bytes, sympy.Basic) and dense_bytes == 0:
        return 0
    return bucketed_allreduce(dense_bytes, W, B, alpha, x.get("u"))[0]


def ep_layer(x: dict[str, Any], *, ep: int, n: int, dp: int, dropless: bool, cross_node_dp: bool,
             policy: str = "fair", deferred_wgrad: bool = True) -> LayerTerms:
    """Step terms of a model of one EP layer (ep = 1: every rank keeps all experts; no all-to-all): `ep_step`
    of [x]."""
    return ep_step([x], ep=ep, n=n, dp=dp, dropless=dropless, cross_node_dp=cross_node_dp, policy=policy,
                   deferred_wgrad=deferred_wgrad)


def ep_step(xs: list[dict[str, Any]], *, ep: int, n: int, dp: int, dropless: bool | list[bool], cross_node_dp: bool,
            policy: str = "fair", deferred_wgrad: bool = True) -> LayerTerms:
    """Step terms of a model of EP layers `xs` (forward order), summed, with the gradient all-reduce's
    contention with the all-to-all on the link they share.

    Each `x` maps symbol names of `cost_model.symbols` to numbers or symbols (T, K, D, F, m, E, G, b,
    b_g, s, B_intra, B_inter, alpha, R, eta, rho, c_f; optionally the calibrated host figures c_layer,
    c_expert, c_row, c_act, c_page (with n_f, a step's page faults), c_route and the kernel's recompute flag r_c, see
    `host_time` and `compute_time`, 0 when absent; the helper-thread figures c_xb, c_xc, n_core, n_help, n_rank,
    see `cost_model.helper_cpu`, no helper CPU when absent; P_d the dense parameters per layer, all-reduced over
    W = ep * dp, 0 when absent; q the sequence length, 0 when absent; u the all-reduce unit in bytes, one call per all-reduce when absent;
    phi the share of the T*K assignments that reach FFN experts, 1 when absent: the routed rows, their
    bytes, compute and activations are T*K*phi times rho or c_f).
    The discrete plan choices (ep, n, dp, dropless: one for all or one per layer, policy) are Python
    values, so the result is a closed formula for that plan.

    Both passes are pipelined over n chunks (`cost_model.schedule.pipeline_time`). The gradient
    all-reduces run during the backward on the link the all-to-all uses (one link, as in
    `cost_model.simulate`), a layer's released during the next layer's backward:

    - every backward layer but the first loses `BackwardLink.wait` to the all-reduce released before it:
      fair share, its all-to-all slowed by min(link, all-reduce); priority, each wait behind at most one
      piece of u bytes (`cost_model.schedule.pipelined_priority_wait`), at most the all-reduce in all;
    - the link has window + wait - link seconds free per layer; the all-reduce not carried in the free
      time from the first release on is exposed, and at least the last layer's `BackwardLink.tail` is:

          other = max(tail_0, sum_l allreduce_l - dense_bwd_last - sum_{l < L-1} (window_l + wait_l - link_l))

      (the two regimes of the queue: it empties in every layer, or it never does).
    """
    if policy not in ("fair", "priority"):
        raise ValueError(f"ep_step(policy={policy!r}) is invalid: use 'fair' or 'priority'")
    flags = dropless if isinstance(dropless, list) else [dropless] * len(xs)
    alone = [ep_alone(x, ep=ep, n=n, dp=dp, dropless=d, cross_node_dp=cross_node_dp, deferred_wgrad=deferred_wgrad)
             for x, d in zip(xs, flags)]
    terms = [t for t, _ in alone]
    links = [link for _, link in alone]
    waits: list[Any] = [0] * len(xs)
    backlog: Any = 0  # of the all-reduce released before the layer that ran before
    for layer in reversed(range(len(xs) - 1)):  # the backward runs last to first; the first finds no all-reduce
        if ep > 1:
            waits[layer] = links[layer].wait(links[layer + 1], n, policy, backlog)
        # what this layer leaves queued, from its wait without a backlog (a closed form per layer, not a chain)
        unqueued = links[layer].wait(links[layer + 1], n, policy) if ep > 1 and backlog != 0 else waits[layer]
        backlog = links[layer].backlog(links[layer + 1], unqueued)
    free = sum(link.window + wait - link.link for link, wait in zip(links[:-1], waits[:-1]))
    queued = sum(link.allreduce for link in links) - links[-1].dense_bwd - free
    other = smax(links[0].tail, queued)
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return LayerTerms(compute=total.compute, a2a_exposed=total.a2a_exposed + sum(waits), other_comm=other,
                      memory=total.memory, a2a_bytes=total.a2a_bytes, host=total.host, threads=total.threads)


def ep_alone(x: dict[str, Any], *, ep: int, n: int, dp: int, dropless: bool, cross_node_dp: bool,
             deferred_wgrad: bool = True) -> tuple[LayerTerms, BackwardLink]:
    """One EP layer alone on its links (no all-reduce: other_comm 0) and what its backward puts on the link.

    `deferred_wgrad` (Lancet, `moepass.schedule.defer_weight_grads`, applied by the EP and locality schedules): each
    chunk's weight-gradient GEMMs (one per forward GEMM, the forward's FLOPs) run while its dispatch-backward
    all-to-all is in flight, so the backward pipeline's last exchange hides behind them (at most one chunk's weight
    GEMMs' worth; never below the link's own 2 n t_a); its helper threads' CPU is paid, its busy-core wait only for
    what those GEMMs leave uncovered after its link time. Both directions exchange the split sizes first (a small
    all-to-all): a capacity's kept rows per destination vary as a dropless layer's do. Every piece of the gradient
    all-reduces (expert replicas over dp, dense parameters over W, u bytes each) is a collective call on the same
    helper threads, priced like an exchange (`allreduce_calls`, `allreduce_sent`); their link time is at the
    all-reduce's own figures where the figure dict has them (`allreduce_figures`)."""
    from cost_model.schedule import pipeline_time

    factor = (x["rho"] if dropless else x["c_f"]) * x.get("phi", 1)  # rows over T*K: FFN share, skew or padding
    rows = x["T"] * x["K"] * factor
    compute = compute_time(rows, x["D"], x["F"], x["m"], x["R"], x["eta"], recompute=x.get("r_c", 0))
    fwd_compute = compute_time(rows, x["D"], x["F"], x["m"], x["R"], x["eta"]) / FWD_BWD
    bwd_compute = compute - fwd_compute
    if ep > 1:
        intra, inter = a2a_bytes(x["T"], x["K"], x["D"], ep, x["G"], x["b"], factor=factor)
        transfer = intra / x["B_intra"] + inter / x["B_inter"]
        t_a = x["alpha"] + transfer / n
        bwd = pipeline_time(n, transfer, bwd_compute, x["alpha"])
        if deferred_wgrad:  # the last dispatch-backward in flight during its chunk's weight GEMMs
            bwd = smax(bwd - smin(fwd_compute / n, t_a), 2 * n * t_a)
        # + the split-size exchange before the dispatch (a small all-to-all)
        a2a = pipeline_time(n, transfer, fwd_compute, x["alpha"]) + bwd - compute + x["alpha"]
        sent = intra + inter
        link = 2 * (n * x["alpha"] + transfer)
    else:
        a2a, sent, bwd, link, t_a = 0, 0, bwd_compute, 0, 0
    B, ar_alpha = allreduce_figures(x, x["B_inter"] if cross_node_dp else x["B_intra"])
    grad_bytes = expert_params(x["E"], x["D"], x["F"], x["m"]) / ep * x["b_g"]
    expert_ar, expert_unit = bucketed_allreduce(grad_bytes, dp, B, ar_alpha, x.get("u"))
    dense_bytes = x.get("P_d", 0) * x["b_g"]
    dense_ar, dense_unit = bucketed_allreduce(dense_bytes, ep * dp, B, ar_alpha, x.get("u"))
    if not isinstance(dense_bytes, sympy.Basic) and dense_bytes == 0:
        dense_ar, dense_unit = 0, 0  # no dense parameters given: no all-reduce call
    # the transfer threads' CPU: dispatch and combine, forward and backward, n calls each, the split sizes and every
    # piece of the gradient all-reduces (collective calls on the same threads); the ranks wait among busy cores for
    # all of them but the deferred dispatch-backward, whose wait they pay only for what its chunk's weight GEMMs,
    # after its link time, leave uncovered
    ar_calls = allreduce_calls(grad_bytes, dp, x.get("u")) + allreduce_calls(dense_bytes, ep * dp, x.get("u"))
    ar_sent = allreduce_sent(grad_bytes, dp) + allreduce_sent(dense_bytes, ep * dp)
    threads: Any = 0
    figures = thread_figures(x) if ep > 1 or ar_calls != 0 else None
    if figures is not None:
        c_xb, c_xc, c_wb, c_wc = figures
        calls = A2A_PER_LAYER * n + 1 if ep > 1 else 0
        hidden = 1 if deferred_wgrad and ep > 1 else 0
        t_wait = thread_cpu((A2A_PER_LAYER - hidden) * sent + ar_sent, calls - hidden * n + ar_calls, c_wb, c_wc)
        if hidden:
            t_wait += n * smax(0, thread_cpu(sent / n, 1, c_wb, c_wc) - smax(0, fwd_compute / n - t_a))
        threads = smax(thread_cpu(A2A_PER_LAYER * sent + ar_sent, calls + ar_calls, c_xb, c_xc), t_wait)
    dense_bwd = 2 * dense_flops(x["T"], x["D"], x.get("q", 0)) / (x["R"] * x["eta"])
    memory = memory_per_rank(x["E"], ep, x["D"], x["F"], x["m"], x["s"], rows, x["b"])
    host = host_time(rows, x["D"], x["F"], x["E"], ep, tokens=x["T"], routed=x["T"] * x["K"] * x.get("phi", 1),
                     **host_figures(x))
    terms = LayerTerms(compute=compute, a2a_exposed=a2a, other_comm=0, memory=memory, a2a_bytes=sent, host=host,
                       threads=threads)
    return terms, BackwardLink(window=bwd + dense_bwd, link=link, t_a=t_a, t_c=bwd_compute / n, expert_ar=expert_ar,
                               dense_ar=dense_ar, expert_unit=expert_unit, dense_unit=dense_unit,
                               dense_bwd=dense_bwd)


# ---- exact counts from a routed-row matrix ----------------------------------------------------------


def rank_rows(counts_PE: np.ndarray, ep: int) -> np.ndarray:
    """[src rank, expert] routed rows -> [src rank, dst rank] rows (experts contiguous per rank)."""
    counts_PE = np.asarray(counts_PE)
    S, E = counts_PE.shape
    if E % ep:
        raise ValueError(f"experts E={E} must be a multiple of ep={ep} to place them contiguously")
    return counts_PE.reshape(S, ep, E // ep).sum(axis=2)


@dataclass(frozen=True)
class ExactA2A:
    """Per-rank rows and bytes of one all-to-all direction (the dispatch; combine is its transpose)."""

    sent_intra: np.ndarray  # [S] bytes each rank sends to other ranks on its node
    sent_inter: np.ndarray  # [S] bytes each rank sends to other nodes
    recv_intra: np.ndarray  # [R]
    recv_inter: np.ndarray  # [R]
    computed_rows: np.ndarray  # [R] rows each rank's experts process (local ones included)

    @property
    def sent(self) -> np.ndarray:
        return self.sent_intra + self.sent_inter

    def time(self, B_intra: float, B_inter: float, alpha: float) -> float:
        """The all-to-all ends when its slowest rank has sent and received everything."""
        send = a2a_time(self.sent_intra, self.sent_inter, B_intra, B_inter, alpha)
        recv = a2a_time(self.recv_intra, self.recv_inter, B_intra, B_inter, alpha)
        return float(max(send.max(), recv.max()))

    def transposed(self) -> ExactA2A:
        """The combine: same rows, opposite direction."""
        return ExactA2A(self.recv_intra, self.recv_inter, self.sent_intra, self.sent_inter, self.computed_rows)


def exact_a2a(rows_PP: np.ndarray, D: int, b: int, G: int) -> ExactA2A:
    """Bytes of the dispatch for a [src rank, dst rank] routed-row matrix of one EP group."""
    rows_PP = np.asarray(rows_PP, dtype=np.float64)
    S, Rn = rows_PP.shape
    if S != Rn:
        raise ValueError(f"rows_PP must be square [src rank, dst rank], got {rows_PP.shape}")
    node = np.arange(S) // G
    same_node = node[:, None] == node[None, :]
    off_diag = ~np.eye(S, dtype=bool)
    intra = np.where(same_node & off_diag, rows_PP, 0.0) * D * b
    inter = np.where(~same_node, rows_PP, 0.0) * D * b
    return ExactA2A(
        sent_intra=intra.sum(axis=1),
        sent_inter=inter.sum(axis=1),
        recv_intra=intra.sum(axis=0),
        recv_inter=inter.sum(axis=0),
        computed_rows=rows_PP.sum(axis=0),
    )


def imbalance(rows_PP: np.ndarray) -> float:
    """max / mean rows computed per rank."""
    computed = np.asarray(rows_PP, dtype=np.float64).sum(axis=0)
    return float(computed.max() / computed.mean())


def zipf_counts(T: int, K: int, E: int, ranks: int, s: float, *, seed: int = 0) -> np.ndarray:
    """[src rank, expert] routed rows when expert popularity follows Zipf(s): p_e ~ 1/rank^s.

    Popularity ranks are a fixed random permutation of the experts (seeded), so the hottest experts
    do not all land on rank 0. Every source rank routes T*K rows with the same distribution.
    """
    p = 1.0 / np.arange(1, E + 1, dtype=np.float64) ** s
    p = p[np.random.default_rng(seed).permutation(E)]
    return np.tile(T * K * p / p.sum(), (ranks, 1))


def zipf_for_imbalance(target: float, T: int, K: int, E: int, ep: int, *, seed: int = 0) -> float:
    """The Zipf parameter s whose placement on `ep` ranks gives max/mean = target (bisection)."""

    def ratio(s: float) -> float:
        return imbalance(rank_rows(zipf_counts(T, K, E, ep, s, seed=seed), ep))

    lo, hi = 0.0, 8.0
    if target <= 1.0:
        return 0.0
    if ratio(hi) < target:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) < target else (lo, mid)
    return (lo + hi) / 2
