"""The plan search on a published set-up (`../shared/scenarios/*.json`): every case's plans, the set-up's systems
as they run and every plan moepass builds (`cost_model.system_plans`), priced by `cost_model.systems.price`,
the simulator's function, and ranked (`ScenarioSearch`). `python -m moepass search --scenario F` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cost_model import system_plans, systems
from cost_model.scenarios import cases


def _ms(seconds: Any) -> str:
    return f"{float(seconds) * 1e3:.4g}"


SCENARIO_REFUSED = {
    "capacity": "capacity factors are not searched for a set-up: its systems run dropless (math-changing)",
    "hierarchical_a2a": "the two-stage all-to-all is not laid out on the step timeline yet (cost_model.hierarchical "
                        "counts its bytes per stage): not searched",
    "hp x ep": "HP x EP (heads over a node, experts over the nodes) is not laid out on the step timeline yet: not "
               "searched",
    "keep_restored / defer_expert_grads": "FSEP is priced with the runtime's defaults (restored experts freed after "
                                          "the forward, gradient slices deferred)",
}


@dataclass
class ScenarioSearch:
    """The plans of one scenario case ranked by `cost_model.systems.price` (the simulator's function): the
    set-up's systems as they run and the plans moepass builds (`system_plans.moepass_plans`)."""

    label: str
    ranked: list[Any]  # systems.Priced, fastest first (feasible first)
    allowed_math_changes: frozenset[str]  # forms the set-up's systems name (HP, locality)
    not_modelled: dict[str, str] = field(default_factory=lambda: dict(SCENARIO_REFUSED))

    def eligible(self) -> list[Any]:
        """What `best` may pick: feasible, built by moepass, math-changing only in a form the set-up compares."""
        return [p for p in self.ranked if p.feasible and p.plan.builds
                and (not p.plan.math_changing or p.plan.form in self.allowed_math_changes)]

    @property
    def best(self) -> Any:
        eligible = self.eligible()
        if not eligible:
            raise ValueError(f"{self.label}: no feasible plan moepass builds (the table's notes say why)")
        return eligible[0]

    def table(self, limit: int = 12) -> str:
        rows = [("#", "plan", "system", "step ms", "exposed a2a", "other comm", "mem GB/rank", "notes")]
        eligible = {id(p) for p in self.eligible()}
        for i, p in enumerate(self.ranked[:limit], 1):
            why = [] if id(p) in eligible else [
                "over memory" if not p.feasible else "baseline: moepass does not build it" if not p.plan.builds
                else "math-changing"]
            mem = "zero-1" if p.details.get("sharded_optimizer") else ""
            mem += (" + recompute" if p.details.get("recompute") else "")
            rows.append((str(i), p.plan.label, p.plan.system or "-", _ms(p.step_s), _ms(p.breakdown["exposed_a2a"]),
                         _ms(p.breakdown["exposed_other"]), f"{p.memory_gb:.3g}" + (f" ({mem.strip()})" if mem else ""),
                         "; ".join(why)))
        widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        if len(self.ranked) > limit:
            lines.append(f"... {len(self.ranked) - limit} more")
        if self.eligible():
            top = self.best
            lines.append(f"best: {top.plan.label}" + (f" ({top.plan.system})" if top.plan.system else "")
                         + f": {_ms(top.step_s)} ms/step; Plan({', '.join(f'{k}={v!r}' for k, v in top.plan.plan_kwargs().items())})")
        else:
            lines.append("no eligible plan")
        lines += [f"{name}: {why}" for name, why in self.not_modelled.items()]
        return "\n".join(lines)


def case_plans(ctx: Any) -> list[Any]:
    """Every plan of one scenario case: the set-up's systems as they run, then the plans moepass builds."""
    plans: list[Any] = []
    for system in ctx.scenario.get("systems") or []:
        family = system_plans.system_plans(system, ctx)
        plans += family
        ctx.system_fsep += [p for p in family if p.form == "fsep"]
    return plans + system_plans.moepass_plans(ctx)


def _math_changes(ctx: Any) -> frozenset[str]:
    """The math-changing forms a case's plan may use: those the set-up's systems use (HP, locality)."""
    return frozenset(s.get("form") for s in ctx.scenario.get("systems") or [] if s.get("form") in ("hp", "locality"))


def rank_case(ctx: Any) -> ScenarioSearch:
    """Every plan of one scenario case priced by `systems.price` and ranked (`ScenarioSearch`); on a tie the
    set-up's system comes first, then the order `system_plans.moepass_plans` lists."""
    plans = case_plans(ctx)
    priced = [systems.price(p, ctx) for p in plans]
    order = sorted(range(len(priced)), key=lambda i: (not priced[i].feasible, priced[i].step_s,
                                                       priced[i].plan.system is None, i))
    return ScenarioSearch(ctx.case.label, [priced[i] for i in order], _math_changes(ctx))


def best_eligible(ctx: Any) -> Any | None:
    """`rank_case(ctx).eligible()[0]` (None where no plan is eligible) without running the timeline of a plan
    that cannot be it (`systems.fastest`): every plan is laid out (`systems.step_floor`: its memory fit and a
    lower bound of its step), the eligible ones compared. Ties go as `rank_case` breaks them (the set-up's
    system first, then the listing order)."""
    plans = case_plans(ctx)
    floors = [systems.step_floor(p, ctx) for p in plans]  # in the listing order, as rank_case prices them
    allowed = _math_changes(ctx)
    eligible = [(i, p, floor) for i, (p, (feasible, floor)) in enumerate(zip(plans, floors))
                if feasible and p.builds and (not p.math_changing or p.form in allowed)]
    return systems.fastest(ctx, eligible, lambda i, priced: (priced.plan.system is None, i))


def scenario_contexts(scenario: Any) -> tuple[Any, list[Any]]:
    """A scenario read (`cost_model.scenarios.cases`) and one `systems.CaseContext` per case."""
    read = cases(scenario)
    return read, [systems.CaseContext(case, read.hardware, read.scenario, read.assumptions) for case in read.cases]


def search_scenario(scenario: Any) -> list[tuple[str, ScenarioSearch]]:
    """The plan search for every case of a published set-up (`../shared/scenarios/*.json`): (case label, ranking).

    Each case is priced as the simulator prices it (`cost_model.systems.price`: the step timeline, the set-up's
    routing over steps, its hardware, its systems' options); the ranking holds the set-up's systems as they run
    and every plan moepass builds for the case (`system_plans.moepass_plans`). `best` is the fastest feasible plan
    moepass builds, HP or locality routing only where a system of the set-up uses them.
    """
    _, contexts = scenario_contexts(scenario)
    return [(ctx.case.label, rank_case(ctx)) for ctx in contexts]
