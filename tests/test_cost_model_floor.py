"""The simulator's picks without the timelines that cannot win (`cost_model.systems.fastest`).

`cost_model.step_timeline.step_floor` bounds a plan's step from below without laying it out; the simulator's
system rows (`system_plans.best`) and its search row (`scenario_search.best_eligible`) price plans in the order
of their floors and stop once a floor is over the best step. Checked over every plan of every case of the four
published set-ups (tests/data/scenarios): the floor is under the step, the memory fit is the priced one, and
the picks are the ones pricing every plan gives (the same `Priced`, notes and figures included).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_model import scenario_search, system_plans, systems
from cost_model.timeline import Timeline

SCENARIOS = sorted((Path(__file__).parent / "data" / "scenarios").glob("*.json"))


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_floor_is_under_the_step_and_the_picks_are_the_full_rankings(path):
    read, priced_all = scenario_search.scenario_contexts(path)
    _, floored = scenario_search.scenario_contexts(path)
    _, probes = scenario_search.scenario_contexts(path)
    for full, lazy, probe in zip(priced_all, floored, probes):
        for plan in scenario_search.case_plans(full):
            feasible, floor = systems.step_floor(plan, probe)  # HP: priced (its own timeline)
            done = systems.price(plan, full)
            assert feasible == done.feasible, plan.label
            assert floor <= done.step_s * (1 + 1e-12), (full.case.label, plan.label, floor, done.step_s)
        full.system_fsep.clear()
        ranked = scenario_search.rank_case(full).eligible()
        assert scenario_search.best_eligible(lazy) == (ranked[0] if ranked else None), full.case.label
        for system in read.scenario.get("systems") or []:
            if system.get("form") not in ("ep", "fsep", "hp", "locality"):
                continue
            family = system_plans.system_plans(system, full)
            want = min((systems.price(p, full) for p in family), key=lambda p: (not p.feasible, p.step_s))
            assert system_plans.best(family, lazy) == want, (full.case.label, system.get("id"))


def test_floor_skips_most_timelines():
    """On the Lina set-up (12 cases) the search row runs a fraction of the timelines a full ranking runs."""
    path = next(p for p in SCENARIOS if p.stem == "lina_priority")
    runs = {"full": 0, "floored": 0}
    run = Timeline.run

    def counting(key):
        def counted(self, policy="fair"):
            runs[key] += 1
            return run(self, policy)
        return counted

    for key, pick in (("full", lambda ctx: scenario_search.rank_case(ctx).eligible()),
                      ("floored", scenario_search.best_eligible)):
        Timeline.run = counting(key)
        try:
            for ctx in scenario_search.scenario_contexts(path)[1]:
                pick(ctx)
        finally:
            Timeline.run = run
    assert runs["floored"] * 4 < runs["full"], runs


def test_ops_show_the_times_once_run():
    tl = Timeline()
    a = tl.add("compute", "c", 1.0)
    tl.add("a2a", "d", 2.0, [a])
    assert [(op.name, op.start, op.end) for op in tl.ops] == [("c", -1.0, -1.0), ("d", -1.0, -1.0)]
    tl.run()
    assert [(op.stream, op.start, op.end, op.busy) for op in tl.ops] == [("compute", 0.0, 1.0, 1.0),
                                                                         ("a2a", 1.0, 3.0, 2.0)]
    assert tl.step == 3.0 and tl.busy("a2a") == 2.0 and len(tl) == 2


def test_a_dependency_issued_after_its_user_on_its_stream_is_a_deadlock():
    """Streams run in issue order: an op waiting on one issued later on its own stream never starts, and `run`
    says which; the ops before it still finish, pieces and all."""
    tl = Timeline()
    first = tl.add("compute", "first", 1.0, pieces=2)
    tl.add("compute", "waits", 1.0, [first, 3])
    tl.add("a2a", "send", 1.0, [first])
    tl.add("compute", "later", 1.0)
    with pytest.raises(ValueError, match="timeline deadlocked at 'waits'"):
        tl.run()
    assert [op.end for op in tl.ops][:3:2] == [1.0, 2.0]
