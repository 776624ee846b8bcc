"""One step of one plan on one scenario case, priced on the step timeline: the function the plan searches
(`cost_model.search.search_scenario`, and `cost_model.search.search` / form="auto" through
`cost_model.model_cases`) rank with and the simulator (`cost_model.simulate`) reports.

A `StepPlan` is one way to run a case: moepass's forms with their options (EP over any degree with
chunks and the gradient schedule, FSEP with any slot count and prefetch depth, HP, locality routing, no
rewrite), and the published baselines moepass does not build (tensor parallel x expert parallel,
FSDP+EP, replication-based balancing). `price` lays one step out on the timeline of the busiest rank
(`cost_model.step_timeline`): per layer the dense part, the dispatch all-to-all, expert compute and the
combine, forward then backward, with the gradient collectives on the "other" stream sharing the link (fair
share or Lina's priority). `cost_model.system_plans` reads a scenario's system entries into their `StepPlan`s
and lists the plans the search ranks for a case. Every plan reads the case's routing through
`cost_model.routing` (one process over steps, `RoutingTrace`), so a system and the search's plan of the same
form price the same rows.

Baselines, each its own formula:
- TP x EP (Megatron; `tp` from the system or its note, "TP 8 (e8k2)"): the attention of a layer is tensor
  parallel over tp ranks of a node with sequence parallelism: per layer and pass two all-gathers and two
  reduce-scatters of the TP group's activations ((tp-1) T D b bytes per rank each) that the compute waits
  for (not overlapped); the dense gradients are 1/tp per rank, all-reduced over W/tp ranks. Experts: EP.
- FSDP+EP: EP for the experts; the experts sharded over their W/ep replicas and the dense weights over W:
  an all-gather of both before the forward and the backward (one layer prefetched), a reduce-scatter of the
  gradients.
- Replication-based balancing (FlexMoE): the experts placed over all W ranks in the slots EP's layout gives
  a device (E/ep, plus `replicas` extra slots per device where the system gives them): the W x slots copies
  shared out by the loads of the steps before (`moepass.runtime.placement.proportional_replicas`, at least one
  copy each, then to the hottest per copy), placed node-spread (`place`); the current step's rows of an expert
  split evenly over its copies, wherever they are (FlexMoE balances by replica count). Each expert's gradients are all-reduced over its
  copies; the weights and optimizer state that move when the placement changes (migration: one slot per device)
  are sent on the "other" stream, amortised over the re-placement interval. Memory: the rank's whole experts
  (weights, gradients) and their optimizer state sharded over each expert's copies (ZeRO-1 over the expert's
  data-parallel group) when sharded: W x slots / E copies each on average. Every layer has its own router and
  its own placement, so a rank's cold (few-copy) experts of one layer are not its experts of the next: the
  per-rank optimizer state is counted at that mean (one routing trace serves all layers here).
- Routers (locality set-ups): the hash router routes uniformly with no learned gate; a learned router (the
  switch router: top-1 softmax with an aux loss) pays its gate GEMM (2 T D E FLOPs forward) and routes with
  the imbalance measured in this project's own training run (`MEASURED_SWITCH_MAX_MEAN`); LocMoE is the
  learned router with the locality loss (`cost_model.locality`).

Memory (`memory_breakdown`): weights, gradients and optimizer state per rank for each layout, activations
kept for the backward. A plan that does not fit with replicated optimizer state gets the sharding the
systems use (the optimizer state over each parameter's data-parallel group: ZeRO-1 / Megatron's
distributed optimizer; same bytes on the link: a reduce-scatter and an all-gather in place of the
all-reduce), then activation recomputation (each layer keeps its input; its forward compute is repeated
in the backward, the token rows cached); it is infeasible only when neither fits.

Shape letters: `moepass.spec.SHAPES` (here P: ranks as sources and as destinations; a: history steps).
"""


