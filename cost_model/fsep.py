"""FSEP (Fully Sharded Expert Parallel, LAER-MoE): the planner's step cost, the restore exchange and the
parameter memory per rank.

Pure formula functions over the symbols of `cost_model.symbols`, as in `cost_model.ep`: pass symbols
to get a sympy expression, numbers to get a number. `rows_cost` is the numeric planner cost of one
routed-row matrix; it reduces the matrix to the three integers the formula reads (`link_rows`), so
every rank that prices the same matrix gets the same float, whatever its reduction order.

The planner's cost of a placement (TECHNIQUES.md §2):

    cost = 4 * sum_i T_comm[i] + (3 + recompute) * max_k T_comp[k]
    T_comm[i] = sum_k rows[i, k] * bytes_per_token / bw(i, k)    bw(i, i) = inf, B_intra on i's node, B_inter off it
    T_comp[k] = time_per_token * sum_i rows[i, k]

(4: dispatch + combine, forward and backward; 3: forward + twice the forward for backward.) Because bw
takes two values, sum_i T_comm[i] = bytes_per_token * (Q_intra / B_intra + Q_inter / B_inter), with
Q_intra / Q_inter the rows sent within / across nodes (summed over sources) and Q_max = max_k rows.

Restore: every rank sends every device the r-th 1/W slice of each of the C experts it computes: C*S_e/W
elements per pair, forward (weights) and backward (weights again, then the gradient slices back). The
gradient slices' exchange is deferred (`moepass.runtime.fsep.DeferredReductions`): issued after a layer's
backward expert compute, completed when the next (earlier) layer's is issued, so it runs under that layer's
backward; only the first FSEP block's (the backward's last) is waited at once (`deferred_grad_time`).

What the planner makes of a routing (`moepass.runtime.placement.planned_routing`: its table and the routed
rows under it) and one FSEP layer's step terms in `cost_model.ep.LayerTerms` (`fsep_layer`) are what the plan search
(`cost_model.search`) prices FSEP with next to EP; the simulator (`cost_model.simulate`) lays the same
routed rows and restores on its timeline.

Shape letters: `moepass.spec.SHAPES` (here P: ranks or devices, as sources and as destinations; numpy arrays or
torch tensors).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cost_model import ep as ep_formulas
from cost_model.ep import A2A_PER_LAYER, FWD_BWD, LayerTerms, expert_flops, expert_params
from cost_model.helper_cpu import exposed_thread_cpu, planner_cpu
from cost_model.symbols import smax

# ---- per token ---------------------------------------------------------------------------------------


def token_bytes(D, b):
    """Bytes one routed row (token copy) carries in an all-to-all: D elements of b bytes."""
    return D * b


def token_time(D, F, m, R, eta):
    """Forward expert GEMM seconds per routed row: m matmuls of D x F at R*eta FLOP/s."""
    return expert_flops(1, D, F, m) / (R * eta)


def expert_elements(D, F, m):
    """S_e: elements of one expert's parameters (m matrices of D x F)."""
    return expert_params(1, D, F, m)


# ---- the planner's cost --------------------------------------------------------------------------------


def planner_cost(Q_intra, Q_inter, Q_max, bytes_per_token, time_per_token, B_intra, B_inter, *, recompute=0):
    """The planner's step cost of one placement (module docstring), from its three row totals.

    `recompute`: extra forward passes the backward spends recomputing (ep.compute_time's r_c*(m-1)/m).
    """
    comm = bytes_per_token * (Q_intra / B_intra + Q_inter / B_inter)
    return A2A_PER_LAYER * comm + (FWD_BWD + recompute) * time_per_token * Q_max


def link_rows(rows_PP: Any, ranks_per_node: int) -> tuple[int, int, int]:
    """(Q_intra, Q_inter, Q_max) of a [source rank, device] routed-row matrix, exact integers.

    Ranks are node-major (rank r on node r // ranks_per_node). Rows a source keeps on its own device
    cross no link and count in neither Q. A float matrix is summed in float64 and rounded.
    """
    rows = np.asarray(rows_PP.cpu() if hasattr(rows_PP, "cpu") else rows_PP)
    if rows.ndim != 2 or rows.shape[0] != rows.shape[1]:
        raise ValueError(f"rows_PP has shape {rows.shape}: expected [W, W] (source rank, device)")
    W = rows.shape[0]
    if ranks_per_node < 1 or W % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide the {W} ranks of rows_PP")
    rows = rows.astype(np.int64) if np.issubdtype(rows.dtype, np.integer) else np.rint(rows.astype(np.float64))
    N, G = W // ranks_per_node, ranks_per_node
    total = rows.sum()
    on_node = np.einsum("aiaj->", rows.reshape(N, G, N, G))  # the diagonal node blocks
    own = np.trace(rows)
    return int(on_node - own), int(total - on_node), int(rows.sum(axis=0).max())


