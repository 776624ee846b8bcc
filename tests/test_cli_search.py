"""`python -m moepass search --scenario …`: a readable ranked table per case of a published set-up.

The ranking is checked against costs this file computes itself: each candidate's figures are filled
by hand from the scenario file and the a100 preset, priced with the cost model's layer formula
(`cost_model.ep.ep_step`, whose own terms tests/test_cost_model.py checks against known answers),
and the bytes, memory and the candidate set against closed formulas. FSEP candidates (uniform routing:
the set-up gives none) are priced by hand from the runtime planner's table (`fsep_by_hand`, shared with
tests/test_cost_model.py), HP candidates from the converted block's sizes (`hp_by_hand`, likewise), both
plus the last layer's dense all-reduce, which every form pays (`cost_model.ep.dense_allreduce_tail`).
Wall time: benchmarks/tool_time.py.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_cost_model import fsep_by_hand, hp_by_hand

from cost_model.ep import dense_allreduce_tail, ep_step
from cost_model.presets import preset
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
    cluster = SCENARIO["cluster"]
    a100 = preset("a100")
    # the scenario's figures over the a100 preset (intra_node_bw is null in the set-up: the preset's)
    figures = {**a100.values(), "R": cluster["device_flops"], "B_inter": cluster["inter_node_bw"]}
    assert [label for label, _ in results] == [label for label, _, _ in _cases()]  # 3 models x 4 expert counts
    for (label, result), (_, model, E) in zip(results, _cases()):
        per_node = min(E, cluster["devices_per_node"])
        nodes = E // per_node
        L, D, F, K = model["layers"], model["hidden"], model["ffn_hidden"], model["top_k"]
        m = 2  # Transformer-XL, GPT-2 and BERT FFNs are ungated: up and down projections
        assert (result.world_size, result.nodes, result.ranks_per_node, result.tokens) == (E, nodes, per_node, TOKENS)
        assert result.hardware.values() == figures, label

        # the candidates: no rewrite, EP over every divisor of W > 1 x capacity x chunks; packing P
        # would only repeat ep_size / P, which is already listed, so every candidate is unpacked; FSEP
        # over the W = E ranks with C = ceil(E/W) = 1 .. 3 slots per device x chunks; and HP over every
        # divisor P > 1 of W (unchunked: the rewrite waits for each exchange)
        want = ({("single", 1, None, 1, None)} | {("ep", ep, cf, n, None) for ep in range(2, E + 1) if E % ep == 0
                                                  for cf in CAPACITY_FACTORS for n in CHUNKS}
                | {("fsep", E, None, n, C) for C in (1, 2, 3) for n in CHUNKS}
                | {("hp", P, None, 1, None) for P in range(2, E + 1) if E % P == 0})
        got = [(c.form, c.ep_size, c.capacity_factor, c.a2a_chunks, c.slots) for c in result.ranked]
        assert len(got) == len(set(got)) and set(got) == want, label
        assert all(c.packing == 1 for c in result.ranked)

        expected_step = {}
        counts = np.full((E, E), TOKENS * K // E)  # uniform routing, T*K rows per rank
        # dense parameters per layer: attention 4 D^2 and 1/L of the embeddings (vocab x D, every vocabulary);
        # all-reduced over all E ranks in DDP's 25 MiB buckets (search's default schedule, "fair")
        vocab = model["vocab"] if isinstance(model["vocab"], list) else [model["vocab"]]
        link = {"P_d": 4 * D**2 + sum(vocab) * D / L, "q": 1024, "u": 25 * 2**20}
        tail = float(dense_allreduce_tail({**figures, **link}, E, cross_node=nodes > 1))
        for c in result.ranked:
            if c.form == "fsep":
                step, memory = fsep_by_hand(counts, result.hardware, C=c.slots, G=per_node, D=D, F=F, m=2, layers=L,
                                            n=c.a2a_chunks)
                step += tail
                expected_step[c] = step
                assert c.step == pytest.approx(step, rel=1e-9), (label, c.label)
                assert float(c.terms.memory) == pytest.approx(memory, rel=1e-9), (label, c.label)
                assert c.feasible == (memory <= float(a100.memory)) and not c.math_changing, (label, c.label)
                continue
            if c.form == "hp":  # the block converted to a Multi-Head LatentMoE: H = max(P, 4) heads of D/H
                hp = hp_by_hand(result.hardware, T=TOKENS, D=D, E=E, K=K, F=F, n=2, W=E, G=per_node, P=c.ep_size,
                                layers=L)
                expected_step[c] = hp["step"] + tail
                assert c.step == pytest.approx(hp["step"] + tail, rel=1e-9), (label, c.label)
                assert 4 * float(c.terms.a2a_bytes) == pytest.approx(hp["bytes"], rel=1e-12), (label, c.label)
                assert float(c.terms.memory) == pytest.approx(hp["memory"], rel=1e-9), (label, c.label)
                assert c.latent[0].heads == max(c.ep_size, 4) and c.latent[0].ffn_dim == hp["ffn"], (label, c.label)
                assert c.feasible == (hp["memory"] <= float(a100.memory)) and c.math_changing, (label, c.label)
                continue
            ep = c.ep_size
            factor = 1.0 if c.capacity_factor is None else c.capacity_factor
            x = {**figures, **link, "T": TOKENS, "K": K, "D": D, "F": F, "m": m, "E": E, "G": per_node, "rho": 1.0,
                 "c_f": factor}
            terms = ep_step([x] * L, ep=ep, n=c.a2a_chunks, dp=E // ep, dropless=c.capacity_factor is None,
                            cross_node_dp=nodes > 1)  # every layer is one MoE block of the same shape
            step = float(terms.step)
            expected_step[c] = step
            assert c.step == pytest.approx(step, rel=1e-12), (label, c.label)
            # bytes each rank sends per all-to-all direction: its rows bound for the other ep-1 ranks
            sent = L * factor * K * TOKENS * D * figures["b"] * (ep - 1) / ep
            assert float(c.terms.a2a_bytes) == pytest.approx(sent, rel=1e-12), (label, c.label)
            if c.form == "single":
                assert float(c.terms.a2a_exposed) == 0.0 and float(c.terms.a2a_bytes) == 0.0
            # memory: this rank's E/ep experts with grads and optimizer state, plus the kept activations
            memory = L * (E * m * D * F / ep * figures["s"] + TOKENS * K * factor * (2 * D + m * F) * figures["b"])
            assert float(c.terms.memory) == pytest.approx(memory, rel=1e-12), (label, c.label)
            assert c.feasible == (memory <= float(a100.memory)), (label, c.label)
            assert c.math_changing == (c.capacity_factor is not None)  # the models are dropless

        # ranked: feasible and exact plans first, each group by increasing cost
        keys = [(not c.feasible, c.math_changing, expected_step[c]) for c in result.ranked]
        assert keys == sorted(keys), label
        eligible = [c for c in result.ranked if c.feasible and not c.math_changing]
        assert expected_step[result.best] == min(expected_step[c] for c in eligible), label
        assert not result.best.math_changing and result.best.feasible


def test_cli_prints_a_ranked_table_per_case(results):
    out = subprocess.run([sys.executable, "-m", "moepass", "search", "--scenario", str(LINA), "--limit", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "scenario lina-priority: hardware a100" in out.stdout
    assert "filled intra_node_bw: preset a100" in out.stdout  # a null figure names the preset that filled it
    assert "fsep:" not in out.stdout  # FSEP is priced: no "not modelled" line
    sections = re.split(r"^== (.+)$", out.stdout, flags=re.M)[1:]
    tables = dict(zip(sections[::2], sections[1::2]))
    assert list(tables) == [label for label, _ in results]
    for label, result in results:
        table = tables[label]
        rows = re.findall(r"^(\d+)  (\S.*?)  ", table, flags=re.M)
        assert [int(i) for i, _ in rows] == [1, 2, 3], (label, table)  # --limit 3
        assert [plan.strip() for _, plan in rows] == [c.label for c in result.ranked[:3]], (label, table)
        assert f"... {len(result.ranked) - 3} more" in table
        assert f"best: {result.best.label}; runner-up: {result.runner_up.label}" in table, (label, table)
        full = result.table(limit=len(result.ranked))  # every FSEP row, named by its C and chunks
        fsep_rows = re.findall(r"^\d+ +fsep C=(\d) n=(\d+) ", full, flags=re.M)
        assert sorted((int(C), int(n)) for C, n in fsep_rows) == sorted((C, n) for C in (1, 2, 3) for n in CHUNKS)


def test_print_of_a_search_result_is_its_table(results, capsys):
    """`print(moepass.search(...))` prints the ranked table (what `python -m moepass search` prints), not the
    dataclass's repr; repr stays the dataclass's."""
    import moepass
    from samples.models import tiny_mixtral

    _, result = results[0]
    assert str(result) == result.table()
    found = moepass.search(tiny_mixtral(), (1, 4), (2, 512))
    print(found)
    out = capsys.readouterr().out
    assert out.startswith("plans for W=4 (1 node(s) x 4), T=1024 tokens/rank") and "SearchResult(" not in out
    assert f"best: {found.best.label}" in out and repr(found).startswith("SearchResult(")
