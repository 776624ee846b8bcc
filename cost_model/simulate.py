"""Cluster simulator: predict the training step of published set-ups (shared/scenarios/*.json).

For every compared system whose form the cost model prices (EP, with or without Lina's schedule;
FSDP+EP; FSEP), one step is laid out on a timeline of the busiest rank (`cost_model.timeline`): per
layer, the dense part (attention projections), the dispatch all-to-all, expert compute and the
combine all-to-all, forward then backward, with the gradient all-reduce on the "other" stream.
The two communication streams share one link (`cost_model.timeline`: fair share, or Lina's priority),
whether the all-to-all group is inside a node or not. The dense gradients of a layer are its attention
(4 D^2) and an even share of the embeddings when the set-up gives a vocabulary (`Case.dense_params`).
Lina's chunks and packing come from the plan search (`_lina_choice`: priority, the set-up's micro-op
bytes and dense parameters), which agrees with this timeline (tests/test_cost_model_lina.py).

Three layouts, three formulas:
- EP (form "ep"): experts contiguous over ep ranks; the busiest device's expert compute under the
  skew sets the pace; expert gradients all-reduced over the W/ep replicas, dense ones over W.
- FSDP+EP (form "ep" with `"sharding": "fsdp"` or an id naming fsdp): EP's tokens and compute, plus
  per layer an all-gather of the rank's experts (over their replicas) and of the dense weights (over
  W) before the forward and again before the backward, and a reduce-scatter of their gradients.
- FSEP (form "fsep", LAER-MoE): the planner (`moepass.runtime.placement`) picks C experts per device
  from the routed counts; tokens follow lite routing over all W ranks; per layer a restore
  all_to_all of C*S/W elements per pair before the forward and the backward, and the gradient slices
  back (`cost_model.fsep`), prefetched `depth` layers ahead and issued after the token all-to-all.
- HP (form "hp", Multi-Head LatentMoE): every EP case converted at equal active parameters
  (`moepass.rewrite.latent.latent_shape`; the scenario's heads / head_dim if given), heads over all W
  ranks; per layer w_in, the equal dispatch (T*Q*(W-1)/W elements per rank, whatever K), routing and
  the T*H*K expert rows, the equal combine, w_out, each waiting for the one before (`cost_model.hp`);
  the head gradients all-reduced over their replicas, w_in/w_out with the dense ones over W.

Imbalance (EP, FSEP) comes from the scenario's token distribution: a recorded [src rank, expert] count matrix (`routing.counts`), a Zipf
parameter (`routing.zipf_s`), or a target max/mean (`routing.max_mean`, or a figure read from the
routing note), turned into counts and priced exactly with `cost_model.ep.exact_a2a`.

Null figures are filled from presets and every fill is reported; shapes a set-up does not give are
filled with stated assumptions. Every prediction reports the token all-to-all bytes one rank sends per
step (the busiest one; dispatch and combine, forward and backward).

- Locality (a set-up with a system of form "locality", LocMoE): every system of it is a top-1 router on
  one placement (`cost_model.locality.Placement`: each expert on one home node, tokens exchanged over all
  W ranks): the hash router, the switch router (routing "hash" or not) and LocMoE (form "locality") differ
  in their locality ratio (`cost_model.locality.router_ratio`, or a system's `locality_ratio`), hence in
  their [src rank, dst rank] rows, their inter/intra-node bytes and their all-to-all time. Dropless
  unless a system gives `capacity_factor` (with `delta` for the floor, 0 if absent). Expert replicas
  inside a node all-reduce their gradients over the intra-node links.

    python -m cost_model.simulate ../shared/scenarios/lina_priority.json [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cost_model import ep as ep_formulas
from cost_model import fsep as fsep_formulas
from cost_model import hp as hp_formulas
from cost_model import locality
from cost_model.presets import Hardware
from cost_model.scenarios import Case, cases
from cost_model.schedule import DDP_BUCKET_BYTES
from cost_model.search import NOT_MODELLED, search
from cost_model.timeline import Timeline

SCENARIO_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "scenarios"
MODELLED_FORMS = ("ep", "fsep", "hp", "locality")


# ---- what one system on one case predicts ---------------------------------------------------------


@dataclass
class Prediction:
    system: str
    case: str  # model and cluster size
    form: str
    modelled: bool
    step_s: float | None = None
    breakdown: dict[str, float] = field(default_factory=dict)
    memory_gb: float | None = None
    plan: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class SimResult:
    scenario: str
    predictions: list[Prediction]
    filled: dict[str, str]  # figure -> which preset (and its source) filled it
    assumptions: list[str]
    # Lina's set-ups: case -> [(row, step seconds, plan)], each of Lina's ingredients added in turn (`ablation`)
    ablations: dict[str, list[tuple[str, float, str]]] = field(default_factory=dict)

    def table(self) -> str:
        lines = [f"== {self.scenario}"]
        lines += [f"  filled {k}: {v}" for k, v in self.filled.items()]
        lines += [f"  assumed: {a}" for a in self.assumptions]
        head = ("system", "case", "plan", "step ms", "expert", "dense", "exposed a2a", "other comm", "a2a GB",
                "mem GB")
        rows = [head]
        skipped = []
        for p in self.predictions:
            if not p.modelled:
                skipped.append(p)
                continue
            b = p.breakdown
            plan = " ".join(f"{k}={v}" for k, v in p.plan.items())
            rows.append(
                (
                    p.system,
                    p.case,
                    plan,
                    _ms(p.step_s),
                    _ms(b["expert_compute"]),
                    _ms(b["dense_compute"]),
                    _ms(b["exposed_a2a"]),
                    _ms(b["exposed_other"]),
                    f"{b['token_a2a_bytes'] / 1e9:.4g}",
                    f"{p.memory_gb:.3g}",
                )
            )
        widths = [max(len(r[j]) for r in rows) for j in range(len(head))]
        lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        notes = sorted({n for p in self.predictions if p.modelled for n in p.notes})
        lines += [f"  note: {n}" for n in notes]
        for system in dict.fromkeys(p.system for p in skipped):
            form = next(p.form for p in skipped if p.system == system)
            lines.append(f"  {system} (form {form}): {NOT_MODELLED.get(form, 'not modelled yet')}")
        for case, rows_ in self.ablations.items():
            base = rows_[0][1]
            lines.append(f"  ablation {case}: " + " | ".join(f"{name} {_ms(step)} ms ({base / step:.2f}x; {plan})"
                                                           for name, step, plan in rows_))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "filled": self.filled,
            "assumptions": self.assumptions,
            "predictions": [asdict(p) for p in self.predictions],
            "ablations": {case: [{"row": n, "step_s": t, "plan": plan} for n, t, plan in rows]
                          for case, rows in self.ablations.items()},
        }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.4g}"


# ---- one case: a model on a cluster ----------------------------------------------------------------


@dataclass(frozen=True)
class ParamTraffic:
    """Per-layer parameter collectives of a layout whose weights are sharded (FSEP, FSDP+EP), in seconds.

    They run on the "other" stream: `gather_fwd` before the layer's forward (FSEP's restore all_to_all,
    FSDP's all-gather), `gather_bwd` before its backward (the gathered weights are freed after the
    forward), `grads` after its backward expert compute (the gradient slices go back: FSEP's reverse
    all_to_all, FSDP's reduce-scatter; no expert all-reduce then). `depth` layers are gathered ahead of
    the one computing (1 + depth buffers). `dense`: the dense weights travel with them (FSDP for the
    dense part: no dense all-reduce, and the layer's dense compute waits for the forward gather).
    """

    gather_fwd: float
    gather_bwd: float
    grads: float
    depth: int
    dense: bool = False


@dataclass(frozen=True)
class ExpertGrads:
    """The expert gradient all-reduce of a layout that is not EP's (default: E/ep experts per rank over
    their W/ep replicas, on the inter-node links when there are several nodes): `nbytes` per rank,
    all-reduced over `replicas` ranks at `bandwidth` bytes/s."""

    nbytes: float
    replicas: int
    bandwidth: float


def _allreduce(tl: Timeline, name: str, nbytes: float, dp: int, B: float, alpha: float, bucket_bytes: float,
               deps: list[int]) -> None:
    """A gradient all-reduce on the "other" stream, in DDP's buckets of `bucket_bytes` (none over one rank)."""
    if dp == 1 or nbytes <= 0:
        return
    pieces = max(1, math.ceil(nbytes / bucket_bytes))
    for j in range(pieces):
        tl.add("other", f"{name}.ar{j}", ep_formulas.allreduce_time(nbytes / pieces, dp, B, alpha), deps)


def _dense_flops(case: Case) -> float:
    """Forward FLOPs of a layer's dense part: the attention projections (4 D x D) and scores (seq x D)."""
    return float(ep_formulas.dense_flops(case.tokens, case.D, case.seq or 0))


def _layer_timeline(
    tl: Timeline,
    case: Case,
    hw: Hardware,
    counts_SE: np.ndarray,
    *,
    chunks: int,
    policy: str,
    bucket_bytes: float,
    packing: int = 1,
    rows_SR: np.ndarray | None = None,
    params: ParamTraffic | None = None,
    expert_grads: ExpertGrads | None = None,
) -> dict[str, float]:
    """Lay out one step of `case` on `tl`; returns the per-layer figures used (for the report).

    `rows_SR` [src rank, device]: the routed rows of the all-to-all group when the layout is not EP's
    contiguous one (FSEP: all W ranks, from the planner's table); `params`: the parameter collectives
    of a sharded layout (`ParamTraffic`); `expert_grads`: its expert gradient all-reduce (`ExpertGrads`).
    """
    v = hw.values()
    W = case.nodes * case.per_node
    m = ep_formulas.matmuls(case.gated)
    if rows_SR is None:
        ep = case.ep // packing
        rows_SR = ep_formulas.rank_rows(counts_SE[:ep], ep)  # packed: the first ep ranks form a smaller EP group
    else:
        ep = rows_SR.shape[0]
    dp_expert = W // ep
    dispatch = ep_formulas.exact_a2a(rows_SR, case.D, int(v["b"]), case.per_node)
    a2a_full = dispatch.time(v["B_intra"], v["B_inter"], v["alpha"]) if ep > 1 else 0.0
    transfer = max(0.0, a2a_full - v["alpha"]) if ep > 1 else 0.0
    rows_max = float(dispatch.computed_rows.max())
    rate = v["R"] * v["eta"]
    expert_fwd = ep_formulas.expert_flops(rows_max, case.D, case.F, m) / rate
    dense_fwd = _dense_flops(case) / rate
    ar_bw = v["B_inter"] if case.nodes > 1 else v["B_intra"]
    if expert_grads is None:
        expert_grads = ExpertGrads(ep_formulas.expert_params(case.E, case.D, case.F, m) / ep * v["b_g"], dp_expert,
                                   ar_bw)
    dense_grad = case.dense_params * v["b_g"]  # attention + the layer's share of the embeddings

    def allreduce(name: str, nbytes: float, dp: int, deps: list[int]) -> None:
        _allreduce(tl, name, nbytes, dp, ar_bw, v["alpha"], bucket_bytes, deps)

    def moe(prefix: str, compute: float, after: int, weights: list[int]) -> list[int]:
        """Chunked dispatch -> expert compute -> combine; issue order d1 d2 c1 d3 c2 ... (schedule.py).
        `weights`: ops the expert compute waits for besides its tokens (a parameter gather)."""
        if ep == 1:
            return [tl.add("compute", f"{prefix}.experts", compute, [after, *weights])]
        t_a = v["alpha"] + transfer / chunks
        exp: list[int] = []
        comb: list[int] = []
        disp = [tl.add("a2a", f"{prefix}.dispatch0", t_a, [after])]
        for j in range(chunks):
            exp.append(tl.add("compute", f"{prefix}.experts{j}", compute / chunks, [disp[j], *weights] + exp[-1:]))
            if j + 1 < chunks:
                disp.append(tl.add("a2a", f"{prefix}.dispatch{j + 1}", t_a, [after]))
            comb.append(tl.add("a2a", f"{prefix}.combine{j}", t_a, [exp[j]]))
        return comb + exp

    gathered: dict[tuple[str, int], int] = {}  # (pass, layer) -> its parameter gather

    def gather(phase: str, layer: int, deps: list[int]) -> None:
        """Issue the parameter gather of `layer` for `phase` (if it has one and it is a layer)."""
        if params is not None and 0 <= layer < case.layers:
            work = params.gather_fwd if phase == "fwd" else params.gather_bwd
            gathered[(phase, layer)] = tl.add("other", f"L{layer}.{phase}.gather", work, deps)

    def weights(phase: str, layer: int) -> list[int]:
        return [gathered[(phase, layer)]] if (phase, layer) in gathered else []

    depth = params.depth if params is not None else 0
    last = tl.add("compute", "start", 0.0)
    for layer in range(depth + 1):
        gather("fwd", layer, [last])
    for layer in range(case.layers):
        dense_first = params is not None and params.dense
        dense = tl.add("compute", f"L{layer}.fwd.dense", dense_fwd, [last, *(weights("fwd", layer) if dense_first else [])])
        done = moe(f"L{layer}.fwd", expert_fwd, dense, [] if dense_first else weights("fwd", layer))
        gather("fwd", layer + depth + 1, done)  # this layer's buffer is free again
        last = tl.add("compute", f"L{layer}.fwd.end", 0.0, done)
    for layer in reversed(range(case.layers - depth - 1, case.layers)):
        gather("bwd", layer, [last])
    for layer in reversed(range(case.layers)):
        done = moe(f"L{layer}.bwd", 2 * expert_fwd, last, weights("bwd", layer))
        if params is None:
            _allreduce(tl, f"L{layer}.expert_grads", expert_grads.nbytes, expert_grads.replicas, expert_grads.bandwidth,
                       v["alpha"], bucket_bytes, done)
        else:
            gather("bwd", layer - depth - 1, done)
            tl.add("other", f"L{layer}.grads", params.grads, done)
        last = tl.add("compute", f"L{layer}.bwd.dense", 2 * dense_fwd, done)
        if params is None or not params.dense:
            allreduce(f"L{layer}.dense_grads", dense_grad, W, [last])
    tl.run(policy)
    memory = case.layers * (
        ep_formulas.memory_per_rank(case.E, ep, case.D, case.F, m, v["s"], rows_max, v["b"]) + 4 * case.D**2 * v["s"]
    )
    busiest = float((dispatch.sent + dispatch.transposed().sent).max()) if ep > 1 else 0.0  # dispatch + combine
    return {
        "expert_fwd": expert_fwd,
        "dense_fwd": dense_fwd,
        "token_a2a_bytes": case.layers * 2 * busiest,  # forward and backward
        "a2a": a2a_full,
        "rows_max": rows_max,
        "imbalance": rows_max / (case.tokens * case.K),
        "memory": memory,
    }


def predict(
    case: Case,
    hw: Hardware,
    counts_SE: np.ndarray,
    *,
    chunks: int = 1,
    policy: str = "fair",
    bucket_bytes: float = DDP_BUCKET_BYTES,
    packing: int = 1,
    rows_SR: np.ndarray | None = None,
    params: ParamTraffic | None = None,
    expert_grads: ExpertGrads | None = None,
) -> tuple[float, dict[str, float], float]:
    """(step seconds, breakdown, memory bytes per rank) of one EP configuration, or of a sharded layout
    with its routed rows and parameter collectives (`_layer_timeline`; its memory is the EP layout's:
    the caller prices a sharded layout's own). With parameter collectives, "exposed_a2a" is all the time
    the compute stream waits, on tokens or on weights."""
    tl = Timeline()
    figures = _layer_timeline(
        tl, case, hw, counts_SE, chunks=chunks, policy=policy, bucket_bytes=bucket_bytes, packing=packing,
        rows_SR=rows_SR, params=params, expert_grads=expert_grads,
    )
    breakdown = _breakdown(tl, case.layers * 3 * figures["dense_fwd"], figures["imbalance"],
                           figures["token_a2a_bytes"])
    return tl.step, breakdown, figures["memory"]


def _breakdown(tl: Timeline, dense: float, imbalance: float, token_a2a_bytes: float) -> dict[str, float]:
    """A simulated step's figures: expert vs dense compute, exposed and busy communication."""
    b = tl.breakdown()
    return {
        "expert_compute": b["compute"] - dense,
        "dense_compute": dense,
        "exposed_a2a": b["exposed_a2a"],
        "exposed_other": b["exposed_other"],
        "a2a_busy": b["a2a_busy"],
        "other_busy": b["other_busy"],
        "max_a2a_wait": b["max_a2a_wait"],
        "imbalance": imbalance,
        "token_a2a_bytes": token_a2a_bytes,
    }


# ---- a scenario's token distribution (reading the file: cost_model.scenarios) ----------------------


def _counts(routing: dict[str, Any], system: dict[str, Any], case: Case, assumptions: list[str]) -> np.ndarray:
    """[src rank, expert] routed rows of one EP group for the busiest group."""
    T, K, E, ep = case.tokens, case.K, case.E, case.ep
    if system.get("routing") == "hash":
        return ep_formulas.zipf_counts(T, K, E, ep, 0.0)
    if routing.get("counts") is not None:
        counts = np.asarray(routing["counts"], dtype=np.float64)
        return counts * (T * K / counts.sum(axis=1, keepdims=True))  # rescaled to this case's tokens
    if routing.get("zipf_s") is not None:
        return ep_formulas.zipf_counts(T, K, E, ep, float(routing["zipf_s"]))
    target = routing.get("max_mean")
    if target is None and routing.get("note"):
        found = re.search(r"max/mean[^0-9]*([0-9]+(?:\.[0-9]+)?)", routing["note"])
        target = float(found.group(1)) if found else None
    if target is None:
        text = "routing not given: uniform (max/mean 1)"
        if text not in assumptions:
            assumptions.append(text)
        return ep_formulas.zipf_counts(T, K, E, ep, 0.0)
    s = ep_formulas.zipf_for_imbalance(float(target), T, K, E, ep)
    text = f"routing: Zipf s fitted to max/mean {target} per case (from the set-up's routing figure)"
    if text not in assumptions:
        assumptions.append(text)
    return ep_formulas.zipf_counts(T, K, E, ep, s)


def simulate(scenario: str | Path | dict[str, Any]) -> SimResult:
    """Predict every compared system of one set-up (see the module docstring)."""
    read = cases(scenario)
    sc, hw = read.scenario, read.hardware
    micro_op = float(sc.get("micro_op_bytes") or 30 * 2**20)
    systems = sc.get("systems") or []
    predictions = [_predict_system(system, case, hw, sc, micro_op, read.assumptions)
                   for case in read.cases for system in systems]
    for system in systems:
        if system.get("form") not in MODELLED_FORMS:
            predictions.append(Prediction(system["id"], "-", system.get("form", "?"), modelled=False))
    lina = next((system for system in systems if _is_lina(system)), None)
    ablations = {case.label: ablation(case, hw, _counts(sc.get("routing") or {}, lina, case, read.assumptions),
                                      micro_op, lina)
                 for case in read.cases} if lina is not None else {}
    return SimResult(sc.get("name", "scenario"), predictions, read.filled, read.assumptions, ablations)


def _is_lina(system: dict[str, Any]) -> bool:
    schedule = str(system.get("schedule", ""))
    return system.get("form") == "ep" and ("priority" in schedule or "partitioned" in schedule)


def ablation(case: Case, hw: Hardware, counts: np.ndarray, micro_op: float,
             system: dict[str, Any]) -> list[tuple[str, float, str]]:
    """Lina's ingredients added one at a time, each a whole step on the timeline (`predict`): plain (fair
    share, DDP buckets, one chunk), + priority (the all-to-all first, whole DDP buckets), + partitioning
    (micro-ops of `micro_op` bytes), + pipelining (the cost model's chunk count), + packing (its packing)."""
    chunks, packing = _lina_choice(case, hw, counts, {**system, "packing": "auto"}, micro_op)
    steps: list[tuple[str, dict[str, Any], str]] = [
             ("plain", dict(), "fair, DDP buckets"),
             ("+ priority", dict(policy="priority"), "priority, DDP buckets"),
             ("+ partitioning", dict(policy="priority", bucket_bytes=micro_op), f"{micro_op / 2**20:.3g} MiB micro-ops"),
             ("+ pipelining", dict(policy="priority", bucket_bytes=micro_op, chunks=chunks), f"{chunks} chunks"),
             ("+ packing", dict(policy="priority", bucket_bytes=micro_op, chunks=chunks, packing=packing),
              f"packing {packing}")]
    return [(name, predict(case, hw, counts, **kw)[0], plan) for name, kw, plan in steps]


def _predict_system(
    system: dict[str, Any], case: Case, hw: Hardware, sc: dict[str, Any], micro_op: float, assumptions: list[str]
) -> Prediction:
    form = system.get("form", "?")
    if form not in MODELLED_FORMS:
        return Prediction(system["id"], case.label, form, modelled=False)
    notes: list[str] = []
    if _is_locality_scenario(sc) and form in ("ep", "locality"):
        step, breakdown, memory, plan = _predict_locality(system, case, hw, notes, assumptions)
        return _prediction(system, case, hw, form, step, breakdown, memory, plan, notes, who=f"{system['id']} on ")
    if form == "hp":
        step, breakdown, memory, plan = _predict_hp(case, hw, sc, assumptions)
        notes.append(f"{system['id']}: changes the model: Multi-Head LatentMoE at the EP case's active parameters; "
                     f"expert time includes w_in, w_out and the per-head routers")
        return _prediction(system, case, hw, form, step, breakdown, memory, plan, notes, who=f"{system['id']} on ")
    counts = _counts(sc.get("routing") or {}, system, case, assumptions)
    if form == "fsep":
        step, breakdown, memory, plan = _predict_fsep(system, case, hw, sc, counts, assumptions)
        notes.append(f"{system['id']}: FSEP, planner table priced on the scenario's routing"
                     + (f" ({system['note']})" if system.get("note") else ""))
    elif _is_fsdp(system):
        step, breakdown, memory, plan = _predict_fsdp_ep(case, hw, counts)
        notes.append(f"{system['id']}: EP for the experts, FSDP over their {case.nodes * case.per_node // case.ep} "
                     f"replicas and over all ranks for the dense part, 1 layer prefetched")
    else:
        if system.get("note"):
            notes.append(f"{system['id']}: {system['note']} (modelled as plain EP)")
        if _is_lina(system):
            chunks, packing = _lina_choice(case, hw, counts, system, micro_op)
            step, breakdown, memory = predict(
                case, hw, counts, chunks=chunks, policy="priority", bucket_bytes=micro_op, packing=packing
            )
            plan = {"ep": case.ep // packing, "packing": packing, "chunks": chunks, "sched": "priority"}
        else:
            step, breakdown, memory = predict(case, hw, counts)
            plan = {"ep": case.ep, "chunks": 1, "sched": "fair"}
    if form == "ep" and case.ep < case.nodes * case.per_node:
        notes.append(f"EP {case.ep} with data parallel {case.nodes * case.per_node // case.ep} for the experts")
    return _prediction(system, case, hw, form, step, breakdown, memory, plan, notes)


def _prediction(system: dict[str, Any], case: Case, hw: Hardware, form: str, step: float, breakdown: dict[str, float],
                memory: float, plan: dict[str, Any], notes: list[str], who: str = "") -> Prediction:
    """One modelled prediction, with a note when its memory exceeds the device's."""
    if memory > float(hw.memory):
        notes.append(
            f"{who}{case.label}: {memory / 1e9:.3g} GB/rank exceeds {float(hw.memory) / 1e9:.3g} GB "
            "(the real systems shard further: TP/FSDP are not modelled)"
        )
    return Prediction(system["id"], case.label, form, True, step, breakdown, memory / 1e9, plan, notes)


# ---- sharded layouts: FSDP+EP and FSEP ---------------------------------------------------------------


def _is_fsdp(system: dict[str, Any]) -> bool:
    """An EP system whose weights FSDP shards: `"sharding": "fsdp"`, or an id naming fsdp (LAER's "fsdp-ep")."""
    return system.get("form") == "ep" and (system.get("sharding") == "fsdp" or "fsdp" in str(system.get("id")).lower())


def _ring_half(nbytes: float, group: int, B: float, alpha: float) -> float:
    """An all-gather or a reduce-scatter of `nbytes` (the full tensor) over `group` ranks: half a ring all-reduce."""
    return 0.0 if group == 1 else alpha + (group - 1) * nbytes / (group * B)


def _activation_bytes(case: Case, rows: float, b: float) -> float:
    """Activations one layer keeps for backward (`cost_model.ep.memory_per_rank` without expert weights)."""
    return float(ep_formulas.memory_per_rank(0, 1, case.D, case.F, ep_formulas.matmuls(case.gated), 0, rows, b))


def _predict_fsdp_ep(case: Case, hw: Hardware, counts_SE: np.ndarray) -> tuple[float, dict[str, float], float,
                                                                             dict[str, Any]]:
    """FSDP+EP: EP's layout, token all-to-all and skewed expert compute, but each rank's E/ep experts are
    sharded over their W/ep replicas and the dense weights over all W ranks (FSDP): per layer, an
    all-gather of both before the forward and again before the backward (prefetched one layer ahead), a
    reduce-scatter of their gradients after it (instead of EP's all-reduces)."""
    v = hw.values()
    W, m = case.nodes * case.per_node, ep_formulas.matmuls(case.gated)
    dp = W // case.ep
    bw = v["B_inter"] if case.nodes > 1 else v["B_intra"]
    local = float(ep_formulas.expert_params(case.E, case.D, case.F, m)) / case.ep  # elements of its experts
    dense = case.dense_params

    def both(b: float) -> float:
        return _ring_half(local * b, dp, bw, v["alpha"]) + _ring_half(dense * b, W, bw, v["alpha"])

    params = ParamTraffic(gather_fwd=both(v["b"]), gather_bwd=both(v["b"]), grads=both(v["b_g"]), depth=1, dense=True)
    step, breakdown, _ = predict(case, hw, counts_SE, params=params)
    rows_max = breakdown["imbalance"] * case.tokens * case.K
    memory = case.layers * ((local / dp + dense / W) * v["s"] + _activation_bytes(case, rows_max, v["b"])) + (
        (1 + params.depth) * (local + dense) * v["b"] + (local + dense) * v["b_g"])
    return step, breakdown, memory, {"ep": case.ep, "fsdp": dp, "prefetch": params.depth, "sched": "fair"}


def _predict_fsep(system: dict[str, Any], case: Case, hw: Hardware, sc: dict[str, Any], counts_SE: np.ndarray,
                  assumptions: list[str]) -> tuple[float, dict[str, float], float, dict[str, Any]]:
    """FSEP: every rank routes like the EP group's ranks; the planner (`moepass.runtime.placement.plan`,
    cost `cost_model.fsep`) picks the table from those counts over its history; tokens follow lite
    routing over all W ranks (exact all-to-all bytes, the busiest device's compute); each layer's C
    experts are restored before its forward and its backward and their gradient slices sent back
    (`cost_model.fsep.restore_time`, one all_to_all each), `depth` layers ahead, after the token
    all-to-all (priority)."""
    v = hw.values()
    W, m = case.nodes * case.per_node, ep_formulas.matmuls(case.gated)
    C = _slots(sc, case, assumptions)
    depth = _prefetch_depth(system)
    from moepass.runtime.placement import planned_routing

    routed = planned_routing(counts_SE[np.arange(W) % len(counts_SE)], hw, C=C, ranks_per_node=case.per_node,
                             D=case.D, F=case.F, gated=case.gated)
    decision, rows_SR = routed.decision, routed.rows_SR
    S_e = fsep_formulas.expert_elements(case.D, case.F, m)

    def restore(b: float) -> float:
        return float(fsep_formulas.restore_time(C, S_e, W, case.per_node, b, v["B_intra"], v["B_inter"], v["alpha"]))

    params = ParamTraffic(gather_fwd=restore(v["b"]), gather_bwd=restore(v["b"]), grads=restore(v["b_g"]), depth=depth)
    step, breakdown, _ = predict(case, hw, counts_SE, policy="priority", rows_SR=rows_SR, params=params)
    rows_max = float(rows_SR.sum(axis=0).max())
    memory = case.layers * (_activation_bytes(case, rows_max, v["b"]) + 4 * case.D**2 * v["s"]) + float(
        fsep_formulas.memory_per_rank(case.E, W, C, S_e, v["s"], v["b"], v["b_g"], layers=case.layers, prefetch=depth,
                                      deferred_grads=True))
    return step, breakdown, memory, {"slots": C, "table": decision.candidate, "max_mean": round(decision.max_over_mean, 3),
                                     "ep_max_mean": round(decision.ep_max_over_mean, 3), "prefetch": depth,
                                     "sched": "priority"}


# ---- locality routing: three top-1 routers on one placement (cost_model.locality) -----------------------


def _is_locality_scenario(sc: dict[str, Any]) -> bool:
    """A set-up comparing locality routing: its EP-form systems are its baseline routers on the same placement."""
    return any(s.get("form") == "locality" for s in sc.get("systems") or [])


def _router(system: dict[str, Any]) -> str:
    """The router of a locality set-up's system: LocMoE (form "locality"), the hash router, else the switch."""
    if system.get("form") == "locality":
        return "locmoe"
    return "hash" if system.get("routing") == "hash" else "switch"


def _predict_locality(system: dict[str, Any], case: Case, hw: Hardware, notes: list[str],
                      assumptions: list[str]) -> tuple[float, dict[str, float], float, dict[str, Any]]:
    """One router of a locality set-up (module doc): the placement's rows under the router's locality ratio,
    priced exactly (`cost_model.ep.exact_a2a`) on the step timeline; the breakdown adds the cluster's mean
    inter- and intra-node bytes per rank per step, and those of an expert-less rank when N > E."""
    if case.K != 1:
        raise ValueError(f"{case.label}: top_k={case.K}: locality routing (LocMoE) and its baselines are top-1")
    v = hw.values()
    try:
        placement = locality.Placement(case.E, case.nodes, case.per_node)
    except ValueError as err:
        raise ValueError(f"{case.label} ({system['id']}): {err}") from None
    router = _router(system)
    given = system.get("locality_ratio")
    lam = float(given) if given is not None else locality.router_ratio(router, placement)
    text = (f"locality set-up: each of the E experts on one home node, tokens exchanged over all W ranks "
            f"(cost_model.locality.Placement; the set-up's expert/model parallel degrees not modelled); hash and "
            f"switch routers uniform in expectation, LocMoE's locality ratio 1 - {locality.MEASURED_INTER_FACTOR} "
            f"x (1 - k/E) (our measured inter-node factor, benchmarks/results/locality.json); dropless unless a "
            f"system gives capacity_factor")
    if text not in assumptions:
        assumptions.append(text)
    capacity = locality.capacity_rows(case.tokens, case.E, system.get("capacity_factor"),
                                      float(system.get("delta", 0.0)), case.D)
    counts_SE = locality.routing_counts(placement, case.tokens, lam)
    rows_SR = locality.rows_matrix(placement, counts_SE, capacity)
    m = ep_formulas.matmuls(case.gated)
    expert = float(fsep_formulas.expert_elements(case.D, case.F, m)) * placement.rank_experts
    grads = ExpertGrads(expert * v["b_g"], len(placement.hosts(0)), v["B_intra"])  # replicas share a node
    step, breakdown, _ = predict(case, hw, counts_SE, rows_SR=rows_SR, expert_grads=grads)
    dispatch = ep_formulas.exact_a2a(rows_SR, case.D, int(v["b"]), case.per_node)
    per_step = 2 * case.layers  # forward and backward; each rank's dispatch sent + its combine sent (= received)
    inter_R = per_step * (dispatch.sent_inter + dispatch.recv_inter)
    intra_R = per_step * (dispatch.sent_intra + dispatch.recv_intra)
    breakdown.update(locality_ratio=lam, inter_node_bytes=float(inter_R.mean()), intra_node_bytes=float(intra_R.mean()))
    source = " (the set-up's)" if given is not None else ""
    line = (f"{case.label} {system['id']} ({router}): locality ratio {lam:.4g}{source}, per rank per step inter-node "
            f"{inter_R.mean() / 1e9:.4g} GB, intra-node {intra_R.mean() / 1e9:.4g} GB")
    if placement.nodes_gt_experts:
        expertless = case.per_node * next(n for n in range(case.nodes) if not placement.local_experts(n))
        breakdown["inter_node_bytes_expertless"] = float(inter_R[expertless])
        line += f" (a rank of an expert-less node: {inter_R[expertless] / 1e9:.4g} GB, whatever the router)"
        notes.append(f"{case.label}: {case.nodes} nodes > {case.E} experts: {case.nodes - case.E} nodes hold no "
                     f"local expert, every token of theirs crosses nodes (locality pays only on the experts' nodes)")
    notes.append(line)
    rows_max = float(rows_SR.sum(axis=0).max())
    memory = case.layers * (expert * v["s"] + _activation_bytes(case, rows_max, v["b"]) + 4 * case.D**2 * v["s"])
    plan = {"router": router, "a2a": f"W={placement.ranks}", "experts/node": placement.node_experts,
            "replicas": len(placement.hosts(0)), "cap": capacity if capacity is not None else "none"}
    return step, breakdown, memory, plan


# ---- head parallel: the Multi-Head LatentMoE of a case --------------------------------------------------


def _predict_hp(case: Case, hw: Hardware, sc: dict[str, Any],
                assumptions: list[str]) -> tuple[float, dict[str, float], float, dict[str, Any]]:
    """HP: the case's block converted to a Multi-Head LatentMoE of equal active parameters (the scenario's
    HP model gives heads / head_dim, or `moepass.rewrite.latent`'s defaults), heads over all W ranks. Per
    layer, forward: dense part, w_in, dispatch, routing + experts, combine, w_out, each waiting for the one
    before (the rewrite waits for each exchange; nothing is chunked); the backward mirrors it at twice the
    compute. The head gradients are all-reduced over their W/P replicas (none at P = W), w_in/w_out with
    the dense gradients over all W (DDP buckets)."""
    from moepass.plan import Plan
    from moepass.rewrite.latent import latent_shape

    v = hw.values()
    W = P = case.nodes * case.per_node
    G, m, rate = case.per_node, ep_formulas.matmuls(case.gated), v["R"] * v["eta"]
    model: dict[str, Any] = next((x for x in sc.get("models") or [] if x.get("form") == "hp"), {})
    shape = latent_shape(_case_spec(case), Plan(form="hp", heads=model.get("heads"), head_dim=model.get("head_dim"),
                                                ep_size=P), P)
    H, h, E, K, F = shape.heads, shape.head_dim, shape.experts, shape.top_k, shape.ffn_dim
    text = (f"{model.get('id', 'hp')}: sizes not given: each EP case converted to a Multi-Head LatentMoE of equal "
            f"active parameters (moepass.rewrite.latent: H = {H} heads of h = D/H, the case's E per head and top-k), "
            f"head parallel over all W ranks")
    if model.get("heads") is None and text not in assumptions:
        assumptions.append(text)
    T = case.tokens
    proj_fwd = 2 * T * case.D * H * h / rate  # w_in, and again w_out
    expert_fwd = float(hp_formulas.layer_flops(T, case.D, H, h, E, K, F, m)) / rate - 2 * proj_fwd  # routing + experts
    dense_fwd = _dense_flops(case) / rate
    intra, inter = hp_formulas.exchange_bytes(T, H, h, P, G, v["b"])
    exchange = float(ep_formulas.a2a_time(intra, inter, v["B_intra"], v["B_inter"], v["alpha"])) if P > 1 else 0.0
    ar_bw = v["B_inter"] if case.nodes > 1 else v["B_intra"]
    head_grads = float(hp_formulas.head_params_per_rank(H, h, E, F, m, P)) * v["b_g"]
    replicated_grads = (float(hp_formulas.projection_params(case.D, H, h)) + case.dense_params) * v["b_g"]

    tl = Timeline()
    last = tl.add("compute", "start", 0.0)
    for layer in range(case.layers):
        last = tl.add("compute", f"L{layer}.fwd.dense", dense_fwd, [last])
        for name, work, stream in (("w_in", proj_fwd, "compute"), ("dispatch", exchange, "a2a"),
                                   ("experts", expert_fwd, "compute"), ("combine", exchange, "a2a"),
                                   ("w_out", proj_fwd, "compute")):
            last = tl.add(stream, f"L{layer}.fwd.{name}", work, [last])
    for layer in reversed(range(case.layers)):
        for name, work, stream in (("w_out", 2 * proj_fwd, "compute"), ("combine", exchange, "a2a"),
                                   ("experts", 2 * expert_fwd, "compute"), ("dispatch", exchange, "a2a"),
                                   ("w_in", 2 * proj_fwd, "compute")):
            last = tl.add(stream, f"L{layer}.bwd.{name}", work, [last])
            if name == "experts":
                _allreduce(tl, f"L{layer}.head_grads", head_grads, W // P, ar_bw, v["alpha"], DDP_BUCKET_BYTES, [last])
        last = tl.add("compute", f"L{layer}.bwd.dense", 2 * dense_fwd, [last])
        _allreduce(tl, f"L{layer}.replicated_grads", replicated_grads, W, ar_bw, v["alpha"], DDP_BUCKET_BYTES, [last])
    tl.run("fair")
    breakdown = _breakdown(tl, case.layers * 3 * dense_fwd, 1.0,  # T*H*K rows on every rank whatever the routing
                           case.layers * float(hp_formulas.step_bytes(T, H, h, P, v["b"])))
    breakdown["projection_compute"] = case.layers * 3 * 2 * proj_fwd
    memory = case.layers * (float(hp_formulas.memory_per_rank(T, case.D, H, h, E, K, F, m, P, v["s"], v["b"]))
                            + 4 * case.D**2 * v["s"])
    plan = {"hp": P, "heads": H, "head_dim": h, "ffn": F, "sched": "fair"}
    return tl.step, breakdown, memory, plan


def _slots(sc: dict[str, Any], case: Case, assumptions: list[str]) -> int:
    """C: the case's model's `expert_slots_per_device`, else ceil(E/W) (EP's share, stated as assumed)."""
    name = case.label.rsplit(" W=", 1)[0]
    for model in sc.get("models") or [sc.get("model") or {}]:
        mid = str(model.get("id", "model"))
        if (name == mid or name.startswith(mid + "[")) and model.get("expert_slots_per_device"):
            return int(model["expert_slots_per_device"])
    W = case.nodes * case.per_node
    C = max(1, -(-case.E // W))
    text = f"{case.label}: expert slots per device not given: C = ceil(E/W) = {C}"
    if text not in assumptions:
        assumptions.append(text)
    return C


def _prefetch_depth(system: dict[str, Any]) -> int:
    """Layers FSEP restores ahead: `prefetch_depth`, or 'prefetch depth N' in the note, else 2 (TECHNIQUES.md)."""
    if system.get("prefetch_depth") is not None:
        return int(system["prefetch_depth"])
    found = re.search(r"prefetch depth\s*([0-9]+)", str(system.get("note", "")))
    return int(found.group(1)) if found else 2


def _case_spec(case: Case) -> Any:
    """The MoESpec of a case's block (SwiGLU when gated, GELU otherwise), for the search and the HP conversion."""
    from moepass.spec import ExpertsSpec, MoESpec, RouterSpec, TensorSource

    gated = case.gated
    return MoESpec(
        path="scenario",
        recogniser="scenario",
        router=RouterSpec(num_experts=case.E, top_k=case.K),
        experts=ExpertsSpec(
            num_experts=case.E,
            hidden_dim=case.D,
            ffn_dim=case.F,
            activation="swiglu" if gated else "gelu",
            w_up=TensorSource.param("experts.w_up") if gated else None,
        ),
    )


def _lina_choice(case: Case, hw: Hardware, counts: np.ndarray, system: dict[str, Any],
                 micro_op: float) -> tuple[int, int]:
    """Chunks and packing the cost model picks for Lina: the plan search restricted to ep = W, dropless,
    under the priority schedule with `micro_op`-byte micro-ops and the case's dense parameters."""
    spec = _case_spec(case)
    packings = (1, 2, 4) if system.get("packing") == "auto" else (int(system.get("packing", 1)),)
    seq = case.seq or case.tokens
    result = search(
        [spec] * case.layers,
        (case.nodes, case.per_node),
        (case.tokens // seq, seq),
        profile=hw,
        ep_sizes=(case.ep,),
        capacity_factors=(None,),
        packings=packings,
        imbalance=ep_formulas.imbalance(ep_formulas.rank_rows(counts, case.ep)),
        dense_params=case.dense_params * case.layers,
        schedule="priority",
        micro_op_bytes=int(micro_op),
    )
    ep = [c for c in result.ranked if c.form == "ep"]  # Lina is EP: not "single", even where it is cheaper
    best = next((c for c in ep if c in result.eligible()), ep[0])
    return best.a2a_chunks, best.packing


# ---- command line ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cost_model.simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", type=Path, help=f"scenario JSON files (default: {SCENARIO_DIR}/*.json)")
    parser.add_argument("--json", type=Path, help="write every prediction to this JSON file")
    args = parser.parse_args(argv)
    paths = args.scenarios or sorted(SCENARIO_DIR.resolve().glob("*.json"))
    if not paths:
        print(f"no scenario files given or found in {SCENARIO_DIR}", file=sys.stderr)
        return 1
    results = []
    for path in paths:
        result = simulate(path)
        results.append(result.to_json())
        print(result.table())
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
