"""The plan search's per-form figures (`cost_model.search`): the symbol values of a block, the routing skew at
an EP degree, the FSEP planner's table, the FSEP and HP candidates as the per-layer formulas price them
(`Candidate.formula`), and the winner's printed expressions.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import sympy

from cost_model import fsep as fsep_formulas
from cost_model import hp as hp_formulas
from cost_model import symbols as S
from cost_model.ep import (
    LayerTerms,
    ep_alone,
    ep_layer,
    ep_step,
    rank_rows,
    zipf_counts,
    zipf_for_imbalance,
)
from cost_model.ep import imbalance as ep_rows_imbalance
from cost_model.presets import Hardware
from cost_model.schedule import DDP_BUCKET_BYTES
from cost_model.search_types import HP_CHANGE, ZERO_COMPUTE_REFUSED, BlockShape, Candidate, Routed


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def block_figures(shape: BlockShape, hw: Hardware, T: float, G: int, rho: float, cf: float | None,
             recompute: bool | None = None, link: dict[str, Any] | None = None) -> dict[str, Any]:
    """The symbol values of one block; `link`: its dense gradients and all-reduce unit (`link_figures`),
    which only EP prices."""
    return {
        **hw.values(),
        **({} if recompute is None else {"r_c": float(recompute)}),
        **(link or {}),
        "T": T,
        "K": shape.K,
        "D": shape.D,
        "F": shape.F,
        "m": shape.m,
        "E": shape.E,
        "G": G,
        "rho": rho,
        "c_f": cf if cf is not None else 1.0,
        "phi": shape.ffn_fraction,
    }


def table_symbols(shapes: Sequence[BlockShape] = ()) -> dict[str, Any]:
    """Every symbol of the table, and phi where a block has zero-compute experts (1 otherwise: not shown)."""
    optional = {"phi": S.phi} if any(s.zero_compute for s in shapes) else {}
    return {**{name: info.symbol for name, info in S.TABLE.items()}, **optional}


def link_figures(shape: BlockShape, seq: int, schedule: str, micro_op_bytes: int) -> dict[str, Any]:
    """P_d, q and u of a block: its dense parameters, the sequence length, the all-reduce unit of `schedule`."""
    unit = micro_op_bytes if schedule == "priority" else DDP_BUCKET_BYTES
    return {"P_d": shape.dense_params, "q": seq, "u": unit}



def skewed_counts(T: int, K: int, E: int, W: int, imbalance: float, ffn_fraction: float = 1.0) -> np.ndarray:
    """[W, E] routed rows to the E FFN experts, T*K*ffn_fraction per source rank (the assignments that pick
    zero-compute experts are neither sent nor computed), whose plain-EP max/mean is `imbalance`: every rank
    routes with the same Zipf popularity (`cost_model.ep.zipf_counts`), fitted at the planner's reference EP
    degree (the largest divisor of W that divides E; E when that is 1)."""
    ep = max(d for d in divisors(W) if E % d == 0)
    ep = E if ep == 1 else ep
    s = zipf_for_imbalance(imbalance, T, K, E, ep) if imbalance > 1 else 0.0
    return zipf_counts(T, K, E, W, s) * ffn_fraction


@functools.lru_cache(maxsize=1024)
def ep_imbalance(shape: BlockShape, T: int, W: int, ep: int, imbalance: float) -> float:
    """max/mean rows per rank of EP over `ep` ranks when it is `imbalance` at the reference degree (the largest
    divisor of W that divides E): the same Zipf popularity (`skewed_counts`) placed on ep ranks, the first
    ep of the source ranks forming the group (as `cost_model.simulate` groups packed ranks)."""
    reference = max(d for d in divisors(W) if shape.E % d == 0)
    if imbalance <= 1 or ep == reference or ep == 1 or shape.E % ep:
        return imbalance
    counts = skewed_counts(T, shape.K, shape.E, W, imbalance)
    return ep_rows_imbalance(rank_rows(counts[:ep], ep))


@functools.lru_cache(maxsize=256)
def routed_of(shape: BlockShape, hw: Hardware, T: int, W: int, G: int, C: int, imbalance: float,
            recompute: bool | None) -> Routed:
    """The planner's table for this block's skewed counts and what it leaves: FSEP's max/mean and token bytes."""
    from moepass.runtime.placement import planned_routing

    counts = skewed_counts(T, shape.K, shape.E, W, imbalance, shape.ffn_fraction)
    routed = planned_routing(counts, hw, C=C, ranks_per_node=G, D=shape.D, F=shape.F, gated=shape.m == 3,
                             recompute=recompute)
    v = hw.values()
    a2a_rows = routed.busiest_a2a_rows(G, v["B_intra"], v["B_inter"])
    return Routed(routed.max_over_mean, a2a_rows, routed.decision.ep_max_over_mean, routed.decision.candidate)