from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from cost_model import ep as ep_formulas
from cost_model import fsep as fsep_formulas
from cost_model import hp as hp_formulas
from cost_model import locality, step_timeline
from cost_model.presets import Hardware
from cost_model.routing import RoutingTrace, routing_trace
from cost_model.scenarios import Case
from cost_model.schedule import DDP_BUCKET_BYTES
from cost_model.step_timeline import (
    ExpertGrads,
    Layout,
    ParamTraffic,
    allreduce_ops,
    breakdown_of,
    dense_flops,
    memory_breakdown,
    ring_half,
    state_bytes,
    timeline_step,
)
from cost_model.timeline import Timeline, collector_paused

REPLACE_INTERVAL = 50  # FlexMoE: steps between re-placements (migration amortised over them), assumed


# ---- a plan ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepPlan:
    """One way to run a case. `builds`: moepass builds it (`plan_kwargs` says how); otherwise a published
    baseline priced for comparison. `system`: the scenario system it is, if any."""

    form: str  # "single", "ep", "fsep", "hp", "locality"
    ep: int = 1  # ranks the experts span (EP degree; W for FSEP and locality; P for HP)
    chunks: int = 1
    sched: str = "fair"  # "fair" (DDP buckets) or "priority" (Lina's micro-ops)
    bucket: float = DDP_BUCKET_BYTES  # gradient all-reduce piece: DDP bucket or micro-op bytes
    packing: int = 1  # Lina's packing label (ep is already the packed degree)
    slots: int | None = None  # FSEP C
    prefetch: int = 2  # FSEP restore depth
    tp: int = 1  # tensor parallel degree of the dense part (Megatron)
    fsdp: bool = False  # FSDP for the experts (over their replicas) and the dense part (over W)
    replicating: bool = False  # replication-based balancing (FlexMoE): copies of the experts placed by load
    replicas: int = 0  # replication-based balancing: extra expert slots per device beyond EP's E/ep
    router: str = "learned"  # "hash", "switch", "locmoe", or the model's own ("learned")
    capacity: float | None = None  # EP / single: capacity factor (rows per expert and source rank capped); None: dropless
    math_changing: bool = False
    builds: bool = True
    system: str | None = None

    @property
    def label(self) -> str:
        if self.form == "single":
            text = "single"
        elif self.form == "fsep":
            text = f"fsep C={self.slots} n={self.chunks} prefetch={self.prefetch}"
        elif self.form == "hp":
            text = f"hp={self.ep}"
        elif self.form == "locality":
            text = f"locality router={self.router}"
        else:
            text = f"ep={self.ep}" + (f" P={self.packing}" if self.packing > 1 else "") + f" n={self.chunks}"
            text += f" {self.sched}" + (f" tp={self.tp}" if self.tp > 1 else "") + (" fsdp" if self.fsdp else "")
            text += f" replicated +{self.replicas} slots" if self.replicating else ""
            text += f" router={self.router}" if self.router != "learned" else ""
        if self.capacity is not None:
            text += f" cf={self.capacity:g}"
        return text

    def plan_kwargs(self) -> dict[str, Any]:
        """The `moepass.Plan` fields of a plan moepass builds (empty for a baseline it does not)."""
        if not self.builds:
            return {}
        if self.form == "single":
            return {"form": "single"}
        kwargs: dict[str, Any] = {"form": self.form, "ep_size": self.ep * self.packing, "a2a_chunks": self.chunks,
                                  "packing": self.packing}
        if self.form == "fsep":
            kwargs.update(slots_per_device=self.slots)
        if self.sched == "priority":
            kwargs.update(grad_sync="scheduler", micro_op_bytes=int(self.bucket))
        return kwargs


@dataclass
class Priced:
    """What `price` says of one plan on one case."""

    plan: StepPlan
    step_s: float
    breakdown: dict[str, float]
    memory: dict[str, float]  # bytes per rank by part, and "total"
    feasible: bool
    details: dict[str, Any] = field(default_factory=dict)  # the figures a reader needs (table, max/mean, ...)
    notes: list[str] = field(default_factory=list)

    @property
    def memory_gb(self) -> float:
        return self.memory["total"] / 1e9


