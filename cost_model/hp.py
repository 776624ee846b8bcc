"""Head parallel (HP) of a Multi-Head LatentMoE: compute, exchange bytes and memory per rank.

Pure formula functions over the symbols of `cost_model.symbols`, as in `cost_model.ep` and
`cost_model.fsep`: pass symbols to get a sympy expression, numbers to get a number.

The layer as `moepass.rewrite.hp` builds it (TECHNIQUES.md §3): H heads of width h (Q = H*h) sharded
over the `ep` ranks of the head group (Plan.ep_size; P in the rewrite), H/ep heads per rank with all E
experts of each; w_in (D -> Q) and w_out (Q -> D) data parallel. Forward, per rank:

    w_in      z_TQ = x_TD @ w_in                                       2*T*D*Q FLOPs
    dispatch  equal all_to_all: T*Q/ep elements to each peer          T*Q*(ep-1)/ep elements sent
    routing   ep*T tokens x H/ep heads, each h -> E logits             2*T*Q*E FLOPs
    experts   ep*T*(H/ep) = T*H sub-tokens, each to K experts of its own head, all on this rank:
              T*H*K rows of width h through m matmuls of h x F        2*T*H*K*h*F*m FLOPs
    combine   the same equal all_to_all back                          T*Q*(ep-1)/ep elements sent
    w_out     out_TD = y_TQ @ w_out                                    2*T*D*Q FLOPs

The backward repeats both exchanges (A2A_PER_LAYER = 4: 4*T*Q*(ep-1)/ep*b bytes per rank per layer
step, whatever K) and costs twice the forward FLOPs (FWD_BWD). Routing and the K-fold duplication
happen after the exchange, so a rank computes exactly T*H*K rows whatever the routing: the routing
only splits them over the rank's own H/ep*E experts (grouped-GEMM padding, not modelled). The skew
`rho` EP pays on its busiest rank does not apply.

The rewrite waits for each exchange before its consumer and the schedule pass does not partition HP,
so all four exchanges sit on the critical path (one latency each, no count exchange: equal splits).
The router and expert gradients of a rank's heads are all-reduced over the dp = W/ep replicas of the
head group (EP's expert convention), the replicated w_in/w_out over all W ranks; both overlap the next
layer's backward GEMMs, as in `cost_model.ep.ep_layer`.

Memory: a rank holds its heads' routers and experts (1/ep of them) and all of w_in/w_out. At equal
active parameters with h = D/H the latent experts keep F close to the standard block's (H*K*h*F ~ K*D*F),
so the T*H*K rows keep hidden activations of width F each: about H times EP's T*K rows.

Symbols here: E experts per head, F the latent experts' hidden width (`moepass.rewrite.latent`'s m),
m matmuls per expert FFN (3 swiglu, 2 gelu), ep the HP degree. `moepass.rewrite.latent.latent_shape`
picks H, h, F for a standard block at equal active parameters.
"""

from __future__ import annotations

from typing import Any

from cost_model import ep as ep_formulas
from cost_model.ep import A2A_PER_LAYER, FWD_BWD, LayerTerms
from cost_model.helper_cpu import exposed_thread_cpu
from cost_model.symbols import smax

# ---- the token exchange --------------------------------------------------------------------------


def exchange_elements(T, H, h, ep):
    """Elements one rank sends per exchange direction: its T tokens' sub-tokens for the heads of the
    other ep-1 ranks (T*Q/ep to each), independent of K."""
    return T * H * h * (ep - 1) / ep


def exchange_bytes(T, H, h, ep, G, b):
    """(intra-node bytes, inter-node bytes) one rank sends per direction: EP's split of a routed row
    (`cost_model.ep.a2a_bytes`) with one row of Q = H*h elements per token instead of K rows of D."""
    return ep_formulas.a2a_bytes(T, 1, H * h, ep, G, b)


def step_bytes(T, H, h, ep, b):
    """Bytes one rank sends per layer step: dispatch + combine, forward and backward."""
    return A2A_PER_LAYER * exchange_elements(T, H, h, ep) * b


# ---- HP with EP inside (Plan(form="hp", head_ep_size=P); moepass.rewrite.hp_ep) ----------------------
# G head groups of P ranks: the HP exchange runs over the G ranks sharing an ep index, the expert exchange
# over the P ranks of a head group. Per rank and direction:


def hp_ep_hp_elements(T, H, h, G):
    """HP exchange: elements a rank sends to the other G-1 ranks of its HP group, whatever K (T*Q/G to each)."""
    return exchange_elements(T, H, h, G)


def hp_ep_routed_elements(T, H, h, K):
    """Expert exchange: elements a rank's dispatch splits over its EP group, its own part included: the
    G*T received tokens x H/G heads x K choices = T*H*K rows of width h, whatever G and P."""
    return sub_token_rows(T, H, K) * h


def hp_ep_expert_elements(T, H, h, K, P):
    """Expert exchange: elements a rank sends to the other P-1 ranks of its EP group under uniform routing
    (the exact split follows the routing; the count exchange carries it)."""
    return hp_ep_routed_elements(T, H, h, K) * (P - 1) / P


def hp_ep_step_bytes(T, H, h, K, G, P, b):
    """Bytes one rank sends per layer step (dispatch + combine, forward and backward) under uniform routing."""
    return A2A_PER_LAYER * (hp_ep_hp_elements(T, H, h, G) + hp_ep_expert_elements(T, H, h, K, P)) * b