def rows_cost(rows_PP: Any, ranks_per_node: int, bytes_per_token: float, time_per_token: float, B_intra: float,
              B_inter: float, *, recompute: float = 0.0) -> float:
    """The planner's cost (seconds) of a [source rank, device] routed-row matrix."""
    q_intra, q_inter, q_max = link_rows(rows_PP, ranks_per_node)
    return float(planner_cost(q_intra, q_inter, q_max, bytes_per_token, time_per_token, B_intra, B_inter,
                              recompute=recompute))


# ---- restore exchange -----------------------------------------------------------------------------------


def restore_elements(C, S_e, W):
    """Elements every pair of ranks exchanges in one restore: the 1/W slice of each of C experts."""
    return C * S_e / W


def restore_bytes(C, S_e, W, G, b):
    """(intra-node bytes, inter-node bytes) one rank sends in one restore (W-1 peers, G-1 of them on its node)."""
    per_peer = restore_elements(C, S_e, W) * b
    return per_peer * (G - 1), per_peer * (W - G)


def restore_time(C, S_e, W, G, b, B_intra, B_inter, alpha):
    """One restore all_to_all: a latency plus each link's bytes over its bandwidth (ep.a2a_time's convention)."""
    intra, inter = restore_bytes(C, S_e, W, G, b)
    return alpha + intra / B_intra + inter / B_inter


def restore_host_time(C, S_e, c_restore):
    """The restore's local work on the rank's own thread per step, besides its exchanges: the send buffer
    gathered from the shards (index_select + cat) and the C experts laid out from the received slices (forward,
    and again in the backward's `Restore.run`), the weights' gradients laid into the gradient send buffer and the
    received slices summed into the shards (`moepass.runtime.fsep_ops`): memory traffic over the C*S_e restored
    elements, `c_restore` seconds each per step (`cost_model.calibrate`'s restore benchmark runs those ops)."""
    return c_restore * C * S_e


def deferred_grad_time(t_grad, bwd_compute):
    """The exposed part of a deferred gradient-slice exchange of `t_grad` seconds: what the earlier layer's
    backward expert compute (`bwd_compute`, the same layer shape) does not hide."""
    return smax(0, t_grad - bwd_compute)


# ---- memory ------------------------------------------------------------------------------------------------


def param_elements_per_rank(E, W, C, S_e, *, prefetch=0):
    """Expert parameter elements one rank holds for one layer: its 1/W slice of all E experts plus the C
    experts it restores, plus `prefetch` * C for layers restored ahead (TECHNIQUES.md: (E*S)/W + C*S)."""
    return E * S_e / W + C * S_e + prefetch * C * S_e


def memory_per_rank(E, W, C, S_e, s, b, b_g, *, layers=1, prefetch=0, deferred_grads=False):
    """Expert bytes one rank holds: the shards of `layers` layers with their grads and optimizer state
    (s bytes per parameter), the restored experts of the current and `prefetch` next layers (b bytes per
    element) and the restored gradient of the current layer (b_g); `deferred_grads` (the runtime's default):
    plus the later layer's gradient slices in flight (their send and receive buffers, 2 C*S_e elements)."""
    grads = 3 if deferred_grads else 1
    return layers * E * S_e / W * s + (1 + prefetch) * C * S_e * b + grads * C * S_e * b_g


# ---- the EP reference layout (for comparisons) -----------------------------------------------------------


