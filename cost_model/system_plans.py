"""The scenario systems and the plans a case is searched over: a scenario's system entries read into their
`cost_model.systems.StepPlan`s (`system_plans`: Megatron's TP x EP, FSDP+EP, FlexMoE's replication, Lina's
free choices, FSEP's slots, HP, the locality set-up's routers) and the plans moepass builds (`moepass_plans`),
which `cost_model.search.rank_case` prices and ranks.
"""

from __future__ import annotations

import re
from typing import Any

from cost_model.scenarios import Case
from cost_model.systems import CaseContext, Priced, StepPlan, fastest, step_floor

CHUNKS = (1, 2, 4, 8, 16, 32)
PACKINGS = (1, 2, 4)



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
    """Replication-based balancing (FlexMoE): `"replicas"` (extra slots per device), or a note naming replication."""
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
        return [StepPlan("ep", ep=ep, replicating=True, replicas=int(system.get("replicas", 0)), builds=False,
                         system=sid)]
    tp = tp_degree(system, str(model_of(sc, case).get("id", "")))
    if tp > 1:
        if tp > case.per_node or W % tp:
            raise ValueError(f"system {sid!r}: TP {tp} does not fit the {case.per_node} devices of a node")
        return [StepPlan("ep", ep=ep, tp=tp, builds=False, system=sid)]
    return [StepPlan("ep", ep=ep, system=sid)]


def best(plans: list[StepPlan], ctx: CaseContext) -> Priced:
    """The fastest of a family priced on `ctx`, feasible first; on a tie the first listed. Every plan is laid
    out (`systems.step_floor`), the feasible ones (all where none fits) compared by `systems.fastest`: the same
    pick as the least of them all priced, without running the timelines of those that cannot be it."""
    floors = [step_floor(p, ctx) for p in plans]
    fits = [(i, p, floor) for i, (p, (feasible, floor)) in enumerate(zip(plans, floors)) if feasible]
    picked = fastest(ctx, fits or [(i, p, floor) for i, (p, (_, floor)) in enumerate(zip(plans, floors))])
    if picked is None:
        raise ValueError(f"{ctx.case.label}: a system with no plan to price")
    return picked


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
