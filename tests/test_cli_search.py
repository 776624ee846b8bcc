"""`python -m moepass search --scenario …`: a readable ranked table per case of a published set-up.

The ranking is checked against costs this file computes itself: each candidate's figures are filled
by hand from the scenario file and the a100 preset, priced with the cost model's layer formula
(`cost_model.ep.ep_step`, whose own terms tests/test_cost_model.py checks against known answers),
and the bytes, memory and the candidate set against closed formulas. FSEP candidates (uniform routing:
the set-up gives none) are priced by hand from the runtime planner's table (`fsep_by_hand`, shared with
tests/cost_by_hand.py), HP candidates from the converted block's sizes (`hp_by_hand`, likewise), both
plus the last layer's dense all-reduce, which every form pays (`cost_model.ep.dense_allreduce_tail`).
Wall time: benchmarks/tool_time.py.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cost_model.search import search_scenario

ROOT = Path(__file__).resolve().parents[1]
LINA = Path(__file__).parent / "data" / "scenarios" / "lina_priority.json"  # a copy of ../shared/scenarios'
SCENARIO = json.loads(LINA.read_text())
TOKENS = 8 * 1024  # per device: the set-up gives no batch; the simulator states this assumption
CAPACITY_FACTORS = (None, 1.0, 1.25, 2.0)
CHUNKS = (1, 2, 4, 8, 16, 32)


def _cases() -> list[tuple[str, dict, int]]:
    """(label, model entry, E) for every model x expert count; devices = experts."""
    return [(f"{m['id']}[E={E}] W={E}", m, E) for m in SCENARIO["models"] for E in m["experts_per_layer"]]


@pytest.fixture(scope="module")
def results():
    return search_scenario(LINA)


def test_search_scenario_ranks_every_case_by_its_cost(results):
    """Every case of the Lina set-up (3 models x 4 expert counts, devices = experts) ranked by the simulator's
    function (`cost_model.systems.price`, re-priced here on a fresh context): the set-up's systems (DeepSpeed-MoE's
    EP; Lina over its chunks and packing) and the plans moepass builds (no rewrite, EP over every degree x chunks x
    gradient schedule, FSEP over C = ceil(E/W) .. +2 x chunks x prefetch, HP over every P > 1, ranked but
    math-changing here)."""
    from cost_model import systems
    from cost_model.search import scenario_contexts

    read, contexts = scenario_contexts(LINA)
    assert [label for label, _ in results] == [label for label, _, _ in _cases()]
    for (label, result), ctx in zip(results, contexts):
        W = ctx.W
        steps = [p.step_s for p in result.ranked if p.feasible]
        assert steps == sorted(steps), label
        for priced in result.ranked[:5] + result.ranked[-3:]:
            assert systems.price(priced.plan, ctx).step_s == pytest.approx(priced.step_s, rel=1e-12), label
        forms = {p.plan.form for p in result.ranked}
        assert forms == {"single", "ep", "fsep", "hp"}, label
        eps = {p.plan.ep for p in result.ranked if p.plan.form == "ep" and p.plan.system is None}
        assert eps == {d for d in range(2, W + 1) if W % d == 0}, label
        assert {p.plan.system for p in result.ranked} == {None, "deepspeed-moe", "lina"}
        assert all(not p.plan.math_changing for p in result.eligible())
        assert result.best.plan.builds and result.best.feasible


def test_cli_prints_a_ranked_table_per_case(results):
    out = subprocess.run([sys.executable, "-m", "moepass", "search", "--scenario", str(LINA), "--limit", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "scenario lina-priority: hardware a100" in out.stdout
    assert "filled intra_node_bw: preset a100" in out.stdout  # a null figure names the preset that filled it
    sections = re.split(r"^== (.+)$", out.stdout, flags=re.M)[1:]
    tables = dict(zip(sections[::2], sections[1::2]))
    assert list(tables) == [label for label, _ in results]
    for label, result in results:
        table = tables[label]
        rows = re.findall(r"^(\d+)  (\S.*?)  ", table, flags=re.M)
        assert [int(i) for i, _ in rows] == [1, 2, 3], (label, table)  # --limit 3
        assert [plan.strip() for _, plan in rows] == [p.plan.label for p in result.ranked[:3]], (label, table)
        assert f"... {len(result.ranked) - 3} more" in table
        assert f"best: {result.best.plan.label}" in table, (label, table)
        assert "hierarchical_a2a: " in table  # a form not searched says why



def test_print_of_a_search_result_is_its_table(capsys):
    """`print(moepass.search(...))` prints the ranked table, not the dataclass's repr; repr stays the dataclass's."""
    import moepass
    from samples.models import tiny_mixtral

    found = moepass.search(tiny_mixtral(), (1, 4), (2, 512))
    assert str(found) == found.table()
    print(found)
    out = capsys.readouterr().out
    assert out.startswith("plans for W=4 (1 node(s) x 4), T=1024 tokens/rank") and "SearchResult(" not in out
    assert f"best: {found.best.label}" in out and repr(found).startswith("SearchResult(")