def ep_device_rows(counts_PE: Any, ep: int | None = None) -> np.ndarray:
    """[device] rows each rank computes under plain EP for [source rank, expert] counts.

    EP groups are `ep` consecutive ranks (data parallel over W/ep); device n computes experts
    [(n % ep) * E/ep, (n % ep + 1) * E/ep) for the sources of its group. `ep` defaults to the largest
    divisor of W that divides E (W itself when E is a multiple of W).
    """
    counts = np.asarray(counts_PE.cpu() if hasattr(counts_PE, "cpu") else counts_PE)
    W, E = counts.shape
    if ep is None:
        ep = max(d for d in range(1, W + 1) if W % d == 0 and E % d == 0)
    if W % ep or E % ep:
        raise ValueError(f"ep={ep} must divide both the ranks W={W} and the experts E={E}")
    per_group = counts.reshape(W // ep, ep, ep, E // ep).sum(axis=(1, 3))  # [group, device in group]
    return per_group.reshape(W)


# ---- what the planner makes of a routing --------------------------------------------------------------


def integer_rows(counts_PE: Any) -> np.ndarray:
    """Counts rounded to integers per row by largest remainder (each row keeps its rounded total; ties: lower
    expert), for the planner and lite routing, which split whole tokens."""
    counts = np.asarray(counts_PE, dtype=np.float64)
    out = np.floor(counts)
    short = np.rint(counts.sum(axis=1) - out.sum(axis=1)).astype(np.int64)
    order = np.argsort(-(counts - out), axis=1, kind="stable")
    for i, k in enumerate(short):
        out[i, order[i, :k]] += 1
    return out.astype(np.int64)


# ---- one layer, one plan ------------------------------------------------------------------------------------


def fsep_layer(x: dict[str, Any], *, W: int, C: int, n: int, rho: Any, a2a_rows: tuple[Any, Any],
               keep_restored: bool = False, deferred_grads: bool = False) -> LayerTerms:
    """Step terms of one dropless FSEP layer over W ranks with C slots per device, on the busiest rank, as
    `cost_model.ep.ep_layer` prices EP (`x`: the same symbol names, numbers or symbols).

    `rho`: the busiest device's routed rows over the mean T*K*phi under the planner's table; `a2a_rows`:
    (intra, inter) rows the token all-to-all's slowest rank sends or receives per direction, over T*K*phi
    (`PlannedRouting.max_over_mean`, `.busiest_a2a_rows`; phi, optional in `x`: the share of the
    assignments that reach FFN experts, `cost_model.ep`'s module doc, 1 when absent).

    - compute: the busiest device's T*K*phi*rho rows, forward + backward (`ep.compute_time`);
    - token all-to-all: dispatch and combine, forward and backward, pipelined in n chunks behind the
      expert compute (`schedule.pipeline_time`, as EP), plus the split-size exchange;
    - other: the restore (C*S_e/W elements per pair, b bytes) and in the backward the restore again (b; not
      with `keep_restored`, `Plan.keep_restored`), `restore_time` each, exposed: the rewrite issues the
      restore behind the dispatch on the same links and waits for it before the experts; the gradient slices
      back (b_g bytes), `restore_time`, exposed, or with `deferred_grads` (the runtime's default for every
      FSEP block but the first, whose exchange is waited at once) what the earlier layer's backward expert
      compute does not hide (`deferred_grad_time`);
    - host: `ep.host_time` on the busiest device's rows and C experts (page faults n_f included), plus the
      restore's re-layout on the rank's thread (`restore_host_time`; 0 unless calibrated);
    - threads: the helper threads' CPU for those exchanges and the planner's solve on the [W, E] counts, on an
      oversubscribed node (`cost_model.helper_cpu`);
    - memory: the 1/W shards of all E experts with grads and optimizer state (s), the busiest device's
      activations (`ep.memory_per_rank`'s estimate) and, with `keep_restored`, the C restored experts
      autograd keeps from the forward to the backward (b). Without it the restored experts, and in any case
      the C restored gradients (C*S_e*b_g), live one layer at a time: the caller adds them once.
    """
    from cost_model.schedule import pipeline_time

    T, K, D, F, m = x["T"], x["K"], x["D"], x["F"], x["m"]
    mean = T * K * x.get("phi", 1)  # the FFN rows a device computes on average
    rows = mean * rho
    compute = ep_formulas.compute_time(rows, D, F, m, x["R"], x["eta"], recompute=x.get("r_c", 0))
    fwd_compute = ep_formulas.compute_time(rows, D, F, m, x["R"], x["eta"]) / FWD_BWD
    intra, inter = (mean * share * D * x["b"] for share in a2a_rows)
    transfer = intra / x["B_intra"] + inter / x["B_inter"]
    a2a = (pipeline_time(n, transfer, fwd_compute, x["alpha"]) + pipeline_time(n, transfer, compute - fwd_compute,
                                                                                 x["alpha"]) - compute + x["alpha"])
    S_e = expert_elements(D, F, m)
    weights = (x["b"],) if keep_restored else (x["b"], x["b"])
    restores = sum(restore_time(C, S_e, W, x["G"], b, x["B_intra"], x["B_inter"], x["alpha"]) for b in weights)
    grads = restore_time(C, S_e, W, x["G"], x["b_g"], x["B_intra"], x["B_inter"], x["alpha"])
    restores += deferred_grad_time(grads, compute - fwd_compute) if deferred_grads else grads
    memory = ep_formulas.memory_per_rank(x["E"], W, D, F, m, x["s"], rows, x["b"])
    if keep_restored:
        memory += C * S_e * x["b"]
    host = ep_formulas.host_time(rows, D, F, C, 1, tokens=T, routed=mean, **ep_formulas.host_figures(x))
    host += restore_host_time(C, S_e, x.get("c_restore", 0))
    # the helper threads' CPU: the four token exchanges (n calls each), the split sizes and the planner's count
    # gather (`moe_comm.gather_counts`), the restores; the planner's solve
    restored = [restore_bytes(C, S_e, W, x["G"], b) for b in (*weights, x["b_g"])]
    threads = exposed_thread_cpu(x, A2A_PER_LAYER * (intra + inter) + sum(a + e for a, e in restored),
                                 A2A_PER_LAYER * n + 2 + len(restored),
                                 planner_cpu(W, x["E"], x.get("c_plan", 0), x.get("c_plan_e", 0)))
    return LayerTerms(compute=compute, a2a_exposed=a2a, other_comm=restores, memory=memory, a2a_bytes=intra + inter,
                      host=host, threads=threads)
