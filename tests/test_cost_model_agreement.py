"""Search and simulate agree (issue 31, item 1): one model, two uses.

Over every case of the four published set-ups (tests/data/scenarios, copies of ../shared/scenarios), the plan
`cost_model.search.search_scenario` ranks first is the simulator's fastest row (`cost_model.simulate`), and
every system the simulator prices is in the search's ranking at the same step time: both price a plan with
`cost_model.systems.price`. Before the shared pricing the search's top plan was the simulator's fastest
system in 3 of the 24 cases (the search priced uniform routing, fair sharing, no locality, no scenario slots).

"Fastest" is over the rows the search may pick: feasible in memory and built by moepass (the set-up's systems
moepass runs, and its own pick). A published baseline moepass does not build (tensor parallel x EP, FSDP+EP,
replication-based balancing, the hash router) is priced in both and may be faster; `FASTER_BASELINES` lists
where it is, with the figure, and the test holds that list exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_model import simulate
from cost_model.search import search_scenario

# (case, system): a feasible baseline moepass does not build that the model prices faster than the search's pick
FASTER_BASELINES: set[tuple[str, str]] = set()
SCENARIOS = sorted((Path(__file__).parent / "data" / "scenarios").glob("*.json"))


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[simulate.SimResult, list]]:
    return {path.stem: (simulate.simulate(path), search_scenario(path)) for path in SCENARIOS}


def test_every_case_is_searched_and_simulated(runs):
    labels = [label for _, (_, searched) in runs.items() for label, _ in searched]
    assert len(labels) == 24 and len(set(labels)) == 24  # LAER 6, Lina 12, LocMoE 3, MH-LatentMoE 3


def test_search_top_plan_is_the_simulators_fastest(runs):
    disagree = []
    for name, (sim, searched) in runs.items():
        for label, ranking in searched:
            rows = [p for p in sim.predictions if p.modelled and p.case == label and p.feasible and p.builds]
            fastest = min(rows, key=lambda p: p.step_s)
            top = ranking.best
            if not (top.step_s == pytest.approx(fastest.step_s, rel=1e-12)
                    and fastest.system in (simulate.SEARCH_ROW, top.plan.system)):
                disagree.append((name, label, top.plan.label, top.step_s, fastest.system, fastest.step_s))
    assert disagree == []


def test_every_system_is_priced_the_same_by_both(runs):
    for _, (sim, searched) in runs.items():
        for label, ranking in searched:
            by_system: dict[str, float] = {}
            for priced in ranking.ranked:  # a system's fastest plan (Lina: its chunks and packing)
                if priced.plan.system is not None:
                    by_system.setdefault(priced.plan.system, priced.step_s)
            rows = {p.system: p for p in sim.predictions if p.modelled and p.case == label}
            assert set(by_system) == set(rows) - {simulate.SEARCH_ROW}, label
            for system, step in by_system.items():
                assert rows[system].step_s == pytest.approx(step, rel=1e-12), (label, system)
            assert ranking.best.step_s <= min(p.step_s for p in rows.values() if p.feasible) * (1 + 1e-12), label


def test_baselines_faster_than_the_search_pick_are_listed(runs):
    faster = set()
    for _, (sim, searched) in runs.items():
        for label, ranking in searched:
            for p in sim.predictions:
                if p.modelled and p.case == label and p.feasible and not p.builds and p.step_s < ranking.best.step_s:
                    faster.add((label, p.system))
    assert faster == FASTER_BASELINES