def fsep_figures(shape: BlockShape, hw: Hardware, T: Any, G: int, recompute: bool | None) -> dict[str, Any]:
    return block_figures(shape, hw, T, G, 1.0, None, recompute)


def fsep_candidate(shapes: list[BlockShape], routing: tuple[Routed, ...], hw: Hardware, T: int, W: int, G: int,
                    C: int, n: int, recompute: bool | None) -> Candidate:
    total: LayerTerms | None = None
    for i, (shape, r) in enumerate(zip(shapes, routing)):  # the first block's gradient exchange is waited at
        terms = fsep_formulas.fsep_layer(fsep_figures(shape, hw, T, G, recompute), W=W, C=C, n=n, rho=r.rho,
                                         a2a_rows=r.a2a_rows, deferred_grads=i > 0)  # once, the others deferred
        total = terms if total is None else total + terms
    assert total is not None
    v = hw.values()
    # one layer's restored experts and their gradients at a time (Plan.keep_restored=False, the default), plus
    # the deferred exchange's send and receive buffers (Plan.defer_expert_grads=True, the default)
    grads = max(C * float(fsep_formulas.expert_elements(s.D, s.F, s.m)) * (v["b"] + 3 * v["b_g"]) for s in shapes)
    total = total + LayerTerms(0, 0, 0, grads, 0)
    notes = []
    feasible = float(total.memory) <= float(hw.memory)
    if not feasible:
        notes.append(f"needs {float(total.memory) / 1e9:.3g} GB > {float(hw.memory) / 1e9:.3g} GB")
    if any(s.zero_compute for s in shapes):
        feasible = False
        notes.append(ZERO_COMPUTE_REFUSED["fsep"])
    worst = max(routing, key=lambda r: r.rho)
    notes.append(f"planner max/mean {worst.rho:.3g} vs EP {worst.ep_rho:.3g} ({worst.table} table)")
    return Candidate("fsep", W, None, n, 1, total, feasible, False, tuple(notes), slots=C, routing=routing)


def latent_input(block: Any, shape: BlockShape) -> Any:
    """The MoESpec `moepass.rewrite.latent.latent_shape` converts: the block's own, or one built from a bare
    BlockShape (swiglu when gated, gelu otherwise; a capacity factor is refused, as the conversion does)."""
    from moepass.spec import CapacitySpec, ExpertsSpec, MoESpec, RouterSpec, TensorSource

    if not isinstance(block, BlockShape):
        return block
    gated = shape.m == 3
    return MoESpec(
        path="block", recogniser="cost_model", router=RouterSpec(num_experts=shape.E, top_k=shape.K),
        experts=ExpertsSpec(num_experts=shape.E, hidden_dim=shape.D, ffn_dim=shape.F,
                            activation="swiglu" if gated else "gelu",
                            w_up=TensorSource.param("experts.w_up") if gated else None),
        capacity=None if shape.cf is None else CapacitySpec(capacity_factor=shape.cf),
    )


def hp_figures(shape: BlockShape, latent: Any, hw: Hardware, T: Any, G: int,
                recompute: bool | None) -> dict[str, Any]:
    """`block_figures` for the Multi-Head LatentMoE a block converts to: H, h, E per head, F its experts' width."""
    return {**block_figures(shape, hw, T, G, 1.0, None, recompute), "H": latent.heads, "h": latent.head_dim,
            "E": latent.experts, "F": latent.ffn_dim}


def hp_candidate(blocks: list[Any], shapes: list[BlockShape], hw: Hardware, T: int, W: int, nodes: int, G: int,
                  P: int, heads: int | None, head_dim: int | None, recompute: bool | None) -> Candidate | str:
    """HP over P ranks for every block (each converted at equal active parameters), or why not."""
    from moepass.errors import PlanError
    from moepass.plan import Plan
    from moepass.rewrite.latent import latent_shape

    if W % P or P < 2:
        return f"P={P} is not a divisor > 1 of the {W} ranks"
    try:
        plan = Plan(form="hp", heads=heads, head_dim=head_dim, ep_size=P)
        latent = tuple(latent_shape(latent_input(b, s), plan, P) for b, s in zip(blocks, shapes))
    except PlanError as err:
        return f"P={P}: {err}"
    total: LayerTerms | None = None
    for shape, lat in zip(shapes, latent):
        terms = hp_formulas.hp_layer(hp_figures(shape, lat, hw, T, G, recompute), ep=P, dp=W // P,
                                     cross_node=nodes > 1)
        total = terms if total is None else total + terms
    assert total is not None
    notes = []
    feasible = float(total.memory) <= float(hw.memory)
    if not feasible:
        notes.append(f"needs {float(total.memory) / 1e9:.3g} GB > {float(hw.memory) / 1e9:.3g} GB")
    notes.append(f"{HP_CHANGE} (active params/token {latent[0].active_before:,} -> {latent[0].active_after:,})")
    return Candidate("hp", P, None, 1, 1, total, feasible, True, tuple(notes), latent=latent)