# ---- compute ---------------------------------------------------------------------------------------


def sub_token_rows(T, H, K):
    """Rows a rank's experts compute per layer: T*H sub-tokens (its heads of all ep*T tokens), K each."""
    return T * H * K


def projection_flops(T, D, H, h, E):
    """Forward FLOPs of w_in, w_out (2*T*D*Q each) and the rank's routers over its heads (2*T*Q*E)."""
    return 2 * 2 * T * D * H * h + 2 * T * H * h * E


def layer_flops(T, D, H, h, E, K, F, m):
    """Forward FLOPs of one HP layer on one rank (projections, routing, experts)."""
    return projection_flops(T, D, H, h, E) + ep_formulas.expert_flops(sub_token_rows(T, H, K), h, F, m)


# ---- parameters and memory -------------------------------------------------------------------------


def head_params_per_rank(H, h, E, F, m, ep):
    """Router + expert parameters of the rank's H/ep heads (E experts of m matrices h x F each)."""
    return H * E * (h + ep_formulas.expert_params(1, h, F, m)) / ep


def projection_params(D, H, h):
    """w_in and w_out: D x Q each, replicated on every rank."""
    return 2 * D * H * h


def memory_per_rank(T, D, H, h, E, K, F, m, ep, s, b):
    """Bytes one rank holds for one layer: its heads' routers and experts and the replicated w_in/w_out
    with grads and optimizer state (s bytes per parameter), plus the activations kept for backward
    (estimate): the sub-token rows as `cost_model.ep.memory_per_rank` counts routed rows (width h), and
    z_TQ and y_TQ (T*Q each: the router's and w_out's inputs). The block input is not counted (as in EP)."""
    rows = sub_token_rows(T, H, K)
    experts_and_acts = ep_formulas.memory_per_rank(H * E, ep, h, F, m, s, rows, b)
    return experts_and_acts + (H * E * h / ep + projection_params(D, H, h)) * s + 2 * T * H * h * b


# ---- one layer, one plan -----------------------------------------------------------------------------


def hp_layer(x: dict[str, Any], *, ep: int, dp: int, cross_node: bool) -> LayerTerms:
    """Step terms of one HP layer over `ep` ranks (dp = W/ep head-group replicas), in the form of
    `cost_model.ep.ep_layer` (`x`: the same symbol names, numbers or symbols, with H, h, E per head and
    F the latent experts' hidden width; `cross_node`: the gradient all-reduces cross nodes).

    - compute: projections, routing and the T*H*K expert rows, forward + backward (`ep.compute_time`
      for the experts, its recompute flag r_c included);
    - exposed all-to-all: the four exchanges, unchunked, one latency each (`ep.a2a_time`);
    - other: the head gradients over dp and the w_in/w_out gradients over W, minus the next layer's
      backward GEMMs they overlap (as EP);
    - host: `ep.host_time` on the T*H*K rows of width h, the H/ep*E local experts and the router's T*H sub-tokens
      (0 unless calibrated),
      with the step's page faults n_f (an input, 0 when absent: on a CPU the T*H*K-row hidden buffers, H times
      EP's, are what glibc hands back to the OS and faults in again; `cost_model.ep.host_time`);
    - threads: the helper threads' CPU for the four exchanges on an oversubscribed node (`cost_model.helper_cpu`).
    """
    T, D, H, h, E, K, F, m = x["T"], x["D"], x["H"], x["h"], x["E"], x["K"], x["F"], x["m"]
    rate = x["R"] * x["eta"]
    rows = sub_token_rows(T, H, K)
    experts = ep_formulas.compute_time(rows, h, F, m, x["R"], x["eta"], recompute=x.get("r_c", 0))
    fwd_compute = layer_flops(T, D, H, h, E, K, F, m) / rate
    compute = experts + FWD_BWD * projection_flops(T, D, H, h, E) / rate
    if ep > 1:
        intra, inter = exchange_bytes(T, H, h, ep, x["G"], x["b"])
        a2a = A2A_PER_LAYER * ep_formulas.a2a_time(intra, inter, x["B_intra"], x["B_inter"], x["alpha"])
        sent = intra + inter
    else:
        a2a, sent = 0, 0
    B, ar_alpha = ep_formulas.allreduce_figures(x, x["B_inter"] if cross_node else x["B_intra"])
    ar = (ep_formulas.allreduce_time(head_params_per_rank(H, h, E, F, m, ep) * x["b_g"], dp, B, ar_alpha)
          + ep_formulas.allreduce_time(projection_params(D, H, h) * x["b_g"], ep * dp, B, ar_alpha))
    other = smax(0, ar - 2 * fwd_compute)
    memory = memory_per_rank(T, D, H, h, E, K, F, m, ep, x["s"], x["b"])
    host = ep_formulas.host_time(rows, h, F, H * E, ep, tokens=T * H, **ep_formulas.host_figures(x))
    threads = exposed_thread_cpu(x, A2A_PER_LAYER * sent, A2A_PER_LAYER) if ep > 1 else 0  # `cost_model.helper_cpu`
    return LayerTerms(compute=compute, a2a_exposed=a2a, other_comm=other, memory=memory, a2a_bytes=sent, host=host,
                      threads=threads)
