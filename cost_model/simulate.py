"""Cluster simulator: predict the training step of published set-ups (shared/scenarios/*.json).

Every compared system of a set-up is read into the plan it runs (`cost_model.systems.system_plans`: EP as
DeepSpeed-MoE runs it, Lina's schedule with its chunks and packing, tensor parallel x EP, FSDP+EP,
replication-based balancing, FSEP, HP, the hash / switch / LocMoE routers) and priced by
`cost_model.systems.price`, the function the plan search ranks with (`cost_model.search.search_scenario`):
one step on the timeline of the busiest rank, the routing a process over steps, the memory with the
sharding and recomputation the systems use. Each case also gets a row "moepass-search": the plan the
search picks for it, priced the same way.

Null figures are filled from presets and every fill is reported; shapes a set-up does not give are
filled with stated assumptions. Every prediction reports the token all-to-all bytes one rank sends per
step (the busiest one; dispatch and combine, forward and backward) and its memory per rank by part.

    python -m cost_model.simulate ../shared/scenarios/lina_priority.json [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cost_model import ep as ep_formulas
from cost_model.presets import Hardware
from cost_model.scenario_search import best_eligible, scenario_contexts
from cost_model.scenarios import Case
from cost_model.schedule import DDP_BUCKET_BYTES
from cost_model.step_timeline import ExpertGrads, Layout, ParamTraffic, breakdown_of, timeline_step
from cost_model.system_plans import best, is_lina, micro_op_bytes, system_plans
from cost_model.systems import CaseContext, Priced

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
    memory: dict[str, float] = field(default_factory=dict)  # bytes per rank by part (`step_timeline.memory_breakdown`)
    feasible: bool = True
    builds: bool = True  # moepass builds this plan (else a published baseline priced for comparison)


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
            lines.append(f"  {system} (form {form}): not modelled: the simulator prices forms {list(MODELLED_FORMS)}")
        lines += [f"  memory {p.case} {p.system}: " + ", ".join(f"{k} {v / 1e9:.3g} GB" for k, v in p.memory.items())
                  + f" ({p.plan.get('memory')}{'' if p.feasible else ', DOES NOT FIT'})"
                  for p in self.predictions if p.modelled and p.memory]
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


def predict(
    case: Case,
    hw: Hardware,
    counts_PE: np.ndarray,
    *,
    chunks: int = 1,
    policy: str = "fair",
    bucket_bytes: float = DDP_BUCKET_BYTES,
    packing: int = 1,
    rows_PP: np.ndarray | None = None,
    params: ParamTraffic | None = None,
    expert_grads: ExpertGrads | None = None,
) -> tuple[float, dict[str, float], float]:
    """(step seconds, breakdown, memory bytes per rank) of one EP configuration on the step timeline
    (`cost_model.step_timeline.timeline_step`), from [src rank, expert] counts: the first case.ep / packing ranks
    form the EP group; or of a layout given by its routed rows and parameter collectives (memory: the EP
    layout's, replicated state, no recomputation)."""
    v = hw.values()
    if rows_PP is None:
        ep = case.ep // packing
        rows_PP = ep_formulas.rank_rows(counts_PE[:ep], ep)
    ep = rows_PP.shape[0]
    layout = Layout(rows_PP, params=params, expert_grads=expert_grads, split_exchange=params is None)  # dropless EP
    tl, figures = timeline_step(case, hw, layout, chunks=chunks, policy=policy, bucket_bytes=bucket_bytes)
    m = ep_formulas.matmuls(case.gated)
    memory = case.layers * (
        ep_formulas.memory_per_rank(case.E, ep, case.D, case.F, m, v["s"], figures["rows_max"], v["b"])
        + case.dense_params * v["s"])
    return tl.step, breakdown_of(tl, figures), memory


def simulate(scenario: str | Path | dict[str, Any]) -> SimResult:
    """Predict every compared system of one set-up, and the search's pick (module docstring)."""
    read, contexts = scenario_contexts(scenario)
    sc = read.scenario
    systems_ = sc.get("systems") or []
    predictions: list[Prediction] = []
    for ctx in contexts:
        for system in systems_:
            if system.get("form") not in MODELLED_FORMS:
                continue
            priced = best(system_plans(system, ctx), ctx)
            predictions.append(_prediction(system["id"], priced, ctx))
        pick = best_eligible(ctx)  # rank_case(ctx).eligible()[0], the plans that cannot be it not run
        if pick is not None:
            predictions.append(_prediction(SEARCH_ROW, pick, ctx))
    for system in systems_:
        if system.get("form") not in MODELLED_FORMS:
            predictions.append(Prediction(system["id"], "-", system.get("form", "?"), modelled=False))
    lina = next((system for system in systems_ if is_lina(system)), None)
    ablations = {ctx.case.label: ablation(ctx, lina) for ctx in contexts} if lina is not None else {}
    return SimResult(sc.get("name", "scenario"), predictions, read.filled, read.assumptions, ablations)


SEARCH_ROW = "moepass-search"


def _prediction(name: str, priced: Priced, ctx: CaseContext) -> Prediction:
    """One modelled prediction: the plan's figures, its memory by part, a note when it does not fit."""
    plan = priced.plan
    shown: dict[str, Any] = {}
    if plan.form == "ep":
        shown = {"ep": plan.ep, **({"packing": plan.packing} if plan.packing > 1 or plan.sched == "priority" else {}),
                 "chunks": plan.chunks, "sched": plan.sched}
    elif plan.form == "single":
        shown = {"single": True}
    elif plan.form == "fsep":
        shown = {"chunks": plan.chunks}
    shown.update({k: v for k, v in priced.details.items() if k not in ("sharded_optimizer", "recompute", "replicated_bytes")})
    if plan.form in ("fsep", "hp"):
        shown["sched"] = plan.sched
    memory_mode = [w for w, on in (("zero-1", priced.details.get("sharded_optimizer")),
                                   ("recompute", priced.details.get("recompute"))) if on]
    shown["memory"] = "+".join(memory_mode) or "replicated"
    notes = list(priced.notes)
    if name == SEARCH_ROW:
        notes.append(f"{ctx.case.label}: {SEARCH_ROW} = the plan search's pick: {plan.label}"
                     + (f" (the {plan.system} system's)" if plan.system else ""))
    return Prediction(name, ctx.case.label, plan.form, True, priced.step_s, priced.breakdown, priced.memory_gb,
                      shown, notes, memory=priced.memory, feasible=priced.feasible, builds=plan.builds)


def ablation(ctx: CaseContext, system: dict[str, Any]) -> list[tuple[str, float, str]]:
    """Lina's ingredients added one at a time, each a whole step (`predict`, the EP layout of the set-up's
    routing): plain (fair share, DDP buckets, one chunk), + priority (the all-to-all first, whole DDP buckets),
    + partitioning (micro-ops), + pipelining (the chunk count Lina picks unpacked), + packing (its packing)."""
    case, hw = ctx.case, ctx.hw
    micro_op = micro_op_bytes(ctx.scenario)
    counts = ctx.trace("learned").current
    family = system_plans({**system, "packing": "auto"}, ctx)
    pick = best(family, ctx).plan
    unpacked = best([p for p in family if p.packing == 1], ctx).plan
    steps: list[tuple[str, dict[str, Any], str]] = [
             ("plain", dict(), "fair, DDP buckets"),
             ("+ priority", dict(policy="priority"), "priority, DDP buckets"),
             ("+ partitioning", dict(policy="priority", bucket_bytes=micro_op), f"{micro_op / 2**20:.3g} MiB micro-ops"),
             ("+ pipelining", dict(policy="priority", bucket_bytes=micro_op, chunks=unpacked.chunks),
              f"{unpacked.chunks} chunks"),
             ("+ packing", dict(policy="priority", bucket_bytes=micro_op, chunks=pick.chunks, packing=pick.packing),
              f"packing {pick.packing}, {pick.chunks} chunks")]
    rows = [(name, predict(case, hw, counts, **kw)[0], plan) for name, kw, plan in steps]
    return rows


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
