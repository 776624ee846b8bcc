"""A model's MoE blocks as step-timeline cases: `cost_model.search.search` (and `Plan(form="auto")`, which
calls it) prices every candidate with the scenario simulator's function, `cost_model.systems.price`, so a
model's search, form="auto" and `python -m cost_model <scenario>` rank plans by one model of a step.

Blocks of one shape (E, K, D, F, gating, capacity, dense parameters, FFN share) form one `Case` with that many
layers; a model whose blocks have several shapes is priced as one case per shape, the step times and memory
summed (the overlap of one group's communication with another's compute is not modelled: said in the notes).

The routing (`routing_of`): `imbalance`, the max/mean routed rows per rank under EP at the reference degree
(the largest divisor of W that divides E): a Zipf popularity fitted to it that drifts over steps
(`cost_model.systems.routing_trace`: AR(1), its parameters stated); or `trace`, recorded routed rows
[steps, source ranks, E] (or one step [source ranks, E]), the last step priced and the steps before it the
history FSEP's planner sees. 1 and no trace: uniform routing.

A plan moepass builds keeps its optimizer state replicated and its activations: a candidate that fits only with
the optimizer sharded or activations recomputed (what `systems.price` falls back to for the published systems)
is infeasible here, with the figure.

Shape letters: `moepass.spec.SHAPES`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from cost_model.ep import LayerTerms
from cost_model.presets import Figure, Hardware
from cost_model.scenarios import Case
from cost_model.schedule import DDP_BUCKET_BYTES
from cost_model.systems import CaseContext, Priced, StepPlan, price


def routing_of(imbalance: float, trace: Any) -> dict[str, Any]:
    """The scenario `routing` entry `cost_model.routing.routing_trace` reads for a search's routing inputs."""
    if trace is not None:
        return {"trace": np.asarray(trace, dtype=np.float64)}
    if imbalance > 1:
        return {"max_mean": float(imbalance)}
    return {}


def contexts(shapes: list[Any], nodes: int, per_node: int, batch: tuple[int, int], hw: Hardware, *,
             imbalance: float = 1.0, trace: Any = None, heads: int | None = None, head_dim: int | None = None,
             recompute: bool | None = None) -> list[tuple[int, CaseContext]]:
    """One (block count, `CaseContext`) per distinct block shape of the model, in the order first seen."""
    W = nodes * per_node
    T, seq = int(batch[0]) * int(batch[1]), int(batch[1])
    if recompute is not None:
        hw = dataclasses.replace(hw, recompute=Figure(float(recompute), "search(recompute=...) / Plan.expert_recompute"))
    groups: dict[Any, int] = {}
    for shape in shapes:
        groups[shape] = groups.get(shape, 0) + 1
    scenario = {"routing": routing_of(imbalance, trace),
                "models": [{"id": "hp", "form": "hp", "heads": heads, "head_dim": head_dim}]}
    out = []
    for shape, count in groups.items():
        if trace is not None and np.asarray(trace).shape[-1] != shape.E:
            raise ValueError(f"search got a routing trace over {np.asarray(trace).shape[-1]} experts for a block of "
                             f"E={shape.E}: give the routed rows [steps, source ranks, E] of that block")
        reference = max(d for d in range(1, W + 1) if W % d == 0 and shape.E % d == 0)
        case = Case(label=f"E={shape.E} K={shape.K} D={shape.D} F={shape.F} x{count} W={W}", layers=count, D=shape.D,
                    F=shape.F, E=shape.E, K=shape.K, gated=shape.m == 3, nodes=nodes, per_node=per_node, tokens=T,
                    seq=seq, ep=reference if reference > 1 else shape.E, dense=float(shape.dense_params),
                    ffn_fraction=shape.ffn_fraction, capacity=shape.cf)
        out.append((count, CaseContext(case, hw, scenario, [])))
    return out


def step_plan(form: str, *, ep_size: int, packing: int, chunks: int, capacity: float | None, slots: int | None,
              schedule: str, micro_op_bytes: int, prefetch: int) -> StepPlan:
    """The `systems.StepPlan` of a search candidate (packing P: the experts on ep_size / P ranks, P copies)."""
    bucket = float(micro_op_bytes) if schedule == "priority" else DDP_BUCKET_BYTES
    if form == "single":
        return StepPlan("single", ep=1, capacity=capacity, sched=schedule, bucket=bucket)
    if form == "fsep":
        return StepPlan("fsep", ep=ep_size, slots=slots, chunks=chunks, prefetch=prefetch, sched=schedule, bucket=bucket)
    if form == "hp":
        return StepPlan("hp", ep=ep_size, math_changing=True, sched=schedule, bucket=bucket)
    return StepPlan("ep", ep=ep_size // packing, packing=packing, chunks=chunks, capacity=capacity, sched=schedule,
                    bucket=bucket)


@dataclasses.dataclass(frozen=True)
class Timed:
    """A candidate priced on the step timeline, summed over the model's block groups."""

    terms: LayerTerms  # compute, exposed all-to-all, exposed other communication, memory, token bytes
    fits: bool  # with the optimizer state replicated and no activation recomputation
    notes: tuple[str, ...]
    priced: tuple[Priced, ...]  # per block group


def timed(plan: StepPlan, groups: list[tuple[int, CaseContext]], hw: Hardware) -> Timed:
    """`plan` priced by `systems.price` on every block group of the model."""
    priced = tuple(price(plan, ctx) for _, ctx in groups)
    total = LayerTerms(0.0, 0.0, 0.0, 0.0, 0.0)
    for p in priced:
        b = p.breakdown
        total = total + LayerTerms(b["expert_compute"] + b["dense_compute"], b["exposed_a2a"], b["exposed_other"],
                                   p.memory["total"], b["token_a2a_bytes"])
    notes: list[str] = []
    limit = float(hw.memory)
    needs = [what for p in priced for what, on in (("the optimizer state sharded", p.details.get("sharded_optimizer")),
                                                   ("activations recomputed", p.details.get("recompute"))) if on]
    fits = not needs and float(total.memory) <= limit
    if not fits:
        replicated = sum(p.details["replicated_bytes"] for p in priced)
        notes.append(f"needs {replicated / 1e9:.3g} GB > {limit / 1e9:.3g} GB (optimizer state replicated, no "
                     f"recomputation, as moepass builds it)")
    if plan.form == "fsep":
        worst = max(priced, key=lambda p: p.details.get("max_mean", 1.0))
        notes.append(f"planner max/mean {worst.details['max_mean']:.3g} vs EP {worst.details['ep_max_mean']:.3g} "
                     f"({worst.details['table']} table, history of the steps before)")
    if len(groups) > 1:
        notes.append(f"{len(groups)} block shapes priced apart and summed")
    return Timed(total, fits, tuple(notes), priced)
