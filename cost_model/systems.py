"""One step of one plan on one scenario case, priced on the step timeline: the function the plan search
(`cost_model.search.search_scenario`) ranks with and the simulator (`cost_model.simulate`) reports.

A `StepPlan` is one way to run a case: moepass's forms with their options (EP over any degree with
chunks and the gradient schedule, FSEP with any slot count and prefetch depth, HP, locality routing, no
rewrite), and the published baselines moepass does not build (tensor parallel x expert parallel,
FSDP+EP, replication-based balancing). `price` lays one step out on the timeline of the busiest rank
(`cost_model.timeline`): per layer the dense part, the dispatch all-to-all, expert compute and the combine,
forward then backward, with the gradient collectives on the "other" stream sharing the link (fair share or
Lina's priority). `system_plan` reads a scenario's system entry into its `StepPlan`; `plan_space` lists the
plans the search ranks for a case. Both read the case's routing through `routing_trace` (one process over
steps, `RoutingTrace`), so a system and the search's plan of the same form price the same rows.

Baselines, each its own formula:
- TP x EP (Megatron; `tp` from the system or its note, "TP 8 (e8k2)"): the attention of a layer is tensor
  parallel over tp ranks of a node with sequence parallelism: per layer and pass two all-gathers and two
  reduce-scatters of the TP group's activations ((tp-1) T D b bytes per rank each) that the compute waits
  for (not overlapped); the dense gradients are 1/tp per rank, all-reduced over W/tp ranks. Experts: EP.
- FSDP+EP: EP for the experts; the experts sharded over their W/ep replicas and the dense weights over W:
  an all-gather of both before the forward and the backward (one layer prefetched), a reduce-scatter of the
  gradients.
- Replication-based balancing (FlexMoE): EP's layout plus `replicas` extra expert slots per device; the
  hottest experts (by the counts of the steps before) are copied into them and their tokens split evenly
  over the copies; the copies' gradients are all-reduced with the expert gradients (one more expert per
  device), and the weights and optimizer state that move when the placement changes (migration) are sent
  on the "other" stream, amortised over the re-placement interval.
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

Shape legend: S source ranks, R destination ranks, E experts, W ranks, H history steps.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from cost_model import ep as ep_formulas
from cost_model import fsep as fsep_formulas
from cost_model import hp as hp_formulas
from cost_model import locality
from cost_model.presets import Hardware
from cost_model.scenarios import Case
from cost_model.schedule import DDP_BUCKET_BYTES
from cost_model.timeline import Timeline

# The switch router's per-device max/mean rows measured in this project's own training run
# (benchmarks/results/locality.json, by_data.iid.per_system.switch: top-1 learned gate with aux loss 0.01,
# E = 8 experts on 2 ranks, 200 steps, dropless: the median over steps of max/mean of the rows each rank
# computes, local + received). The same run kept every assignment (kept_fraction 1.0: no drops).
MEASURED_SWITCH_MAX_MEAN = 1.194
MEASURED_SWITCH_SHAPE = (8, 2)  # (experts, ranks) it was measured at
# Routing drift when the set-up gives skewed routing but no trace: each expert's log-popularity follows
# an AR(1) process around its Zipf value, z_{t+1} = rho z_t + sigma sqrt(1 - rho^2) eps (stationary std sigma).
# No published figure: assumed, stated in the output, overridable by routing.drift {"sigma", "rho"}.
DRIFT_SIGMA = 0.2
DRIFT_RHO = 0.9
DRIFT_SEED = 0
HISTORY = 5  # steps the FSEP / replication planners see (LAER's "5-step history"; a system's note overrides)
REPLACE_INTERVAL = 50  # FlexMoE: steps between re-placements (migration amortised over them), assumed
CHUNKS = (1, 2, 4, 8, 16, 32)
PACKINGS = (1, 2, 4)


# ---- the routing of a case, as a process over steps --------------------------------------------------------


@dataclass(frozen=True)
class RoutingTrace:
    """[steps, W, E] routed rows (every source rank of the cluster), and the step priced: `current`;
    the steps before it are what a planner sees (`history`)."""

    steps_HWE: np.ndarray
    description: str

    @property
    def current(self) -> np.ndarray:
        return self.steps_HWE[-1]

    @property
    def history(self) -> np.ndarray:
        return self.steps_HWE[:-1]


def _drift_steps(base_E: np.ndarray, T: int, K: int, W: int, steps: int, sigma: float, rho: float,
                 seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    E = len(base_E)
    z = rng.standard_normal(E) * sigma
    out = np.empty((steps, W, E))
    for t in range(steps):
        p = base_E * np.exp(z)
        out[t] = np.tile(T * K * p / p.sum(), (W, 1))
        z = rho * z + sigma * math.sqrt(1 - rho**2) * rng.standard_normal(E)
    return out


def routing_trace(routing: dict[str, Any], case: Case, router: str, assumptions: list[str],
                  history: int = HISTORY) -> RoutingTrace:
    """The routed rows of `case` over `history` + 1 steps, from the set-up's routing: a recorded
    [src rank, expert] matrix (`counts`: static), else a Zipf popularity (`zipf_s`, or fitted to `max_mean` /
    the note's max/mean figure at the case's EP degree) that drifts (`DRIFT_*`, `routing.drift`); none given:
    uniform and static. `router` "hash": uniform whatever the set-up (hashing ignores the token's content);
    "switch" in a set-up without routing figures: the measured `MEASURED_SWITCH_MAX_MEAN`."""
    T, K, E, W = case.tokens, case.K, case.E, case.nodes * case.per_node
    steps = history + 1

    def note(text: str) -> None:
        if text not in assumptions:
            assumptions.append(text)

    def static(counts_WE: np.ndarray, text: str) -> RoutingTrace:
        return RoutingTrace(np.repeat(counts_WE[None], steps, axis=0), text)

    uniform = ep_formulas.zipf_counts(T, K, E, W, 0.0)
    if router == "hash":
        return static(uniform, "hash: uniform")
    if routing.get("trace") is not None:
        steps_HSE = np.asarray(routing["trace"], dtype=np.float64)
        steps_HSE = steps_HSE[None] if steps_HSE.ndim == 2 else steps_HSE
        if steps_HSE.ndim != 3 or steps_HSE.shape[-1] != E or (steps_HSE.sum(axis=2) <= 0).any():
            raise ValueError(f"routing trace of shape {steps_HSE.shape} is invalid for {case.label}: give routed rows "
                             f"[steps, source ranks, E={E}] (or [source ranks, E]), every row with some tokens")
        steps_HSE = steps_HSE * (T * K / steps_HSE.sum(axis=2, keepdims=True))  # rescaled to this case's tokens
        steps_HWE = steps_HSE[-steps:][:, np.arange(W) % steps_HSE.shape[1]]
        if len(steps_HWE) == 1:
            return static(steps_HWE[0], "recorded counts (one step: the planner sees it as its history)")
        note(f"routing: a recorded trace of {len(steps_HSE)} steps; the last priced, the {len(steps_HWE) - 1} before "
             f"it are the planners' history")
        return RoutingTrace(steps_HWE, f"recorded trace ({len(steps_HWE)} steps)")
    if routing.get("counts") is not None:
        counts = np.asarray(routing["counts"], dtype=np.float64)
        counts = counts * (T * K / counts.sum(axis=1, keepdims=True))  # rescaled to this case's tokens
        return static(counts[np.arange(W) % len(counts)], "recorded counts")
    s = routing.get("zipf_s")
    target = routing.get("max_mean")
    if s is None and target is None and routing.get("note"):
        found = re.search(r"max/mean[^0-9]*([0-9]+(?:\.[0-9]+)?)", routing["note"])
        target = float(found.group(1)) if found else None
    if s is None and target is None and router == "switch":
        e0, r0 = MEASURED_SWITCH_SHAPE
        s = ep_formulas.zipf_for_imbalance(MEASURED_SWITCH_MAX_MEAN, T, K, E, case.ep)
        note(f"learned top-1 routers (switch, LocMoE): Zipf popularity fitted per case to the max/mean "
             f"{MEASURED_SWITCH_MAX_MEAN} of rows per device measured in this project's training run "
             f"(benchmarks/results/locality.json: E={e0} on {r0} ranks, top-1, aux loss 0.01, no drops), at the "
             f"case's EP degree, static; the hash router uniform")
        return static(ep_formulas.zipf_counts(T, K, E, W, s), f"switch: measured max/mean {MEASURED_SWITCH_MAX_MEAN}")
    if s is None and target is None:
        note("routing not given: uniform (max/mean 1), static")
        return static(uniform, "uniform")
    if s is None and target is not None:
        s = ep_formulas.zipf_for_imbalance(float(target), T, K, E, case.ep)
        note(f"routing: Zipf s fitted to max/mean {target} at each case's EP degree (from the set-up's routing figure)")
    assert s is not None  # a figure was given: zipf_s, or max_mean fitted above
    drift = routing.get("drift") or {}
    sigma, rho = float(drift.get("sigma", DRIFT_SIGMA)), float(drift.get("rho", DRIFT_RHO))
    note(f"routing moves: each expert's log-popularity drifts as AR(1) around its Zipf value (std sigma={sigma:g}, "
         f"step correlation rho={rho:g}, seed {DRIFT_SEED}; assumed, routing.drift overrides); planners see the "
         f"{history} steps before the priced one, never the priced step")
    p = 1.0 / np.arange(1, E + 1, dtype=np.float64) ** float(s)
    p = p[np.random.default_rng(0).permutation(E)]  # zipf_counts' placement of the popularity ranks
    return RoutingTrace(_drift_steps(p, T, K, W, steps, sigma, rho, DRIFT_SEED), f"Zipf s={float(s):.3g} drifting")


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
    replicas: int = 0  # replication-based balancing: extra expert slots per device (FlexMoE)
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
            text += f" +{self.replicas} replica slots" if self.replicas else ""
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
                trace = RoutingTrace(trace.steps_HWE * phi, f"{trace.description}, {phi:.3g} of them to FFN experts")
            self.traces[key] = trace
        return self.traces[key]

    @property
    def locality_setup(self) -> bool:
        return any(s.get("form") == "locality" for s in self.scenario.get("systems") or [])


# ---- the timeline of one step ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamTraffic:
    """Per-layer parameter collectives of a layout whose weights are sharded (FSEP, FSDP+EP), in seconds:
    `gather_fwd` before the layer's forward, `gather_bwd` before its backward, `grads` after its backward
    expert compute (no expert all-reduce then); `depth` layers gathered ahead; `dense`: the dense weights
    travel with them (no dense all-reduce; the dense compute waits for the gather)."""

    gather_fwd: float
    gather_bwd: float
    grads: float
    depth: int
    dense: bool = False


@dataclass(frozen=True)
class ExpertGrads:
    """The expert gradient all-reduce of a layout that is not EP's: `nbytes` per rank over `replicas` ranks at
    `bandwidth` bytes/s."""

    nbytes: float
    replicas: int
    bandwidth: float


def _allreduce(tl: Timeline, name: str, nbytes: float, dp: int, B: float, alpha: float, bucket_bytes: float,
               deps: list[int]) -> None:
    """A gradient all-reduce on the "other" stream, in pieces of `bucket_bytes` (none over one rank)."""
    if dp == 1 or nbytes <= 0:
        return
    pieces = max(1, math.ceil(nbytes / bucket_bytes))
    tl.add("other", f"{name}.ar", pieces * ep_formulas.allreduce_time(nbytes / pieces, dp, B, alpha), deps, pieces)


def _ring_half(nbytes: float, group: int, B: float, alpha: float) -> float:
    """An all-gather or a reduce-scatter of `nbytes` (the full tensor) over `group` ranks: half a ring all-reduce."""
    return 0.0 if group == 1 else alpha + (group - 1) * nbytes / (group * B)


def dense_flops(case: Case) -> float:
    """Forward FLOPs of a layer's dense part: the attention projections (4 D x D) and scores (seq x D)."""
    return float(ep_formulas.dense_flops(case.tokens, case.D, case.seq or 0))


@dataclass(frozen=True)
class Layout:
    """What the timeline needs of a plan: the token rows, the parameter traffic, the extra per-layer work."""

    rows_SR: np.ndarray  # [src, dst] routed rows of one all-to-all group
    params: ParamTraffic | None = None
    expert_grads: ExpertGrads | None = None
    dense_grad_bytes: float | None = None  # per rank (None: the case's dense parameters)
    dense_dp: int | None = None  # ranks the dense gradients are all-reduced over (None: W)
    tp_comm: float = 0.0  # seconds per layer and pass the compute waits for (TP's all-gathers / reduce-scatters)
    router_fwd: float = 0.0  # seconds of the gate GEMM per layer forward
    recompute: bool = False
    migration: float = 0.0  # seconds per layer of parameter moves on the "other" stream (amortised)
    split_exchange: bool = False  # dropless EP: the split sizes are exchanged (one small all-to-all) before the dispatch


def timeline_step(case: Case, hw: Hardware, layout: Layout, *, chunks: int, policy: str,
                  bucket_bytes: float) -> tuple[Timeline, dict[str, float]]:
    """Lay out one step of `case` under `layout`; returns the run timeline and the per-layer figures."""
    v = hw.values()
    W = case.nodes * case.per_node
    m = ep_formulas.matmuls(case.gated)
    rows_SR = layout.rows_SR
    ep = rows_SR.shape[0]
    dispatch = ep_formulas.exact_a2a(rows_SR, case.D, int(v["b"]), case.per_node)
    a2a_full = dispatch.time(v["B_intra"], v["B_inter"], v["alpha"]) if ep > 1 else 0.0
    transfer = max(0.0, a2a_full - v["alpha"]) if ep > 1 else 0.0
    rows_max = float(dispatch.computed_rows.max())
    rate = v["R"] * v["eta"]
    gemm_fwd = ep_formulas.expert_flops(rows_max, case.D, case.F, m) / rate
    # host-side work of a layer step (`cost_model.ep.host_time`: 0 unless calibrated), a third in the forward as
    # the GEMMs; the backward's GEMMs twice the forward's, plus the gate/up recomputed where the kernel does (r_c)
    host = ep_formulas.host_time(rows_max, case.D, case.F, case.E, ep, c_layer=v["c_layer"], c_expert=v["c_expert"],
                                 c_row=v["c_row"], c_act=v["c_act"])
    expert_fwd = gemm_fwd + host / 3 + layout.router_fwd
    expert_bwd = (2 + v["r_c"] * (m - 1) / m) * gemm_fwd + 2 * host / 3 + 2 * layout.router_fwd
    dense_fwd = dense_flops(case) / rate
    ar_bw = v["B_inter"] if case.nodes > 1 else v["B_intra"]
    expert_grads = layout.expert_grads or ExpertGrads(
        ep_formulas.expert_params(case.E, case.D, case.F, m) / ep * v["b_g"], W // ep, ar_bw)
    dense_grad = case.dense_params * v["b_g"] if layout.dense_grad_bytes is None else layout.dense_grad_bytes
    dense_dp = W if layout.dense_dp is None else layout.dense_dp
    params = layout.params

    def moe(prefix: str, compute: float, after: int, weights: list[int]) -> list[int]:
        """Chunked dispatch -> expert compute -> combine; issue order d1 d2 c1 d3 c2 ... (schedule.py)."""
        if ep == 1:
            return [tl.add("compute", f"{prefix}.experts", compute, [after, *weights])]
        t_a = v["alpha"] + transfer / chunks
        exp: list[int] = []
        comb: list[int] = []
        if layout.split_exchange:
            after = tl.add("a2a", f"{prefix}.splits", v["alpha"], [after])
        disp = [tl.add("a2a", f"{prefix}.dispatch0", t_a, [after])]
        for j in range(chunks):
            exp.append(tl.add("compute", f"{prefix}.experts{j}", compute / chunks, [disp[j], *weights] + exp[-1:]))
            if j + 1 < chunks:
                disp.append(tl.add("a2a", f"{prefix}.dispatch{j + 1}", t_a, [after]))
            comb.append(tl.add("a2a", f"{prefix}.combine{j}", t_a, [exp[j]]))
        return comb + exp

    def tp(prefix: str, after: int) -> int:
        """TP's collectives of a pass, waited by the compute (on the token link: intra-node)."""
        if layout.tp_comm <= 0:
            return after
        return tl.add("a2a", f"{prefix}.tp", layout.tp_comm, [after])

    tl = Timeline()
    gathered: dict[tuple[str, int], int] = {}

    def gather(phase: str, layer: int, deps: list[int]) -> None:
        if params is not None and 0 <= layer < case.layers:
            work = params.gather_fwd if phase == "fwd" else params.gather_bwd
            gathered[(phase, layer)] = tl.add("other", f"L{layer}.{phase}.gather", work, deps)

    def weights(phase: str, layer: int) -> list[int]:
        return [gathered[(phase, layer)]] if (phase, layer) in gathered else []

    depth = params.depth if params is not None else 0
    last = tl.add("compute", "start", 0.0)
    for layer in range(depth + 1):
        gather("fwd", layer, [last])
    dense_first = params is not None and params.dense
    for layer in range(case.layers):
        dense = tl.add("compute", f"L{layer}.fwd.dense", dense_fwd,
                       [last, *(weights("fwd", layer) if dense_first else [])])
        dense = tp(f"L{layer}.fwd", dense)
        done = moe(f"L{layer}.fwd", expert_fwd, dense, [] if dense_first else weights("fwd", layer))
        gather("fwd", layer + depth + 1, done)
        last = tl.add("compute", f"L{layer}.fwd.end", 0.0, done)
    for layer in reversed(range(case.layers - depth - 1, case.layers)):
        gather("bwd", layer, [last])
    for layer in reversed(range(case.layers)):
        if layout.recompute:  # the layer's forward again, from its kept input (token rows cached)
            last = tl.add("compute", f"L{layer}.bwd.recompute", dense_fwd + expert_fwd, [last])
        done = moe(f"L{layer}.bwd", expert_bwd, last, weights("bwd", layer))
        if params is None:
            _allreduce(tl, f"L{layer}.expert_grads", expert_grads.nbytes, expert_grads.replicas, expert_grads.bandwidth,
                       v["alpha"], bucket_bytes, done)
        else:
            gather("bwd", layer - depth - 1, done)
            tl.add("other", f"L{layer}.grads", params.grads, done)
        if layout.migration > 0:
            tl.add("other", f"L{layer}.migration", layout.migration, done)
        last = tl.add("compute", f"L{layer}.bwd.dense", 2 * dense_fwd, done)
        last = tp(f"L{layer}.bwd", last)
        if params is None or not params.dense:
            _allreduce(tl, f"L{layer}.dense_grads", dense_grad, dense_dp, ar_bw, v["alpha"], bucket_bytes, [last])
    tl.run(policy)
    busiest = float((dispatch.sent + dispatch.transposed().sent).max()) if ep > 1 else 0.0  # dispatch + combine
    recomputed = (dense_fwd + expert_fwd) if layout.recompute else 0.0
    return tl, {
        "expert_fwd": expert_fwd,
        "dense_fwd": dense_fwd,
        "dense_compute": case.layers * (3 * dense_fwd + (dense_fwd if layout.recompute else 0.0)),
        "recompute": case.layers * recomputed,
        "token_a2a_bytes": case.layers * 2 * busiest,  # forward and backward
        "rows_max": rows_max,
        "imbalance": rows_max / max(float(rows_SR.sum()) / ep, 1e-30),
    }


def breakdown_of(tl: Timeline, figures: dict[str, float]) -> dict[str, float]:
    """A simulated step's figures: expert vs dense compute, exposed and busy communication."""
    b = tl.breakdown()
    dense = figures["dense_compute"]
    return {
        "expert_compute": b["compute"] - dense,
        "dense_compute": dense,
        "exposed_a2a": b["exposed_a2a"],
        "exposed_other": b["exposed_other"],
        "a2a_busy": b["a2a_busy"],
        "other_busy": b["other_busy"],
        "max_a2a_wait": b["max_a2a_wait"],
        "imbalance": figures["imbalance"],
        "token_a2a_bytes": figures["token_a2a_bytes"],
        "recompute": figures["recompute"],
    }


# ---- memory ------------------------------------------------------------------------------------------------


def _state(params: float, v: dict[str, float], shard: int) -> float:
    """Bytes of `params` parameters with their gradients and optimizer state (s per parameter), the optimizer
    state (s - b - b_g: fp32 master and Adam moments) sharded over `shard` ranks (1: replicated)."""
    rest = v["s"] - v["b"] - v["b_g"]
    return params * (v["b"] + v["b_g"] + rest / shard)


def activation_bytes(case: Case, rows: float, b: float) -> float:
    """Activations one MoE layer keeps for backward (`cost_model.ep.memory_per_rank` without weights)."""
    return float(ep_formulas.memory_per_rank(0, 1, case.D, case.F, ep_formulas.matmuls(case.gated), 0, rows, b))


def memory_breakdown(case: Case, v: dict[str, float], *, expert_params: float, expert_dp: int, dense_params: float,
                     dense_dp: int, rows_max: float, sharded_optimizer: bool, recompute: bool,
                     buffers: float = 0.0, fully_sharded: bool = False) -> dict[str, float]:
    """Bytes per rank by part. `expert_params` / `dense_params`: the parameters one rank owns over all layers
    (already divided by EP / TP / FSDP); `expert_dp` / `dense_dp`: the ranks that hold copies of them (the
    optimizer state shards over them when `sharded_optimizer`); `fully_sharded`: the parameters themselves
    are shards (FSDP, FSEP: no further sharding); `buffers`: gathered / restored weights in flight."""
    if fully_sharded:
        states = (expert_params + dense_params) * v["s"]
    else:
        states = (_state(expert_params, v, expert_dp if sharded_optimizer else 1)
                  + _state(dense_params, v, dense_dp if sharded_optimizer else 1))
    per_layer = activation_bytes(case, rows_max, v["b"])
    if recompute:  # each layer's input kept; one layer's activations alive while it is recomputed
        acts = case.layers * case.tokens * case.D * v["b"] + per_layer
    else:
        acts = case.layers * per_layer
    total = states + acts + buffers
    return {"weights+grads+optimizer": states, "activations": acts, "buffers": buffers, "total": total}


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


def price(plan: StepPlan, ctx: CaseContext) -> Priced:
    """One step of `plan` on `ctx`'s case (module docstring). Plans that differ only in their name (the
    system, Lina's packing label) are laid out once per case."""
    key = replace(plan, system=plan.system if plan.form == "locality" else None, packing=1, builds=True,
                  math_changing=False)
    if key not in ctx.priced:
        ctx.priced[key] = _price(plan, ctx)
    done = ctx.priced[key]
    return replace(done, plan=plan, breakdown=dict(done.breakdown), details=dict(done.details), notes=list(done.notes))


def _price(plan: StepPlan, ctx: CaseContext) -> Priced:
    if plan.form == "hp":
        return _price_hp(plan, ctx)
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
                                                            F=case.F, gated=case.gated, history_HWE=trace.history)
        routed = ctx.routed[key]

        def restore(b: float) -> float:
            return float(fsep_formulas.restore_time(C, S_e, W, case.per_node, b, v["B_intra"], v["B_inter"],
                                                    v["alpha"]))

        layout = Layout(routed.rows_SR, params=ParamTraffic(restore(v["b"]), restore(v["b"]), restore(v["b_g"]),
                                                            plan.prefetch), router_fwd=router_fwd)
        details.update(slots=C, table=routed.decision.candidate, max_mean=round(routed.max_over_mean, 3),
                       ep_max_mean=round(routed.decision.ep_max_over_mean, 3), prefetch=plan.prefetch)
        buffers = (1 + plan.prefetch) * C * S_e * v["b"] + 3 * C * S_e * v["b_g"]

        def memory_of(sharded: bool, recompute: bool) -> dict[str, float]:
            return memory_breakdown(case, v, expert_params=case.layers * case.E * S_e / W, expert_dp=1,
                                    dense_params=dense_total, dense_dp=W, rows_max=float(routed.rows_SR.sum(0).max()),
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
        rows_SR = ep_formulas.rank_rows(counts[:ep], ep)
        expert_params = case.layers * case.E / ep * S_e
        expert_dp = W // ep
        dense_params = dense_total / plan.tp
        dense_dp = W // plan.tp
        buffers = 0.0
        params = None
        expert_grads = None
        migration = 0.0
        tp_comm = 0.0
        if plan.replicas:
            rows_SR, copies = _replicated_rows(counts[:ep], trace.history[:, :ep].sum(axis=0), ep, plan.replicas)
            expert_params += case.layers * plan.replicas * S_e
            expert_grads = ExpertGrads((case.E / ep + plan.replicas) * S_e * v["b_g"], expert_dp, ar_bw)
            # a re-placement moves each device's replica slots (weights + optimizer state) once per interval
            migration = plan.replicas * S_e * v["s"] / ar_bw / REPLACE_INTERVAL
            details.update(replica_slots=plan.replicas, copies=copies)
        if plan.tp > 1:
            tp_comm = 4 * (plan.tp - 1) * case.tokens * case.D * v["b"] / v["B_intra"] + 4 * v["alpha"]
            details.update(tp=plan.tp, tp_ms_per_layer=round(2 * tp_comm * 1e3, 4))
        if plan.fsdp:
            local = case.E / ep * S_e

            def both(b: float) -> float:
                return _ring_half(local * b, expert_dp, ar_bw, v["alpha"]) + _ring_half(
                    case.dense_params * b, W, ar_bw, v["alpha"])

            params = ParamTraffic(both(v["b"]), both(v["b"]), both(v["b_g"]), depth=1, dense=True)
            buffers = (1 + params.depth) * (local + case.dense_params) * v["b"] + (local + case.dense_params) * v["b_g"]
            details.update(fsdp=expert_dp)
        layout = Layout(rows_SR, params=params, expert_grads=expert_grads,
                        dense_grad_bytes=case.dense_params / plan.tp * v["b_g"], dense_dp=dense_dp, tp_comm=tp_comm,
                        router_fwd=router_fwd, migration=migration, split_exchange=cf is None)
        rows_max = float(rows_SR.sum(axis=0).max())

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
    tl, figures = timeline_step(case, hw, layout, chunks=plan.chunks, policy=plan.sched, bucket_bytes=plan.bucket)
    breakdown = breakdown_of(tl, figures)
    breakdown.update(details.pop("extra_breakdown", {}))
    details.update(sharded_optimizer=sharded, recompute=recompute, replicated_bytes=replicated_bytes)
    if not feasible:
        notes.append(f"{case.label} {plan.system or plan.label}: {memory['total'] / 1e9:.3g} GB/rank exceeds "
                     f"{float(hw.memory) / 1e9:.3g} GB even with the optimizer sharded and activations recomputed")
    return Priced(plan, tl.step, breakdown, memory, feasible, details, notes)


def _replicated_rows(counts_SE: np.ndarray, seen_SE: np.ndarray, ep: int, replicas: int) -> tuple[np.ndarray, str]:
    """FlexMoE's layout: EP's contiguous experts plus `replicas` slots per device, filled greedily from the
    loads seen (the hottest expert per copy gets the next copy, on the least-loaded device that lacks it);
    the current step's tokens of an expert split evenly over its copies. Returns [src, dst] rows and the copies."""
    S, E = counts_SE.shape
    per = E // ep
    home = np.arange(E) // per
    hosts: list[list[int]] = [[int(home[e])] for e in range(E)]
    seen = seen_SE.sum(axis=0) if seen_SE.ndim == 2 else seen_SE
    load = np.zeros(ep)
    for e in range(E):
        load[home[e]] += seen[e]
    free = np.full(ep, replicas)
    for _ in range(ep * replicas):
        e = int(np.argmax([seen[k] / len(hosts[k]) for k in range(E)]))
        share = seen[e] / len(hosts[e])
        options = [d for d in range(ep) if free[d] > 0 and d not in hosts[e]]
        if not options:
            break
        d = min(options, key=lambda d: (load[d], d))
        for h in hosts[e]:
            load[h] -= share - seen[e] / (len(hosts[e]) + 1)
        hosts[e].append(d)
        load[d] += seen[e] / len(hosts[e])
        free[d] -= 1
    rows_SR = np.zeros((S, ep))
    for e in range(E):
        for h in hosts[e]:
            rows_SR[:, h] += counts_SE[:, e] / len(hosts[e])
    copies = ",".join(str(len(h)) for h in hosts)
    return rows_SR, copies


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
    counts_SE = locality.routing_counts(placement, case.tokens, lam)
    if plan.router != "hash":  # the learned routers' measured skew over the experts, on top of their node split
        skew = ctx.trace(plan.router).current
        mean = skew.mean(axis=1, keepdims=True)
        counts_SE = counts_SE * (skew / mean)
        counts_SE = counts_SE * (case.tokens / counts_SE.sum(axis=1, keepdims=True))
    rows_SR = locality.rows_matrix(placement, counts_SE, capacity)
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
    dispatch = ep_formulas.exact_a2a(rows_SR, case.D, int(v["b"]), case.per_node)
    per_step = 2 * case.layers
    inter_R = per_step * (dispatch.sent_inter + dispatch.recv_inter)
    intra_R = per_step * (dispatch.sent_intra + dispatch.recv_intra)
    extra = {"locality_ratio": lam, "inter_node_bytes": float(inter_R.mean()),
             "intra_node_bytes": float(intra_R.mean())}
    source = " (the set-up's)" if given is not None else ""
    line = (f"{case.label} {plan.system or plan.label} ({plan.router}): locality ratio {lam:.4g}{source}, per rank per "
            f"step inter-node {inter_R.mean() / 1e9:.4g} GB, intra-node {intra_R.mean() / 1e9:.4g} GB")
    if placement.nodes_gt_experts:
        expertless = case.per_node * next(n for n in range(case.nodes) if not placement.local_experts(n))
        extra["inter_node_bytes_expertless"] = float(inter_R[expertless])
        line += f" (a rank of an expert-less node: {inter_R[expertless] / 1e9:.4g} GB, whatever the router)"
        notes.append(f"{case.label}: {case.nodes} nodes > {case.E} experts: {case.nodes - case.E} nodes hold no "
                     f"local expert, every token of theirs crosses nodes (locality pays only on the experts' nodes)")
    notes.append(line)
    details.update({"router": plan.router, "a2a": f"W={placement.ranks}", "experts/node": placement.node_experts,
                    "replicas": replicas, "cap": capacity if capacity is not None else "none",
                    "extra_breakdown": extra})
    rows_max = float(rows_SR.sum(axis=0).max())

    def memory_of(sharded: bool, recompute: bool) -> dict[str, float]:
        return memory_breakdown(case, v, expert_params=case.layers * expert, expert_dp=replicas * case.nodes
                                if placement.nodes_gt_experts else replicas, dense_params=case.dense_params *
                                case.layers, dense_dp=ctx.W, rows_max=rows_max, sharded_optimizer=sharded,
                                recompute=recompute)

    return Layout(rows_SR, expert_grads=grads, router_fwd=router_fwd, split_exchange=capacity is None), memory_of


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
        states = case.layers * (_state(head_params, v, W // P if sharded else 1)
                                + _state(replicated, v, W if sharded else 1))
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
                _allreduce(tl, f"L{layer}.head_grads", head_params * v["b_g"], W // P, ar_bw, v["alpha"],
                           plan.bucket, [last])
        last = tl.add("compute", f"L{layer}.bwd.dense", 2 * dense_fwd, [last])
        _allreduce(tl, f"L{layer}.replicated_grads", replicated * v["b_g"], W, ar_bw, v["alpha"], plan.bucket, [last])
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


# ---- a scenario's systems, and the plans the search ranks ----------------------------------------------------


def _note(system: dict[str, Any]) -> str:
    return f"{system.get('id', '')} {system.get('note', '')} {system.get('routing', '')}".lower()


def tp_degree(system: dict[str, Any], model_id: str) -> int:
    """A system's tensor parallel degree: its `tp`, else its note's "TP 8 (e8k2)" for the model whose id ends
    in that tag, or a lone "TP 4"; 1 if none."""
    if system.get("tp") is not None:
        return int(system["tp"])
    text = str(system.get("note", ""))
    tagged = re.findall(r"TP\s*([0-9]+)\s*\(([^)]+)\)", text)
    for degree, tag in tagged:
        if model_id.endswith(tag.strip()) or tag.strip() in model_id:
            return int(degree)
    lone = re.findall(r"TP\s*([0-9]+)", text)
    return int(lone[0]) if len(lone) == 1 and not tagged else 1


def _ep_of(system: dict[str, Any], case: Case) -> int:
    """A system's EP degree: its `ep_size`, or the note's "EP 8" where it divides E and W, else the case's."""
    W = case.nodes * case.per_node
    given = system.get("ep_size")
    if given is None:
        found = re.search(r"\bEP\s*([0-9]+)", str(system.get("note", "")))
        given = int(found.group(1)) if found else None
    if given is not None and case.E % int(given) == 0 and W % int(given) == 0:
        return int(given)
    return case.ep


def model_of(sc: dict[str, Any], case: Case) -> dict[str, Any]:
    name = case.label.rsplit(" W=", 1)[0]
    for model in sc.get("models") or [sc.get("model") or {}]:
        mid = str(model.get("id", "model"))
        if name == mid or name.startswith(mid + "["):
            return model
    return {}


def slots_of(sc: dict[str, Any], case: Case, assumptions: list[str]) -> int:
    """C: the case's model's `expert_slots_per_device`, else ceil(E/W) (EP's share, stated as assumed)."""
    model = model_of(sc, case)
    if model.get("expert_slots_per_device"):
        return int(model["expert_slots_per_device"])
    W = case.nodes * case.per_node
    C = max(1, -(-case.E // W))
    text = f"{case.label}: expert slots per device not given: C = ceil(E/W) = {C}"
    if text not in assumptions:
        assumptions.append(text)
    return C


def prefetch_depth(system: dict[str, Any]) -> int:
    """Layers FSEP restores ahead: `prefetch_depth`, or 'prefetch depth N' in the note, else 2 (TECHNIQUES.md)."""
    if system.get("prefetch_depth") is not None:
        return int(system["prefetch_depth"])
    found = re.search(r"prefetch depth\s*([0-9]+)", str(system.get("note", "")))
    return int(found.group(1)) if found else 2


def is_lina(system: dict[str, Any]) -> bool:
    schedule = str(system.get("schedule", ""))
    return system.get("form") == "ep" and ("priority" in schedule or "partitioned" in schedule)


def is_fsdp(system: dict[str, Any]) -> bool:
    """An EP system whose weights FSDP shards: `"sharding": "fsdp"`, or an id naming fsdp (LAER's "fsdp-ep")."""
    return system.get("form") == "ep" and (system.get("sharding") == "fsdp" or "fsdp" in str(system.get("id")).lower())


def is_replicating(system: dict[str, Any]) -> bool:
    """Replication-based balancing (FlexMoE): `"replicas"`, or a note naming replication."""
    return system.get("form") == "ep" and (system.get("replicas") is not None or "replicat" in _note(system))


def router_of(system: dict[str, Any], sc: dict[str, Any]) -> str:
    """The router of a locality set-up's system: LocMoE (form "locality"), the hash router, else the switch."""
    if system.get("form") == "locality":
        return "locmoe"
    if any(s.get("form") == "locality" for s in sc.get("systems") or []):
        return "hash" if system.get("routing") == "hash" else "switch"
    return "learned"


def micro_op_bytes(sc: dict[str, Any]) -> float:
    return float(sc.get("micro_op_bytes") or 30 * 2**20)


def system_plans(system: dict[str, Any], ctx: CaseContext) -> list[StepPlan]:
    """The plans a scenario system may run on `ctx`'s case: one, or (Lina) its free choices, chunks and
    packing, for `best` to pick from."""
    case, sc, W = ctx.case, ctx.scenario, ctx.W
    sid, form = system["id"], system.get("form")
    if form == "hp":
        return [StepPlan("hp", ep=W, math_changing=True, system=sid)]
    if form == "locality" or (form == "ep" and ctx.locality_setup):
        router = router_of(system, sc)
        return [StepPlan("locality", ep=W, router=router, math_changing=True, builds=router != "hash", system=sid)]
    if form == "fsep":
        return [StepPlan("fsep", ep=W, slots=slots_of(sc, case, ctx.assumptions), prefetch=prefetch_depth(system),
                         sched="priority", system=sid)]
    if form != "ep":
        raise ValueError(f"system {sid!r}: form={form!r} is not priced: use one of ep, fsep, hp, locality")
    ep = _ep_of(system, case)
    if is_lina(system):
        packings = PACKINGS if system.get("packing") == "auto" else (int(system.get("packing", 1)),)
        return [StepPlan("ep", ep=ep // p, chunks=n, sched="priority", bucket=micro_op_bytes(sc), packing=p, system=sid)
                for p in packings if ep % p == 0 and ep // p >= 2 and case.E % (ep // p) == 0 for n in CHUNKS]
    if is_fsdp(system):
        return [StepPlan("ep", ep=ep, fsdp=True, builds=False, system=sid)]
    if is_replicating(system):
        return [StepPlan("ep", ep=ep, replicas=int(system.get("replicas", 1)), builds=False, system=sid)]
    tp = tp_degree(system, str(model_of(sc, case).get("id", "")))
    if tp > 1:
        if tp > case.per_node or W % tp:
            raise ValueError(f"system {sid!r}: TP {tp} does not fit the {case.per_node} devices of a node")
        return [StepPlan("ep", ep=ep, tp=tp, builds=False, system=sid)]
    return [StepPlan("ep", ep=ep, system=sid)]


def best(priced: list[Priced]) -> Priced:
    """The fastest of a family, feasible first; on a tie the first listed."""
    return min(priced, key=lambda p: (not p.feasible, p.step_s))


def moepass_plans(ctx: CaseContext) -> list[StepPlan]:
    """The plans moepass builds for `ctx`'s case that the search ranks beside the set-up's systems: no rewrite;
    EP over every degree that divides W and E, each chunk count, fair or priority gradient sync; FSEP over all
    W ranks with ceil(E/W) .. +2 slots and the set-up's, each chunk count up to 8, prefetch 1 or 2; HP over
    every divisor of W > 1 and locality routing (top-1), both math-changing."""
    case, W = ctx.case, ctx.W
    micro = micro_op_bytes(ctx.scenario)
    plans = [StepPlan("single", ep=1)]
    for ep in (d for d in range(2, W + 1) if W % d == 0 and case.E % d == 0):
        for n in CHUNKS:
            plans.append(StepPlan("ep", ep=ep, chunks=n))
            plans.append(StepPlan("ep", ep=ep, chunks=n, sched="priority", bucket=micro))
    c_min = -(-case.E // W)
    slots = sorted({*range(c_min, c_min + 3), *(s.slots for s in ctx.system_fsep if s.slots)})
    for C in slots:
        for n in (1, 2, 4, 8):
            for depth in (1, 2):
                plans.append(StepPlan("fsep", ep=W, slots=C, chunks=n, prefetch=depth, sched="priority"))
    plans += [StepPlan("hp", ep=P, math_changing=True) for P in range(2, W + 1) if W % P == 0]
    if case.K == 1 and W >= case.per_node and case.nodes > 1:
        plans += [StepPlan("locality", ep=W, router=r, math_changing=True) for r in ("switch", "locmoe")]
    return plans