@dataclass
class CaseContext:
    """A case with what every plan of it reads: hardware, the set-up, the routing over steps."""

    case: Case
    hw: Hardware
    scenario: dict[str, Any]
    assumptions: list[str]
    traces: dict[str, RoutingTrace] = field(default_factory=dict)
    system_fsep: list[StepPlan] = field(default_factory=list)  # the set-up's FSEP plans (their slots are searched)
    routed: dict[tuple[int, str], Any] = field(default_factory=dict)  # FSEP: the planner's table per slot count
    priced: dict[StepPlan, Priced] = field(default_factory=dict)  # `price`'s results, by plan
    laid: dict[StepPlan, Laid] = field(default_factory=dict)  # `step_floor`'s layouts not yet priced, by plan

    @property
    def W(self) -> int:
        return self.case.nodes * self.case.per_node

    def trace(self, router: str) -> RoutingTrace:
        """The routing over steps a plan with `router` sees: in a locality set-up the hash router's (uniform) or
        the learned routers' (switch and LocMoE: the measured skew), else the set-up's."""
        key = ("hash" if router == "hash" else "switch") if self.locality_setup else "learned"
        if key not in self.traces:
            trace = routing_trace(self.scenario.get("routing") or {}, self.case, key, self.assumptions)
            phi = self.case.ffn_fraction
            if phi < 1:  # the assignments that pick zero-compute experts are neither sent nor computed
                trace = RoutingTrace(trace.steps_aWE * phi, f"{trace.description}, {phi:.3g} of them to FFN experts")
            self.traces[key] = trace
        return self.traces[key]

    @property
    def locality_setup(self) -> bool:
        return any(s.get("form") == "locality" for s in self.scenario.get("systems") or [])


# ---- pricing one plan ------------------------------------------------------------------------------------------


def _fit(memory_of: Any, hw: Hardware) -> tuple[dict[str, float], bool, bool, bool]:
    """(memory, sharded optimizer, recompute, feasible): the least of replicated state -> sharded optimizer ->
    + recomputation that fits the device."""
    limit = float(hw.memory)
    tries = [(False, False), (True, False), (True, True)]
    for sharded, recompute in tries:
        mem = memory_of(sharded, recompute)
        if mem["total"] <= limit:
            return mem, sharded, recompute, True
    return memory_of(True, True), True, True, False


def _key(plan: StepPlan) -> StepPlan:
    """Plans that differ only in their name (the system, Lina's packing label) are one layout of a case."""
    return replace(plan, system=plan.system if plan.form == "locality" else None, packing=1, builds=True,
                   math_changing=False)


def price(plan: StepPlan, ctx: CaseContext) -> Priced:
    """One step of `plan` on `ctx`'s case (module docstring), laid out once per case and name (`_key`)."""
    key = _key(plan)
    if key not in ctx.priced:
        with collector_paused():
            ctx.priced[key] = _price(plan, ctx)
    done = ctx.priced[key]
    return replace(done, plan=plan, breakdown=dict(done.breakdown), details=dict(done.details), notes=list(done.notes))


def step_floor(plan: StepPlan, ctx: CaseContext) -> tuple[bool, float]:
    """(feasible, a lower bound of `price(plan, ctx).step_s`) without running the plan's timeline: its layout
    and memory fit (`Laid`, kept for `price`) and `cost_model.step_timeline.step_floor`. The exact step where the
    plan is priced already, and for HP (its own timeline: priced)."""
    key = _key(plan)
    if key not in ctx.priced and plan.form != "hp":
        if key not in ctx.laid:
            ctx.laid[key] = _lay_out(plan, ctx)
        laid = ctx.laid[key]
        return laid.feasible, step_timeline.step_floor(ctx.case, ctx.hw, laid.layout, chunks=plan.chunks,
                                                      bucket_bytes=plan.bucket)
    done = price(plan, ctx)
    return done.feasible, done.step_s


FLOOR_SLACK = 1e-9  # a floor is over a step only by more than this (relative): the sums' rounding is ~1e-15


