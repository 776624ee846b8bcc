"""Cluster simulator: predict the training step of published set-ups (shared/scenarios/*.json).

For every compared system whose form the cost model prices (EP, with or without Lina's schedule),
one step is laid out on a timeline of the busiest rank (`cost_model.timeline`): per layer, the dense
part (attention projections), the dispatch all-to-all, expert compute and the combine all-to-all,
forward then backward, with the gradient all-reduce on the "other" stream. Imbalance comes from the
scenario's token distribution: a recorded [src rank, expert] count matrix (`routing.counts`), a Zipf
parameter (`routing.zipf_s`), or a target max/mean (`routing.max_mean`, or a figure read from the
routing note), turned into counts and priced exactly with `cost_model.ep.exact_a2a`.

Null figures are filled from presets and every fill is reported; shapes a set-up does not give are
filled with stated assumptions. FSEP, HP and locality routing are listed as not modelled yet.

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
from cost_model.presets import Hardware
from cost_model.scenarios import Case, cases
from cost_model.search import NOT_MODELLED, search
from cost_model.timeline import Timeline

SCENARIO_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "scenarios"
DDP_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket_cap_mb=25


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

    def table(self) -> str:
        lines = [f"== {self.scenario}"]
        lines += [f"  filled {k}: {v}" for k, v in self.filled.items()]
        lines += [f"  assumed: {a}" for a in self.assumptions]
        head = ("system", "case", "plan", "step ms", "expert", "dense", "exposed a2a", "other comm", "mem GB")
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
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "filled": self.filled,
            "assumptions": self.assumptions,
            "predictions": [asdict(p) for p in self.predictions],
        }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.4g}"


# ---- one case: a model on a cluster ----------------------------------------------------------------


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
) -> dict[str, float]:
    """Lay out one step of `case` on `tl`; returns the per-layer figures used (for the report)."""
    v = hw.values()
    W = case.nodes * case.per_node
    ep = case.ep // packing
    dp_expert, m = W // ep, ep_formulas.matmuls(case.gated)
    rows_SR = ep_formulas.rank_rows(counts_SE[:ep], ep)  # packed: the first ep ranks form a smaller EP group
    dispatch = ep_formulas.exact_a2a(rows_SR, case.D, int(v["b"]), case.per_node)
    a2a_full = dispatch.time(v["B_intra"], v["B_inter"], v["alpha"]) if ep > 1 else 0.0
    transfer = max(0.0, a2a_full - v["alpha"]) if ep > 1 else 0.0
    rows_max = float(dispatch.computed_rows.max())
    rate = v["R"] * v["eta"]
    expert_fwd = ep_formulas.expert_flops(rows_max, case.D, case.F, m) / rate
    dense_flops = 2 * 4 * case.D**2 * case.tokens + (2 * case.seq * case.D * case.tokens if case.seq else 0)
    dense_fwd = dense_flops / rate
    ar_bw = v["B_inter"] if case.nodes > 1 else v["B_intra"]
    expert_grad = ep_formulas.expert_params(case.E, case.D, case.F, m) / ep * v["b_g"]
    dense_grad = 4 * case.D**2 * v["b_g"]

    def allreduce(name: str, nbytes: float, dp: int, deps: list[int]) -> None:
        if dp == 1 or nbytes <= 0:
            return
        pieces = max(1, math.ceil(nbytes / bucket_bytes))
        for j in range(pieces):
            tl.add("other", f"{name}.ar{j}", ep_formulas.allreduce_time(nbytes / pieces, dp, ar_bw, v["alpha"]), deps)

    def moe(prefix: str, compute: float, after: int) -> list[int]:
        """Chunked dispatch -> expert compute -> combine; issue order d1 d2 c1 d3 c2 ... (schedule.py)."""
        if ep == 1:
            return [tl.add("compute", f"{prefix}.experts", compute, [after])]
        t_a = v["alpha"] + transfer / chunks
        exp: list[int] = []
        comb: list[int] = []
        disp = [tl.add("a2a", f"{prefix}.dispatch0", t_a, [after])]
        for j in range(chunks):
            exp.append(tl.add("compute", f"{prefix}.experts{j}", compute / chunks, [disp[j]] + exp[-1:]))
            if j + 1 < chunks:
                disp.append(tl.add("a2a", f"{prefix}.dispatch{j + 1}", t_a, [after]))
            comb.append(tl.add("a2a", f"{prefix}.combine{j}", t_a, [exp[j]]))
        return comb + exp

    last = tl.add("compute", "start", 0.0)
    for layer in range(case.layers):
        dense = tl.add("compute", f"L{layer}.fwd.dense", dense_fwd, [last])
        done = moe(f"L{layer}.fwd", expert_fwd, dense)
        last = tl.add("compute", f"L{layer}.fwd.end", 0.0, done)
    for layer in reversed(range(case.layers)):
        done = moe(f"L{layer}.bwd", 2 * expert_fwd, last)
        allreduce(f"L{layer}.expert_grads", expert_grad, dp_expert, done)
        last = tl.add("compute", f"L{layer}.bwd.dense", 2 * dense_fwd, done)
        allreduce(f"L{layer}.dense_grads", dense_grad, W, [last])
    tl.run(policy)
    memory = case.layers * (
        ep_formulas.memory_per_rank(case.E, ep, case.D, case.F, m, v["s"], rows_max, v["b"]) + 4 * case.D**2 * v["s"]
    )
    return {
        "expert_fwd": expert_fwd,
        "dense_fwd": dense_fwd,
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
) -> tuple[float, dict[str, float], float]:
    """(step seconds, breakdown, memory bytes per rank) of one EP configuration."""
    tl = Timeline()
    figures = _layer_timeline(
        tl, case, hw, counts_SE, chunks=chunks, policy=policy, bucket_bytes=bucket_bytes, packing=packing
    )
    b = tl.breakdown()
    dense = case.layers * 3 * figures["dense_fwd"]
    breakdown = {
        "expert_compute": b["compute"] - dense,
        "dense_compute": dense,
        "exposed_a2a": b["exposed_a2a"],
        "exposed_other": b["exposed_other"],
        "a2a_busy": b["a2a_busy"],
        "other_busy": b["other_busy"],
        "max_a2a_wait": b["max_a2a_wait"],
        "imbalance": figures["imbalance"],
    }
    return tl.step, breakdown, figures["memory"]


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
        if system.get("form") != "ep":
            predictions.append(Prediction(system["id"], "-", system.get("form", "?"), modelled=False))
    return SimResult(sc.get("name", "scenario"), predictions, read.filled, read.assumptions)


def _predict_system(
    system: dict[str, Any], case: Case, hw: Hardware, sc: dict[str, Any], micro_op: float, assumptions: list[str]
) -> Prediction:
    form = system.get("form", "?")
    if form != "ep":
        return Prediction(system["id"], case.label, form, modelled=False)
    counts = _counts(sc.get("routing") or {}, system, case, assumptions)
    notes = [f"{system['id']}: {system['note']} (modelled as plain EP)"] if system.get("note") else []
    if case.ep < case.nodes * case.per_node:
        notes.append(f"EP {case.ep} with data parallel {case.nodes * case.per_node // case.ep} for the experts")
    schedule = str(system.get("schedule", ""))
    if "priority" in schedule or "partitioned" in schedule:
        chunks, packing = _lina_choice(case, hw, counts, system)
        step, breakdown, memory = predict(
            case, hw, counts, chunks=chunks, policy="priority", bucket_bytes=micro_op, packing=packing
        )
        plan = {"ep": case.ep // packing, "packing": packing, "chunks": chunks, "sched": "priority"}
    else:
        step, breakdown, memory = predict(case, hw, counts)
        plan = {"ep": case.ep, "chunks": 1, "sched": "fair"}
    if memory > float(hw.memory):
        notes.append(
            f"{case.label}: {memory / 1e9:.3g} GB/rank exceeds {float(hw.memory) / 1e9:.3g} GB "
            "(the real systems shard further: TP/FSDP are not modelled)"
        )
    return Prediction(system["id"], case.label, form, True, step, breakdown, memory / 1e9, plan, notes)


def _lina_choice(case: Case, hw: Hardware, counts: np.ndarray, system: dict[str, Any]) -> tuple[int, int]:
    """Chunks and packing the cost model picks for Lina: the plan search restricted to ep = W, dropless."""
    from moepass.spec import ExpertsSpec, MoESpec, RouterSpec, TensorSource

    gated = case.gated
    spec = MoESpec(
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
    packings = (1, 2, 4) if system.get("packing") == "auto" else (int(system.get("packing", 1)),)
    result = search(
        [spec] * case.layers,
        (case.nodes, case.per_node),
        (1, case.tokens),
        profile=hw,
        ep_sizes=(case.ep,),
        capacity_factors=(None,),
        packings=packings,
        imbalance=ep_formulas.imbalance(ep_formulas.rank_rows(counts, case.ep)),
    )
    best = result.best if result.eligible() else min(result.ranked, key=lambda c: c.step)
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