def winner_expressions(best: Candidate, shapes: list[BlockShape], hw: Hardware, W: int, nodes: int, G: int,
                        rho: float, schedule: str, links: list[dict[str, Any]],
                        T: int) -> tuple[sympy.Expr, sympy.Expr]:
    """The winner's time per layer in symbols (a model of one such layer), and its step time with every
    figure substituted but T: the layers alone on their links as formulas of T, plus the all-reduce's
    contention (waits, exposed all-reduce) as its number at the search's T (a formula chained over the
    layers is too large to print)."""
    ep_eff = best.ep_size // best.packing
    plan: dict[str, Any] = dict(ep=ep_eff, n=best.a2a_chunks, dp=W // ep_eff, cross_node_dp=nodes > 1)
    cfs = [best.capacity_factor if best.capacity_factor is not None else shape.cf for shape in shapes]
    generic = sympy.sympify(ep_layer(table_symbols(shapes), dropless=cfs[0] is None, policy=schedule, **plan).step)
    xs = [block_figures(shape, hw, T, G, ep_imbalance(shape, T, W, ep_eff, rho), cf, link=link)
          for shape, cf, link in zip(shapes, cfs, links)]

    def alone(x: dict[str, Any], cf: float | None) -> Any:
        return ep_alone(x, dropless=cf is None, **plan)[0].step

    contention = float(ep_step(xs, dropless=[cf is None for cf in cfs], policy=schedule, **plan).step) - sum(
        float(alone(x, cf)) for x, cf in zip(xs, cfs))
    substituted = sum((sympy.sympify(alone({**x, "T": S.T}, cf)) for x, cf in zip(xs, cfs)), sympy.Integer(0))
    return generic, (sympy.simplify(substituted) + contention).evalf(4)


def fsep_expressions(best: Candidate, shapes: list[BlockShape], hw: Hardware, G: int) -> tuple[sympy.Expr,
                                                                                               sympy.Expr]:
    """An FSEP winner's time per layer in symbols (rho: the planner's max/mean; the all-to-all's rows as
    fractions of T*K*phi from its routing), and its step time with every figure substituted but T."""
    C = best.slots
    assert C is not None

    def formula(x: dict[str, Any], r: Routed, rho: Any, deferred: bool) -> sympy.Expr:
        return sympy.sympify(fsep_formulas.fsep_layer(x, W=best.ep_size, C=C, n=best.a2a_chunks, rho=rho,
                                                      a2a_rows=r.a2a_rows, deferred_grads=deferred).step)

    generic = formula(table_symbols(shapes), best.routing[0], S.rho, True)  # a layer whose gradient exchange is deferred
    substituted = sympy.Integer(0)
    for i, (shape, r) in enumerate(zip(shapes, best.routing)):
        substituted += formula({**fsep_figures(shape, hw, 0, G, None), "T": S.T}, r, r.rho, i > 0)
    return generic, sympy.simplify(substituted).evalf(4)


def hp_expressions(best: Candidate, shapes: list[BlockShape], hw: Hardware, W: int, nodes: int,
                    G: int) -> tuple[sympy.Expr, sympy.Expr]:
    """An HP winner's time per layer in symbols (H, h, E per head, F the latent experts' width), and its
    step time with every figure substituted but T."""
    P = best.ep_size

    def formula(x: dict[str, Any]) -> sympy.Expr:
        return sympy.sympify(hp_formulas.hp_layer(x, ep=P, dp=W // P, cross_node=nodes > 1).step)

    generic = formula(table_symbols())
    substituted = sympy.Integer(0)
    for shape, latent in zip(shapes, best.latent):
        substituted += formula({**hp_figures(shape, latent, hw, 0, G, None), "T": S.T})
    return generic, sympy.simplify(substituted).evalf(4)