def fastest(ctx: CaseContext, plans: list[tuple[int, StepPlan, float]],
            tie: Callable[[int, Priced], tuple[Any, ...]] = lambda i, priced: (i,)) -> Priced | None:
    """Of `plans` ((index, plan, its `step_floor`)), the priced one with the least (step, *tie(index, priced))
    (None for none), without running the timeline of a plan that cannot be it: they are priced in the order
    of their floors until a floor is over the best step found. `min` over every plan priced, fewer timelines."""
    best: Priced | None = None
    best_key: tuple[Any, ...] = ()
    for floor, i, plan in sorted(((floor, i, plan) for i, plan, floor in plans), key=lambda t: (t[0], t[1])):
        if best is not None and floor > best.step_s * (1 + FLOOR_SLACK):
            break
        priced = price(plan, ctx)
        key = (priced.step_s, *tie(i, priced))
        if best is None or key < best_key:
            best, best_key = priced, key
    return best


@dataclass
class Laid:
    """A plan made ready for the step timeline (`_lay_out`): its layout, its memory fit, what the table shows."""

    plan: StepPlan
    layout: Layout
    memory: dict[str, float]
    feasible: bool
    details: dict[str, Any]
    notes: list[str]


def _price(plan: StepPlan, ctx: CaseContext) -> Priced:
    if plan.form == "hp":
        return _price_hp(plan, ctx)
    laid = ctx.laid.pop(_key(plan), None) or _lay_out(plan, ctx)
    plan, case, details, notes = laid.plan, ctx.case, laid.details, laid.notes  # the plan it was laid out for
    tl, figures = timeline_step(case, ctx.hw, laid.layout, chunks=plan.chunks, policy=plan.sched,
                                bucket_bytes=plan.bucket)
    breakdown = breakdown_of(tl, figures)
    breakdown.update(details.pop("extra_breakdown", {}))
    if not laid.feasible:
        notes.append(f"{case.label} {plan.system or plan.label}: {laid.memory['total'] / 1e9:.3g} GB/rank exceeds "
                     f"{float(ctx.hw.memory) / 1e9:.3g} GB even with the optimizer sharded and activations recomputed")
    return Priced(plan, tl.step, breakdown, laid.memory, laid.feasible, details, notes)


