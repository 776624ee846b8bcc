"""FSEP placement planner (moepass.runtime.placement) and its cost model (cost_model.fsep).

Hand-computed cases first (lite routing, replica counts, node-spreading placement), then properties on
random counts checked against a brute-force lite router that walks every routed row, determinism, the
Zipf skew the planner exists for, the cost formula against its sympy form, and the error messages.

Shape legend: W ranks, E experts, G = W*C global slots.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sympy
import torch
from hypothesis import given
from hypothesis import strategies as st

from cost_model import fsep as cf
from cost_model import symbols as S
from cost_model.presets import A100
from moepass.runtime.placement import (
    CountHistory,
    PlacementTable,
    PlannerConfig,
    candidate_tables,
    device_rows,
    even_replicas,
    even_table,
    lite_route_counts,
    max_over_mean,
    place,
    plan,
    proportional_replicas,
    route_totals,
    table_cost,
)

REPO = Path(__file__).resolve().parents[1]


def brute_force_route(counts_WE, table: PlacementTable) -> np.ndarray:
    """Independent lite router: send every routed row j of (i, e) to Pref[(j*m) // n], one at a time."""
    counts = np.asarray(counts_WE)
    W, C, G = table.world, table.slots, table.ranks_per_node
    rows_WU = np.zeros((W, W * C), dtype=np.int64)
    for i in range(W):
        for e in range(counts.shape[1]):
            hosting = [g for g in range(W * C) if table.slot_expert[g] == e]
            local = [g for g in hosting if (g // C) // G == i // G]
            pref = local or hosting
            n = int(counts[i, e])
            for j in range(n):
                rows_WU[i, pref[(j * len(pref)) // n]] += 1
    return rows_WU


def zipf_topk_counts(W: int, E: int, T: int, K: int, s: float, seed: int) -> torch.Tensor:
    """[W, E] routed rows: each of T tokens per rank picks K distinct experts with p_e ~ 1/rank^s (the
    popularity ranks a seeded permutation of the experts)."""
    gen = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
    p = p[torch.randperm(E, generator=gen)]
    rows = [torch.multinomial(p.expand(T, E), K, replacement=False, generator=gen).flatten() for _ in range(W)]
    return torch.stack([torch.bincount(r, minlength=E) for r in rows])


def a100_config(E: int, W: int, C: int, ranks_per_node: int) -> PlannerConfig:
    return PlannerConfig.from_hardware(A100, E=E, W=W, C=C, ranks_per_node=ranks_per_node, D=4096, F=14336)


# ---- hand-computed cases -------------------------------------------------------------------------------

# W=4 ranks, C=2, 2 nodes of 2. Slots g: dev0 {0,1}, dev1 {2,3} (node 0); dev2 {4,5}, dev3 {6,7} (node 1).
HAND_TABLE = PlacementTable((0, 1, 3, 3, 1, 1, 2, 0), world=4, slots=2, ranks_per_node=2, experts=4)


def test_lite_routing_by_hand():
    counts = torch.tensor([[5, 0, 3, 0],  # rank 0 (node 0)
                           [0, 2, 0, 4],  # rank 1 (node 0)
                           [4, 5, 0, 7],  # rank 2 (node 1)
                           [0, 0, 1, 0]])  # rank 3 (node 1)
    expected = torch.zeros(4, 8, dtype=torch.int64)
    expected[0, 0] = 5  # e0: local replica slot 0 only (slot 7 is on node 1)
    expected[0, 6] = 3  # e2 lives only on node 1: all of R_e = [6]
    expected[1, 1] = 2  # e1: local slot 1 only
    expected[1, 2], expected[1, 3] = 2, 2  # e3: local [2, 3], 4 rows -> 2, 2
    expected[2, 7] = 4  # e0: local slot 7
    expected[2, 4], expected[2, 5] = 3, 2  # e1: local [4, 5], 5 rows: rows 0,1,2 -> q=0 (j*2//5 = 0), rows 3,4 -> q=1
    expected[2, 2], expected[2, 3] = 4, 3  # e3: no replica on node 1: R_e = [2, 3], 7 rows -> ceil(7/2)=4, 3
    expected[3, 6] = 1  # e2: local slot 6
    got = lite_route_counts(counts, HAND_TABLE)
    assert torch.equal(got, expected)
    assert torch.equal(got, torch.from_numpy(brute_force_route(counts, HAND_TABLE)))
    totals = route_totals(counts, HAND_TABLE)
    # own device: rank 0 -> slot 0 (5), rank 1 -> slots 2, 3 (4), rank 2 -> none of 4, 5 (dev 2 is slots 4, 5: 5),
    # rank 3 -> slot 6 (1). Off node: rank 0 e2 (3) + rank 2 e3 (7) = 10. Total 31.
    assert totals.q_inter == 10 and totals.q_intra == 31 - 10 - (5 + 4 + 5 + 1)
    assert totals.loads.tolist() == [5 + 2, 4 + 4 + 3, 3 + 2, 3 + 1 + 4]


def test_table_derived_views():
    t = HAND_TABLE
    assert t.device_experts(1) == (3, 3) and t.device_experts(3) == (2, 0)
    assert t.expert_slots == ((0, 7), (1, 4, 5), (6,), (2, 3))
    assert t.replicas == (2, 3, 1, 2) and t.nodes == 2
    tensor = t.as_tensor("cpu")
    assert tensor.dtype == torch.int64 and tensor.tolist() == list(t.slot_expert)
    assert PlacementTable(tensor, 4, 2, 2, 4) == t  # a tensor is accepted and stored as a tuple


def test_replica_counts_by_hand():
    # proportional, start 1: quotients 60 30 10 0 -> e0 (30); tie e0 30/2 vs e1 30/1: fewer replicas first -> e1;
    # e0 (30 -> 20); e0 (20 -> 15): [4, 2, 1, 1] = 8
    assert proportional_replicas([60, 30, 10, 0], 8, 1) == [4, 2, 1, 1]
    # start 2 (one per node, 2 nodes): 30 15 5 0 -> e0 (20), e0 (15), tie 15/4 vs 15/2 -> e1 (10), e0 (12): [5, 3, 2, 2]
    assert proportional_replicas([60, 30, 10, 0], 12, 2) == [5, 3, 2, 2]
    assert proportional_replicas([0, 0, 0], 7, 1) == [3, 2, 2]  # no load: the spare slots go round-robin
    # even: 10 slots / 4 experts = 2 each, the 2 left over to the two most loaded
    assert even_replicas([60, 30, 10, 0], 10) == [3, 3, 2, 2]
    assert even_replicas([5, 9, 9, 1], 6) == [1, 2, 2, 1]  # tie between e1 and e2 on load: lower index first
    # candidates start with one replica per node when W*C allows it (2 nodes x 4 experts = 8 <= 12)
    config = PlannerConfig(E=4, W=4, C=3, ranks_per_node=2)
    counts = torch.tensor([[30, 15, 5, 0]] * 4)
    tables = candidate_tables(counts, config)
    assert tables["proportional"].replicas == (5, 3, 2, 2) and tables["even"].replicas == (3, 3, 3, 3)


def test_node_spreading_placement_by_hand():
    # E=3 on 2 nodes x 2 devices x 2 slots; replicas [3, 3, 2], loads [8, 4, 4].
    # Order by load per replica: e0 (8/3), e2 (4/2), e1 (4/3). Unit loads: e0 [3, 3, 2], e2 [2, 2], e1 [2, 1, 1].
    # e0: node0 -> d0 (3); node1 -> d2 (3); round 2: node0's least loaded free device d1 (2).
    # e2: nodes by least-loaded free device: node1 (d3, 0) -> d3 (2); node0 (d1, 2) -> d1 (4, full).
    # e1: node1 (d3, 2) -> d3 (4, full); node0 (d0, 3) -> d0 (full); round 2: node1 -> d2.
    assert place([3, 3, 2], [8, 4, 4], W=4, C=2, ranks_per_node=2) == [0, 1, 0, 2, 0, 1, 2, 1]
    # even table (uniform load): each expert's replicas alternate over the nodes, devices fill evenly
    assert even_table(4, 4, 2, 2).slot_expert == (0, 2, 1, 3, 0, 2, 1, 3)
    assert even_table(2, 4, 2, 2).slot_expert == (0, 1, 0, 1, 0, 1, 0, 1)


@pytest.mark.parametrize("E,W,C,G", [(8, 16, 2, 4), (16, 32, 4, 8), (6, 12, 3, 3), (64, 64, 2, 8)])
def test_even_table_spreads_every_expert_over_the_nodes(E, W, C, G):
    table = even_table(E, W, C, G)
    N = W // G
    for e, slots in enumerate(table.expert_slots):
        per_node = [sum(1 for g in slots if g // C // G == n) for n in range(N)]
        assert max(per_node) - min(per_node) <= 1, (e, per_node)
    assert set(table.replicas) <= {W * C // E, W * C // E + 1}


# ---- properties on random counts --------------------------------------------------------------------------

shapes = st.tuples(
    st.integers(1, 4),  # ranks per node
    st.integers(1, 4),  # nodes
    st.integers(1, 4),  # slots per device
).flatmap(lambda t: st.tuples(st.just(t), st.integers(1, t[0] * t[1] * t[2])))


@given(shapes, st.integers(0, 2**31 - 1), st.sampled_from([0, 1, 7, 300, 10**6]))
def test_every_planned_table_is_valid_and_routes_every_row(shape, seed, high):
    (G, N, C), E = shape
    W = G * N
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, high + 1, (W, E), generator=gen)
    if seed % 3 == 0:  # skewed: a few experts take most rows
        counts[:, seed % E] *= 50
    decision = plan(counts, PlannerConfig(E=E, W=W, C=C, ranks_per_node=G))
    table = decision.table
    assert len(table.slot_expert) == W * C and sorted(set(table.slot_expert)) == list(range(E))
    assert sum(table.replicas) == W * C and min(table.replicas) >= 1
    assert set(decision.costs) == {"even", "proportional"} and decision.candidate in decision.costs
    assert decision.costs[decision.candidate] == min(decision.costs.values())
    rows_WU = lite_route_counts(counts, table)
    for e, slots in enumerate(table.expert_slots):  # every row reaches a replica of its expert
        assert torch.equal(rows_WU[:, list(slots)].sum(dim=1), counts[:, e])
    rows = device_rows(rows_WU, C)
    q_intra, q_inter, q_max = cf.link_rows(rows, G)
    totals = route_totals(counts, table)
    assert (totals.q_intra, totals.q_inter) == (q_intra, q_inter)
    assert torch.equal(totals.loads, rows.sum(dim=0)) and int(totals.loads.max()) == q_max
    assert decision.max_over_mean == pytest.approx(max_over_mean(rows.sum(dim=0)))


@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_lite_routing_matches_the_row_by_row_router(G, N, C, seed):
    W = G * N
    rng = np.random.default_rng(seed)
    E = int(rng.integers(1, W * C + 1))
    slot_expert = np.concatenate([np.arange(E), rng.integers(0, E, W * C - E)])
    rng.shuffle(slot_expert)
    table = PlacementTable(tuple(slot_expert.tolist()), W, C, G, E)
    counts = torch.from_numpy(rng.integers(0, 40, (W, E)))
    assert torch.equal(lite_route_counts(counts, table), torch.from_numpy(brute_force_route(counts, table)))
    totals = route_totals(counts, table)
    assert torch.equal(totals.loads, device_rows(lite_route_counts(counts, table), C).sum(dim=0))


# ---- determinism -----------------------------------------------------------------------------------------


def _zipf_64() -> torch.Tensor:
    return zipf_topk_counts(64, 64, 256, 2, 1.2, seed=3) * 5


def test_same_counts_same_table_whatever_the_input_path():
    config = a100_config(64, 64, 2, 8)
    counts = _zipf_64()
    first = plan(counts, config)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    inverse = torch.argsort(perm)
    variants = [
        counts.clone(),
        counts[perm][inverse],  # rows permuted then unpermuted
        counts[:, perm][:, inverse],  # experts permuted then unpermuted
        counts.T.contiguous().T,  # a non-contiguous view
        counts.numpy().astype(np.int32),
        counts.to(torch.float64),
        counts.tolist(),
    ]
    for variant in variants:
        again = plan(variant, config)
        assert again.table == first.table and again.candidate == first.candidate and again.costs == first.costs
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert plan(counts, config).table == first.table
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_same_table_in_another_process_with_another_hash_seed():
    """Nothing may hang on set or dict order: a process with a different PYTHONHASHSEED plans the same table."""
    counts = _zipf_64()
    here = plan(counts, a100_config(64, 64, 2, 8)).table.slot_expert
    script = (
        "import sys, torch; sys.path.insert(0, 'tests'); from test_fsep_planner import _zipf_64, a100_config; "
        "from moepass.runtime.placement import plan; "
        "print(list(plan(_zipf_64(), a100_config(64, 64, 2, 8)).table.slot_expert))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(list(here))


# ---- the skew the planner exists for -----------------------------------------------------------------------


def best_one_replica_split(loads_E: list[int], slots: int) -> float:
    """max/mean of the best placement of E experts, one replica each, on 2 devices of `slots` slots (exhaustive)."""
    E, total = len(loads_E), sum(loads_E)
    best = float("inf")
    for first in itertools.combinations(range(E), slots):
        a = sum(loads_E[e] for e in first)
        best = min(best, max(a, total - a) / (total / 2))
    return best


@pytest.mark.parametrize("C", [4, 5, 6])
def test_zipf_skew_planner_beats_ep(C, capsys):
    """Zipf(1.2), top-2 of 8 experts on 2 ranks of one node. The best table with one replica per expert
    (C=4) is found exhaustively; with C=5 or 6 that table is still possible (the extra slots duplicate an
    expert on the device that already hosts it, which splits nothing), so it bounds what C allows."""
    W, E, K = 2, 8, 2
    counts = zipf_topk_counts(W, E, 4096, K, 1.2, seed=0)
    decision = plan(counts, a100_config(E, W, C, ranks_per_node=2))
    ep = counts.sum(dim=0)
    ep_rows = torch.stack([ep[:4].sum(), ep[4:].sum()])  # EP: device n computes experts [4n, 4n + 4)
    assert decision.ep_max_over_mean == pytest.approx(float(ep_rows.max() / ep_rows.double().mean()))
    achievable = best_one_replica_split(ep.tolist(), 4)
    with capsys.disabled():
        print(f"\nZipf(1.2) W=2 E=8 K=2 C={C}: EP max/mean {decision.ep_max_over_mean:.4f}, planner "
              f"{decision.max_over_mean:.4f} ({decision.candidate}), best one-replica split {achievable:.4f}")
    assert achievable < 1.15  # so C allows it, for every C here
    assert decision.max_over_mean <= decision.ep_max_over_mean
    assert decision.max_over_mean < 1.15


def test_proportional_wins_when_one_expert_dominates():
    """One expert with most of the rows: 'even' gives it 4 of 32 slots, 'proportional' the spare ones.

    8 ranks (one node), 4 slots each; expert 3 gets 8 x 10,000 rows, the 7 others 8 x 100. Proportional:
    one replica each, then all 24 spare slots to expert 3 (80,000/25 = 3,200 > 800 per replica), so 25
    units of 3,200 rows go round-robin: device 0 gets 4 (12,800 rows), the others 3 plus one cold expert
    (10,400); mean 85,600 / 8 = 10,700. EP: device 3 computes all 80,000 rows of expert 3.
    """
    W, E, C = 8, 8, 4
    counts = torch.full((W, E), 100)
    counts[:, 3] = 10_000
    decision = plan(counts, a100_config(E, W, C, ranks_per_node=8))
    assert decision.candidate == "proportional"
    assert decision.costs["proportional"] < decision.costs["even"]
    assert decision.table.replicas == (1, 1, 1, 25, 1, 1, 1, 1)
    assert decision.max_over_mean == pytest.approx(12_800 / 10_700)
    assert decision.ep_max_over_mean == pytest.approx(80_000 / 10_700)


# ---- the cost model ----------------------------------------------------------------------------------------


def literal_cost(rows_WW: np.ndarray, G: int, config: PlannerConfig) -> float:
    """The planner's formula term by term: T_comm[i] = sum_k rows[i, k] * bytes / bw(i, k), bw(i, i) = inf."""
    W = rows_WW.shape[0]
    t_comm = [sum(rows_WW[i, k] * config.bytes_per_token / (config.intra_bw if i // G == k // G else config.inter_bw)
                  for k in range(W) if k != i) for i in range(W)]
    t_comp = [config.time_per_token * rows_WW[:, k].sum() for k in range(W)]
    return 4 * sum(t_comm) + (3 + config.recompute) * max(t_comp)


@pytest.mark.parametrize("W,G,seed", [(4, 2, 0), (8, 4, 1), (6, 3, 2), (16, 8, 3), (5, 1, 4)])
def test_cost_formula_matches_its_symbolic_form(W, G, seed):
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 5000, (W, W))
    hw = A100.values()
    D, F, m = 1024, 2048, 3
    config = PlannerConfig.from_hardware(A100, E=W, W=W, C=1, ranks_per_node=G, D=D, F=F, recompute=bool(seed % 2))
    expr = cf.planner_cost(S.Q_intra, S.Q_inter, S.Q_max, cf.token_bytes(S.D, S.b),
                           cf.token_time(S.D, S.F, S.m, S.R, S.eta), S.B_intra, S.B_inter,
                           recompute=config.recompute)
    on_node = sum(rows[i, k] for i in range(W) for k in range(W) if i // G == k // G and i != k)
    off_node = sum(rows[i, k] for i in range(W) for k in range(W) if i // G != k // G)
    values = {S.Q_intra: on_node, S.Q_inter: off_node, S.Q_max: rows.sum(axis=0).max(), S.D: D, S.F: F, S.m: m,
              S.b: hw["b"], S.R: hw["R"], S.eta: hw["eta"], S.B_intra: hw["B_intra"], S.B_inter: hw["B_inter"]}
    symbolic = float(expr.subs(values))
    numeric = cf.rows_cost(rows, G, config.bytes_per_token, config.time_per_token, config.intra_bw, config.inter_bw,
                           recompute=config.recompute)
    assert numeric == pytest.approx(symbolic, rel=1e-12)
    assert numeric == pytest.approx(literal_cost(rows, G, config), rel=1e-12)
    assert cf.link_rows(torch.from_numpy(rows), G) == (on_node, off_node, int(rows.sum(axis=0).max()))


def test_symbolic_cost_and_memory_properties():
    cost = cf.planner_cost(S.Q_intra, S.Q_inter, S.Q_max, cf.token_bytes(S.D, S.b),
                           cf.token_time(S.D, S.F, S.m, S.R, S.eta), S.B_intra, S.B_inter)
    assert sympy.diff(cost, S.B_inter).is_negative and sympy.diff(cost, S.B_intra).is_negative
    assert sympy.diff(cost, S.Q_max).is_positive and sympy.diff(cost, S.Q_inter).is_positive
    assert sympy.simplify(sympy.diff(cost, S.Q_max) - 3 * 2 * S.m * S.D * S.F / (S.R * S.eta)) == 0
    mem = cf.param_elements_per_rank(S.E, S.W, S.C, S.S_e)
    assert sympy.simplify(mem - (S.E * S.S_e / S.W + S.C * S.S_e)) == 0
    d = sympy.Symbol("d", integer=True, nonnegative=True)
    assert sympy.simplify(cf.param_elements_per_rank(S.E, S.W, S.C, S.S_e, prefetch=d) - mem - d * S.C * S.S_e) == 0
    intra, inter = cf.restore_bytes(S.C, S.S_e, S.W, S.G, S.b)
    assert sympy.simplify(intra + inter - S.C * S.S_e * S.b * (S.W - 1) / S.W) == 0  # C*S/W to each of W-1 peers
    assert cf.param_elements_per_rank(8, 32, 2, 100, prefetch=2) == 8 * 100 / 32 + 2 * 100 + 2 * 2 * 100


def test_table_cost_is_the_formula_on_the_routed_rows():
    counts = _zipf_64()[:16, :16] + 1
    config = a100_config(16, 16, 2, 4)
    table = plan(counts, config).table
    cost, loads = table_cost(counts, table, config)
    rows = device_rows(torch.from_numpy(brute_force_route(counts, table)), 2).numpy()
    assert cost == pytest.approx(literal_cost(rows, 4, config), rel=1e-12)
    assert loads.tolist() == rows.sum(axis=0).tolist()


def test_config_from_hardware_reads_the_preset():
    config = PlannerConfig.from_hardware(A100, E=8, W=32, C=2, ranks_per_node=8, D=4096, F=14336)
    assert config.bytes_per_token == 4096 * 2  # bf16 rows
    assert config.time_per_token == pytest.approx(2 * 3 * 4096 * 14336 / (312e12 * 0.5))
    assert (config.intra_bw, config.inter_bw) == (216.3e9, 88.95e9) and config.recompute == 0
    assert config.history == 5 and config.nodes == 4
    recomputing = PlannerConfig.from_hardware(A100, E=8, W=32, C=2, ranks_per_node=8, D=4096, F=14336, recompute=True)
    assert recomputing.recompute == pytest.approx(2 / 3)  # ep.compute_time's (m-1)/m for gated experts


def test_count_history_sums_the_last_steps():
    history = CountHistory(5, W=2, E=3)
    assert len(history) == 0 and history.total().tolist() == [[0, 0, 0], [0, 0, 0]]
    steps = [torch.full((2, 3), k) for k in range(1, 8)]
    for step in steps:
        history.push(step)
    assert len(history) == 5
    assert torch.equal(history.total(), sum(steps[-5:]))  # steps 3..7
    with pytest.raises(ValueError, match=r"expected \[W, E\] = \[2, 3\]"):
        history.push(torch.zeros(3, 2, dtype=torch.int64))


# ---- errors name the field and the fix --------------------------------------------------------------------


@pytest.mark.parametrize("make,match", [
    (lambda: PlannerConfig(E=8, W=2, C=3, ranks_per_node=2), r"W\*C = 2\*3 = 6 slots < E = 8.*raise C to >= ceil\(E/W\) = 4"),
    (lambda: PlannerConfig(E=8, W=6, C=2, ranks_per_node=4), r"ranks_per_node=4 does not divide W=6"),
    (lambda: PlannerConfig(E=8, W=4, C=2, ranks_per_node=2, history=0), r"PlannerConfig.history=0 is invalid"),
    (lambda: PlannerConfig(E=8, W=4, C=2, ranks_per_node=2, inter_bw=0.0), r"PlannerConfig.inter_bw=0.0 is invalid"),
    (lambda: PlacementTable((0, 1, 2, 0, 1, 2, 0), 2, 4, 2, 3),
     r"slot_expert has 7 entries, expected world\*slots = 2\*4 = 8: one expert id per global slot"),
    (lambda: PlacementTable((0, 1, 0, 1), 2, 2, 2, 3), r"hosts no replica of expert\(s\) \[2\]"),
    (lambda: PlacementTable((0, 1, 5, 1), 2, 2, 2, 3), r"slot_expert\[2\]=5 is not an expert id in \[0, 3\)"),
    (lambda: PlacementTable((0, 1), 1, 2, 1, 3), r"world\*slots = 1\*2 = 2 slots < experts = 3.*slots >= ceil\(E/world\) = 3"),
    (lambda: PlacementTable((0, 1, 2, 0, 1, 2), 3, 2, 2, 3), r"ranks_per_node=2 does not divide world=3"),
    (lambda: even_table(9, 2, 4, 2), r"W\*C = 2\*4 = 8 slots < E = 9"),
    (lambda: plan(torch.ones(2, 7, dtype=torch.int64), PlannerConfig(E=8, W=2, C=4, ranks_per_node=2)),
     r"counts_WE has shape \(2, 7\): expected \[W, E\] = \[2, 8\]"),
    (lambda: plan(-torch.ones(2, 8, dtype=torch.int64), PlannerConfig(E=8, W=2, C=4, ranks_per_node=2)),
     r"negative"),
    (lambda: plan(torch.full((2, 8), 0.5), PlannerConfig(E=8, W=2, C=4, ranks_per_node=2)), r"fractional"),
])
def test_errors_name_the_problem_and_the_fix(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_decision_summary_reads_well():
    decision = plan(_zipf_64(), a100_config(64, 64, 2, 8))
    text = decision.summary()
    assert decision.candidate in text and "vs EP" in text and "ms" in text
    assert decision.solve_s > 0 and decision.ep_size == 64