def _lay_out(plan: StepPlan, ctx: CaseContext) -> Laid:
    """The layout of a plan that is not HP and its memory: the least sharding / recomputation that fits."""
    case, hw, W = ctx.case, ctx.hw, ctx.W
    v = hw.values()
    m = ep_formulas.matmuls(case.gated)
    S_e = float(fsep_formulas.expert_elements(case.D, case.F, m))
    trace = ctx.trace(plan.router)
    counts = trace.current
    details: dict[str, Any] = {}
    notes: list[str] = []
    ar_bw = v["B_inter"] if case.nodes > 1 else v["B_intra"]
    rate = v["R"] * v["eta"]
    dense_total = case.dense_params * case.layers
    # the learned gate of a locality set-up's routers (the hash router has none); elsewhere every plan has the
    # model's own gate, left out as EP's formulas leave it
    router_fwd = 2.0 * case.tokens * case.D * case.E / rate if plan.router in ("switch", "locmoe") else 0.0

    if plan.form == "fsep":
        C = int(plan.slots or 1)
        key = (C, trace.description)
        if key not in ctx.routed:
            from moepass.runtime.placement import planned_routing  # moepass's package imports cost_model.search

            ctx.routed[key] = planned_routing(counts, hw, C=C, ranks_per_node=case.per_node, D=case.D,
                                                            F=case.F, gated=case.gated, history_aWE=trace.history)
        routed = ctx.routed[key]

        def restore(b: float) -> float:
            return float(fsep_formulas.restore_time(C, S_e, W, case.per_node, b, v["B_intra"], v["B_inter"],
                                                    v["alpha"]))

        layout = Layout(routed.rows_PP, params=ParamTraffic(restore(v["b"]), restore(v["b"]), restore(v["b_g"]),
                                                            plan.prefetch), router_fwd=router_fwd)
        details.update(slots=C, table=routed.decision.candidate, max_mean=round(routed.max_over_mean, 3),
                       ep_max_mean=round(routed.decision.ep_max_over_mean, 3), prefetch=plan.prefetch)
        buffers = (1 + plan.prefetch) * C * S_e * v["b"] + 3 * C * S_e * v["b_g"]

        def memory_of(sharded: bool, recompute: bool) -> dict[str, float]:
            return memory_breakdown(case, v, expert_params=case.layers * case.E * S_e / W, expert_dp=1,
                                    dense_params=dense_total, dense_dp=W, rows_max=float(routed.rows_PP.sum(0).max()),
                                    sharded_optimizer=sharded, recompute=recompute, buffers=buffers)
    elif plan.form == "locality":
        layout, memory_of = _locality_layout(plan, ctx, details, notes, router_fwd)
    else:
        ep = plan.ep
        if case.E % ep:
            raise ValueError(f"{case.label}: ep={ep} does not divide E={case.E}")
        cf = plan.capacity if plan.capacity is not None else case.capacity
        if cf is not None:  # each source rank sends an expert at most its capacity's rows
            counts = np.minimum(counts, cf * case.tokens * case.K / case.E)
        rows_PP = ep_formulas.rank_rows(counts[:ep], ep)
        expert_params = case.layers * case.E / ep * S_e
        expert_dp: float = W // ep
        dense_params = dense_total / plan.tp
        dense_dp = W // plan.tp
        buffers = 0.0
        params = None
        expert_grads = None
        migration = 0.0
        tp_comm = 0.0
        if plan.replicating:
            C = case.E // ep + plan.replicas
            rows_PP, copies_E = _replicated_rows(counts, trace.history, case.per_node, C)
            expert_params = case.layers * C * S_e
            expert_dp = W * C / case.E  # each expert's copies, on average (module docstring)
            expert_grads = ExpertGrads(C * S_e * v["b_g"], max(2, round(expert_dp)), ar_bw)
            # a re-placement moves one slot per device (weights + optimizer state) once per interval
            migration = S_e * v["s"] / ar_bw / REPLACE_INTERVAL
            details.update(slots=C, copies=",".join(str(c) for c in copies_E))
        if plan.tp > 1:
            tp_comm = 4 * (plan.tp - 1) * case.tokens * case.D * v["b"] / v["B_intra"] + 4 * v["alpha"]
            details.update(tp=plan.tp, tp_ms_per_layer=round(2 * tp_comm * 1e3, 4))
        if plan.fsdp:
            local = case.E / ep * S_e

            def both(b: float) -> float:
                return ring_half(local * b, expert_dp, ar_bw, v["alpha"]) + ring_half(
                    case.dense_params * b, W, ar_bw, v["alpha"])

            params = ParamTraffic(both(v["b"]), both(v["b"]), both(v["b_g"]), depth=1, dense=True)
            buffers = (1 + params.depth) * (local + case.dense_params) * v["b"] + (local + case.dense_params) * v["b_g"]
            details.update(fsdp=expert_dp)
        layout = Layout(rows_PP, params=params, expert_grads=expert_grads,
                        dense_grad_bytes=case.dense_params / plan.tp * v["b_g"], dense_dp=dense_dp, tp_comm=tp_comm,
                        router_fwd=router_fwd, migration=migration, split_exchange=cf is None)
        rows_max = float(rows_PP.sum(axis=0).max())

        def memory_of(sharded: bool, recompute: bool) -> dict[str, float]:
            if plan.fsdp:
                return memory_breakdown(case, v, expert_params=expert_params / expert_dp, expert_dp=1,
                                        dense_params=dense_total / W, dense_dp=1, rows_max=rows_max,
                                        sharded_optimizer=False, recompute=recompute, buffers=buffers,
                                        fully_sharded=True)
            return memory_breakdown(case, v, expert_params=expert_params, expert_dp=expert_dp,
                                    dense_params=dense_params, dense_dp=dense_dp, rows_max=rows_max,
                                    sharded_optimizer=sharded, recompute=recompute, buffers=buffers)

    memory, sharded, recompute, feasible = _fit(memory_of, hw)
    replicated_bytes = memory_of(False, False)["total"]  # as moepass builds a plan: what a model's search checks
    if recompute:
        layout = replace(layout, recompute=True)
    details.update(sharded_optimizer=sharded, recompute=recompute, replicated_bytes=replicated_bytes)
    return Laid(plan, layout, memory, feasible, details, notes)


def _replicated_rows(counts_WE: np.ndarray, history_aWE: np.ndarray, ranks_per_node: int,
                     C: int) -> tuple[np.ndarray, list[int]]:
    """FlexMoE's layout (module docstring) over all W ranks with C slots each, placed from the loads of the
    steps before: returns the [src, dst] rows of the current step and the copies of each expert."""
    from moepass.runtime.placement import place, proportional_replicas  # moepass's package imports cost_model.search

    W, E = counts_WE.shape
    seen_E = [int(x) for x in fsep_formulas.integer_rows(history_aWE.sum(axis=0)).sum(axis=0)]
    copies_E = proportional_replicas(seen_E, W * C, 1)
    slot_expert = np.asarray(place(copies_E, seen_E, W, C, ranks_per_node))
    hosts_EP = np.zeros((E, W))
    np.add.at(hosts_EP, (slot_expert, np.arange(W * C) // C), 1.0)  # copies of expert e on device r
    rows_PP = (counts_WE / np.asarray(copies_E, dtype=float)) @ hosts_EP
    return rows_PP, copies_E


def _locality_layout(plan: StepPlan, ctx: CaseContext, details: dict[str, Any], notes: list[str],
                     router_fwd: float) -> tuple[Layout, Any]:
    """A top-1 router on LocMoE's placement (`cost_model.locality`): each expert on one home node, tokens
    exchanged over all W ranks; the router's locality ratio sets the node split of its rows."""
    case, v = ctx.case, ctx.hw.values()
    if case.K != 1:
        raise ValueError(f"{case.label}: top_k={case.K}: locality routing (LocMoE) and its baselines are top-1")
    try:
        placement = locality.Placement(case.E, case.nodes, case.per_node)
    except ValueError as err:
        raise ValueError(f"{case.label} ({plan.system or plan.label}): {err}") from None
    system: dict[str, Any] = next((s for s in ctx.scenario.get("systems") or [] if s.get("id") == plan.system), {})
    given = system.get("locality_ratio")
    lam = float(given) if given is not None else locality.router_ratio(
        "locmoe" if plan.router == "locmoe" else "switch", placement)
    capacity = locality.capacity_rows(case.tokens, case.E, system.get("capacity_factor"),
                                      float(system.get("delta", 0.0)), case.D)
    counts_PE = locality.routing_counts(placement, case.tokens, lam)
    if plan.router != "hash":  # the learned routers' measured skew over the experts, on top of their node split
        skew = ctx.trace(plan.router).current
        mean = skew.mean(axis=1, keepdims=True)
        counts_PE = counts_PE * (skew / mean)
        counts_PE = counts_PE * (case.tokens / counts_PE.sum(axis=1, keepdims=True))
    rows_PP = locality.rows_matrix(placement, counts_PE, capacity)
    text = (f"locality set-up: each of the E experts on one home node, tokens exchanged over all W ranks "
            f"(cost_model.locality.Placement; the set-up's expert/model parallel degrees not modelled); LocMoE's "
            f"locality ratio 1 - {locality.MEASURED_INTER_FACTOR} x (1 - k/E) (our measured inter-node factor, "
            f"benchmarks/results/locality.json); dropless unless a system gives capacity_factor")
    if text not in ctx.assumptions:
        ctx.assumptions.append(text)
    m = ep_formulas.matmuls(case.gated)
    expert = float(fsep_formulas.expert_elements(case.D, case.F, m)) * placement.rank_experts
    replicas = len(placement.hosts(0))
    grads = ExpertGrads(expert * v["b_g"], replicas, v["B_intra"])  # replicas share a node
    dispatch = ep_formulas.exact_a2a(rows_PP, case.D, int(v["b"]), case.per_node)
    per_step = 2 * case.layers
    inter_W = per_step * (dispatch.sent_inter + dispatch.recv_inter)
    intra_W = per_step * (dispatch.sent_intra + dispatch.recv_intra)
    extra = {"locality_ratio": lam, "inter_node_bytes": float(inter_W.mean()),
             "intra_node_bytes": float(intra_W.mean())}
    source = " (the set-up's)" if given is not None else ""
    line = (f"{case.label} {plan.system or plan.label} ({plan.router}): locality ratio {lam:.4g}{source}, per rank per "
            f"step inter-node {inter_W.mean() / 1e9:.4g} GB, intra-node {intra_W.mean() / 1e9:.4g} GB")
    if placement.nodes_gt_experts:
        expertless = case.per_node * next(n for n in range(case.nodes) if not placement.local_experts(n))
        extra["inter_node_bytes_expertless"] = float(inter_W[expertless])
        line += f" (a rank of an expert-less node: {inter_W[expertless] / 1e9:.4g} GB, whatever the router)"
        notes.append(f"{case.label}: {case.nodes} nodes > {case.E} experts: {case.nodes - case.E} nodes hold no "
                     f"local expert, every token of theirs crosses nodes (locality pays only on the experts' nodes)")
    notes.append(line)
    details.update({"router": plan.router, "a2a": f"W={placement.ranks}", "experts/node": placement.node_experts,
                    "replicas": replicas, "cap": capacity if capacity is not None else "none",
                    "extra_breakdown": extra})
    rows_max = float(rows_PP.sum(axis=0).max())

    def memory_of(sharded: bool, recompute: bool) -> dict[str, float]:
        return memory_breakdown(case, v, expert_params=case.layers * expert, expert_dp=replicas * case.nodes
                                if placement.nodes_gt_experts else replicas, dense_params=case.dense_params *
                                case.layers, dense_dp=ctx.W, rows_max=rows_max, sharded_optimizer=sharded,
                                recompute=recompute)

    return Layout(rows_PP, expert_grads=grads, router_fwd=router_fwd, split_exchange=capacity is None), memory_of


def _price_hp(plan: StepPlan, ctx: CaseContext) -> Priced:
    """HP over P ranks: the case's block converted to a Multi-Head LatentMoE of equal active parameters
    (the set-up's HP model gives heads / head_dim, or `moepass.rewrite.latent`'s defaults). Per layer,
    forward: dense part, w_in, dispatch, routing + experts, combine, w_out, each waiting for the one before;
    the backward mirrors it at twice the compute. The head gradients are all-reduced over their W/P replicas,
    w_in/w_out with the dense gradients over all W (DDP buckets)."""
    from moepass.plan import Plan
    from moepass.rewrite.latent import latent_shape

    case, hw, W = ctx.case, ctx.hw, ctx.W
    v = hw.values()
    P = plan.ep
    G, m, rate = case.per_node, ep_formulas.matmuls(case.gated), v["R"] * v["eta"]
    model: dict[str, Any] = next((x for x in ctx.scenario.get("models") or [] if x.get("form") == "hp"), {})
    shape = latent_shape(case_spec(case), Plan(form="hp", heads=model.get("heads"), head_dim=model.get("head_dim"),
                                               ep_size=P), P)
    H, h, E, K, F = shape.heads, shape.head_dim, shape.experts, shape.top_k, shape.ffn_dim
    text = (f"{model.get('id', 'hp')}: sizes not given: each EP case converted to a Multi-Head LatentMoE of equal "
            f"active parameters (moepass.rewrite.latent: H = {H} heads of h = D/H, the case's E per head and top-k), "
            f"head parallel over the plan's P ranks")
    if model.get("heads") is None and plan.system is not None and text not in ctx.assumptions:
        ctx.assumptions.append(text)
    T = case.tokens
    proj_fwd = 2 * T * case.D * H * h / rate
    expert_fwd = float(hp_formulas.layer_flops(T, case.D, H, h, E, K, F, m)) / rate - 2 * proj_fwd
    dense_fwd = dense_flops(case) / rate
    intra, inter = hp_formulas.exchange_bytes(T, H, h, P, G, v["b"])
    exchange = float(ep_formulas.a2a_time(intra, inter, v["B_intra"], v["B_inter"], v["alpha"])) if P > 1 else 0.0
    ar_bw = v["B_inter"] if case.nodes > 1 else v["B_intra"]
    head_params = float(hp_formulas.head_params_per_rank(H, h, E, F, m, P))
    replicated = float(hp_formulas.projection_params(case.D, H, h)) + case.dense_params

    def memory_of(sharded: bool, recompute: bool) -> dict[str, float]:
        per_layer = float(hp_formulas.memory_per_rank(T, case.D, H, h, E, K, F, m, P, 0, v["b"]))
        states = case.layers * (state_bytes(head_params, v, W // P if sharded else 1)
                                + state_bytes(replicated, v, W if sharded else 1))
        acts = case.layers * T * case.D * v["b"] + per_layer if recompute else case.layers * per_layer
        return {"weights+grads+optimizer": states, "activations": acts, "buffers": 0.0, "total": states + acts}

    memory, sharded, recompute, feasible = _fit(memory_of, hw)
    replicated_bytes = memory_of(False, False)["total"]  # as moepass builds a plan: what a model's search checks
    tl = Timeline()
    last = tl.add("compute", "start", 0.0)
    for layer in range(case.layers):
        last = tl.add("compute", f"L{layer}.fwd.dense", dense_fwd, [last])
        for name, work, stream in (("w_in", proj_fwd, "compute"), ("dispatch", exchange, "a2a"),
                                   ("experts", expert_fwd, "compute"), ("combine", exchange, "a2a"),
                                   ("w_out", proj_fwd, "compute")):
            last = tl.add(stream, f"L{layer}.fwd.{name}", work, [last])
    for layer in reversed(range(case.layers)):
        if recompute:
            last = tl.add("compute", f"L{layer}.bwd.recompute", dense_fwd + expert_fwd + 2 * proj_fwd, [last])
        for name, work, stream in (("w_out", 2 * proj_fwd, "compute"), ("combine", exchange, "a2a"),
                                   ("experts", 2 * expert_fwd, "compute"), ("dispatch", exchange, "a2a"),
                                   ("w_in", 2 * proj_fwd, "compute")):
            last = tl.add(stream, f"L{layer}.bwd.{name}", work, [last])
            if name == "experts":
                allreduce_ops(tl, f"L{layer}.head_grads", head_params * v["b_g"], W // P, ar_bw, v,
                           plan.bucket, [last])
        last = tl.add("compute", f"L{layer}.bwd.dense", 2 * dense_fwd, [last])
        allreduce_ops(tl, f"L{layer}.replicated_grads", replicated * v["b_g"], W, ar_bw, v, plan.bucket, [last])
    tl.run(plan.sched)
    dense = case.layers * (3 * dense_fwd + (dense_fwd if recompute else 0.0))
    figures = {"dense_compute": dense, "imbalance": 1.0, "recompute": case.layers * (dense_fwd + expert_fwd) * recompute,
               "token_a2a_bytes": case.layers * float(hp_formulas.step_bytes(T, H, h, P, v["b"]))}
    breakdown = breakdown_of(tl, figures)
    breakdown["projection_compute"] = case.layers * 3 * 2 * proj_fwd
    details = {"hp": P, "heads": H, "head_dim": h, "ffn": F, "sharded_optimizer": sharded, "recompute": recompute,
               "replicated_bytes": replicated_bytes}
    notes = [] if feasible else [f"{case.label} {plan.system or plan.label}: {memory['total'] / 1e9:.3g} GB/rank "
                                 f"exceeds {float(hw.memory) / 1e9:.3g} GB"]
    return Priced(plan, tl.step, breakdown, memory, feasible, details, notes)


def case_spec(case: Case) -> Any:
    """The MoESpec of a case's block (SwiGLU when gated, GELU otherwise), for the HP conversion."""
    from moepass.spec import ExpertsSpec, MoESpec, RouterSpec, TensorSource

    gated = case.gated
    return MoESpec(
        path="scenario",
        recogniser="scenario",
        router=RouterSpec(num_experts=case.E, top_k=case.K),
        experts=ExpertsSpec(num_experts=case.E, hidden_dim=case.D, ffn_dim=case.F,
                            activation="swiglu" if gated else "gelu",
                            w_up=TensorSource.param("experts.w_up") if gated else None),
    )
