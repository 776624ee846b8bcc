"""The locality cost model (`cost_model.locality`, LocMoE) and its simulation (`cost_model.simulate`).

(a) The capacity floor of Theorem 1 equals a direct numerical integration of the two caps |cos theta| >= delta
    over the sphere S^{D-1} (mpmath.quad of sin^{D-2}, not the incomplete beta), the closed forms at D = 2
    and 3, a Monte-Carlo count at small D, and the same from delta measured on tokens as the runtime
    measures it (`moepass.runtime.locality.measured_delta`); the capacity never below the floor.
(b) The inter/intra-node byte formulas against bytes counted by hand from explicit token -> expert tables
    with a known locality ratio (hand-written placements, nodes > experts included), dropless and with
    capacity, and against the simulator's path (`rows_matrix` + `cost_model.ep.exact_a2a`).
(c) The locmoe scenario: the hash router, the switch router and LocMoE as three systems with their own
    bytes and step times, at 64 / 128 / 256 devices (32 nodes > 16 experts at 256).

Shape legend: T tokens of a rank, D width, E experts, W ranks.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import mpmath
import numpy as np
import pytest
import sympy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_model import simulate
from cost_model.ep import exact_a2a
from cost_model.locality import (
    MEASURED_INTER_FACTOR,
    Placement,
    capacity_floor,
    capacity_rows,
    expert_capacity,
    rank_bytes,
    router_ratio,
    routing_counts,
    rows_matrix,
    uniform_ratio,
)
from cost_model.scenarios import cases
from moepass.runtime.locality import grap_gate, grap_logits, locality_route, measured_delta

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = simulate.SCENARIO_DIR / "locmoe_locality.json"


# ---- (a) the floor against the sphere ----------------------------------------------------------------


def cap_mass(delta: float, dim: int) -> mpmath.mpf:
    """Surface share of the two caps |cos theta| >= delta on S^{dim-1}, by quadrature: the area element in
    the polar angle is proportional to sin^{dim-2}(theta); the caps are theta <= acos(delta) and its mirror.
    Both integrals cut in 16 / 32 pieces (the integrand peaks sharply at large dim)."""
    with mpmath.workdps(40):
        density = lambda t: mpmath.sin(t) ** (dim - 2)  # noqa: E731
        edge = mpmath.acos(mpmath.mpf(delta))
        caps = 2 * mpmath.quad(density, mpmath.linspace(0, edge, 17))
        return caps / mpmath.quad(density, mpmath.linspace(0, mpmath.pi, 33))


# small D at every delta, and model widths at the deltas they measure (a few / sqrt(D): beyond, the floor
# exceeds any batch and the capacity is T)
SPHERE_CASES = [(delta, dim) for dim in (2, 3, 5, 16, 64) for delta in (0.05, 0.3, 0.7, 0.95)] + [
    (c / math.sqrt(dim), dim) for dim in (1024, 4096) for c in (0.5, 2.0, 4.0)]


@pytest.mark.parametrize(("delta", "dim"), SPHERE_CASES)
@pytest.mark.parametrize("experts", [4, 16])
def test_floor_equals_sphere_integral(delta: float, dim: int, experts: int):
    direct = 1 / (experts * cap_mass(delta, dim))
    assert capacity_floor(delta, experts, dim) == pytest.approx(float(direct), rel=1e-12)


@pytest.mark.parametrize("delta", [0.0, 0.1, 0.5, 0.9, 0.999])
def test_floor_closed_forms_at_small_dim(delta: float):
    # D = 2: the circle; the caps are two arcs of 2*acos(delta) out of 2*pi, twice. D = 3: Archimedes' hat-box
    # theorem, the caps' area is 2 * 2*pi*(1 - delta) out of 4*pi.
    assert float(cap_mass(delta, 2)) == pytest.approx(2 * math.acos(delta) / math.pi, rel=1e-14)
    assert float(cap_mass(delta, 3)) == pytest.approx(1 - delta, rel=1e-14)
    assert capacity_floor(delta, 8, 2) == pytest.approx(1 / (8 * 2 * math.acos(delta) / math.pi), rel=1e-12)
    assert capacity_floor(delta, 8, 3) == pytest.approx(1 / (8 * (1 - delta)), rel=1e-12)


@pytest.mark.parametrize("dim", [2, 3, 5])
def test_floor_against_monte_carlo(dim: int):
    n, delta = 400_000, 0.4
    x_ND = np.random.default_rng(dim).standard_normal((n, dim))
    cos_N = x_ND[:, 0] / np.linalg.norm(x_ND, axis=1)  # the gate vector e_0: uniform points, any axis alike
    share = float(np.mean(np.abs(cos_N) >= delta))
    p = float(cap_mass(delta, dim))
    assert abs(share - p) <= 5 * math.sqrt(p * (1 - p) / n)  # 5 standard errors of the binomial count
    assert 1 / (8 * share) == pytest.approx(capacity_floor(delta, 8, dim), rel=5 * math.sqrt((1 - p) / (p * n)))


def text_tokens(dim: int) -> torch.Tensor:
    """Tokens of real text: the bytes of this repository's ARCHITECTURE.md through a seeded embedding."""
    data = torch.tensor(list((ROOT / "docs" / "ARCHITECTURE.md").read_bytes()[:512]))
    torch.manual_seed(0)
    embed = torch.nn.Embedding(256, dim)
    with torch.no_grad():
        return embed(data)


@pytest.mark.parametrize("source", ["gaussian", "text"])
def test_floor_from_measured_delta(source: str):
    D, E = 16, 4
    torch.manual_seed(1)
    x_TD = torch.randn(256, D) if source == "gaussian" else text_tokens(D)
    gate_ED = grap_gate(E, D)
    _, experts_T1, _ = locality_route(grap_logits(x_TD, E))
    delta = measured_delta(x_TD, gate_ED, experts_T1)  # the runtime's measurement (moe_loc.floor_keep)
    by_hand = torch.stack([torch.dot(x, gate_ED[e].double()) / (x.norm() * gate_ED[e].double().norm())
                           for x, e in zip(x_TD.double(), experts_T1[:, 0].tolist())]).min().clamp_min(0)
    assert delta == pytest.approx(float(by_hand), abs=1e-6) and 0 <= delta < 1
    floor = capacity_floor(delta, E, D)
    assert floor == pytest.approx(float(1 / (E * cap_mass(delta, D))), rel=1e-12)
    for c_f in (0.0, 0.5, 1.0, 1.25, 2.0):  # the capacity never drops below the floor (nor above T)
        capacity = expert_capacity(x_TD.shape[0], E, c_f, floor)
        assert math.ceil(floor) <= capacity <= x_TD.shape[0]
        assert capacity == min(x_TD.shape[0], max(math.ceil(floor), math.ceil(x_TD.shape[0] * c_f / E)))


# ---- (b) bytes per link, by hand ----------------------------------------------------------------------

# expert -> the ranks holding it, written out by hand (node-major ranks, `Placement`'s rule)
HAND_PLACEMENTS = {
    (4, 2, 2): {0: [0], 1: [1], 2: [2], 3: [3]},  # E = W: one expert per rank
    (8, 2, 2): {0: [0], 1: [0], 2: [1], 3: [1], 4: [2], 5: [2], 6: [3], 7: [3]},  # E/W = 2 per rank
    (4, 2, 4): {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]},  # 2 experts per node of 4 ranks: 2 replicas each
    (2, 4, 2): {0: [0, 1], 1: [4, 5]},  # nodes > experts: nodes 1 and 3 hold none
}


def token_table(placement: Placement, T: int, lam: Fraction, seed: int) -> list[list[int]]:
    """Every rank's T tokens -> experts: lam*T spread evenly over its node's experts, the rest evenly over
    the others (all E evenly on a node without experts), in a shuffled token order."""
    rng = np.random.default_rng(seed)
    E, G = placement.experts, placement.per_node
    table = []
    for src in range(placement.ranks):
        local = [e for e, hosts in HAND_PLACEMENTS[(E, placement.nodes, G)].items() if hosts[0] // G == src // G]
        remote = [e for e in range(E) if e not in local]
        if local:
            per_local, per_remote = lam * T / len(local), (1 - lam) * T / len(remote)
            assert per_local.denominator == 1 and per_remote.denominator == 1
            tokens = [e for e in local for _ in range(int(per_local))] + [e for e in remote for _ in range(int(per_remote))]
        else:
            tokens = [e for e in range(E) for _ in range(T // E)]
        table.append([int(e) for e in rng.permutation(tokens)])
    return table


def count_by_hand(placement: Placement, table: list[list[int]], capacity: int | None, row_bytes: int):
    """Bytes each rank sends / receives per link: each token in order, kept while its (source rank, expert)
    has fewer than `capacity` kept; a token goes to its own rank if that holds the expert, else to replica
    (src mod c); counted when it leaves its rank, as inter-node when the nodes differ."""
    hand = HAND_PLACEMENTS[(placement.experts, placement.nodes, placement.per_node)]
    G, W = placement.per_node, placement.ranks
    sent = {"intra": [0] * W, "inter": [0] * W}
    recv = {"intra": [0] * W, "inter": [0] * W}
    for src, experts in enumerate(table):
        kept = dict.fromkeys(range(placement.experts), 0)
        for e in experts:
            if capacity is not None and kept[e] >= capacity:
                continue
            kept[e] += 1
            dst = src if src in hand[e] else hand[e][src % len(hand[e])]
            if dst != src:
                link = "intra" if dst // G == src // G else "inter"
                sent[link][src] += row_bytes
                recv[link][dst] += row_bytes
    return sent, recv


@pytest.mark.parametrize("shape", list(HAND_PLACEMENTS), ids=lambda s: f"E{s[0]}N{s[1]}G{s[2]}")
@pytest.mark.parametrize("capacity", [None, 5, 9])
@pytest.mark.parametrize("lam", [Fraction(1, 2), Fraction(3, 4), Fraction(1)])
def test_bytes_per_link_against_hand_count(shape: tuple[int, int, int], capacity: int | None, lam: Fraction):
    E, N, G = shape
    placement = Placement(E, N, G)
    assert {e: placement.hosts(e) for e in range(E)} == HAND_PLACEMENTS[shape]
    T, D, b = 48, 3, 2
    table = token_table(placement, T, lam, seed=E * N * G)
    sent, recv = count_by_hand(placement, table, capacity, D * b)
    formula = rank_bytes(placement, sympy.Integer(T), D, b, sympy.Rational(lam.numerator, lam.denominator), capacity)
    for r in range(placement.ranks):
        cls = "hosting" if placement.local_experts(r // G) else "expert-less"
        f = formula[cls]
        assert (sent["intra"][r], sent["inter"][r], recv["intra"][r], recv["inter"][r]) == (
            f.sent_intra, f.sent_inter, f.recv_intra, f.recv_inter), f"rank {r} ({cls})"
    # the simulator's path: expected counts -> [src rank, dst rank] rows -> exact_a2a
    counts_SE = np.array([[row.count(e) for e in range(E)] for row in table], dtype=float)
    np.testing.assert_array_equal(counts_SE, routing_counts(placement, T, float(lam)))
    exact = exact_a2a(rows_matrix(placement, counts_SE, capacity), D, b, G)
    assert exact.sent_intra.tolist() == sent["intra"] and exact.sent_inter.tolist() == sent["inter"]
    assert exact.recv_intra.tolist() == recv["intra"] and exact.recv_inter.tolist() == recv["inter"]


def test_floor_sets_the_capacity_and_bounds_the_bytes():
    """With capacity, each (source rank, expert) sends at most C rows; C = max(ceil(floor), ceil(T c_f / E)),
    so a large measured delta raises C (and the bytes) above what c_f alone allows. D = 3: floor = 1/(E(1 - delta))."""
    placement, T, D, b, lam = Placement(4, 2, 2), 48, 3, 2, Fraction(1, 2)  # 12 rows per (rank, expert)
    table = token_table(placement, T, lam, seed=0)
    for delta, c_f, C in ((0.0, 0.1, 2), (0.9, 0.1, 3), (0.99, 0.1, 25), (0.9, 0.5, 6)):
        assert capacity_rows(T, 4, c_f, delta, D) == C == max(math.ceil(1 / (4 * (1 - delta)) - 1e-9), math.ceil(T * c_f / 4))
        sent, _ = count_by_hand(placement, table, C, D * b)
        f = rank_bytes(placement, sympy.Integer(T), D, b, sympy.Rational(1, 2), C)["hosting"]
        assert sent["inter"] == [f.sent_inter] * 4 == [2 * min(12, C) * D * b] * 4  # two remote experts
        assert sent["intra"] == [f.sent_intra] * 4 == [min(12, C) * D * b] * 4  # the other expert of the node
    assert capacity_rows(T, 4, None, 0.9, D) is None  # dropless: no capacity, no floor


@settings(deadline=None)
@given(st.sampled_from([(4, 2, 2), (8, 2, 2), (4, 2, 4), (2, 4, 2), (16, 8, 8), (16, 32, 8), (16, 2, 4), (8, 8, 2)]),
       st.fractions(0, 1, max_denominator=16), st.one_of(st.none(), st.integers(1, 40)))
def test_formulas_match_the_simulator_rows(shape, lam, capacity):
    """Any placement, locality ratio and capacity: the formulas equal exact_a2a of `rows_matrix`."""
    placement, T, D, b = Placement(*shape), 64, 5, 2
    if placement.node_experts == placement.experts:
        lam = Fraction(1)
    formula = rank_bytes(placement, sympy.Integer(T), D, b, sympy.Rational(lam.numerator, lam.denominator), capacity)
    exact = exact_a2a(rows_matrix(placement, routing_counts(placement, T, float(lam)), capacity), D, b,
                      placement.per_node)
    for r in range(placement.ranks):
        f = formula["hosting" if placement.local_experts(r // placement.per_node) else "expert-less"]
        got = (exact.sent_intra[r], exact.sent_inter[r], exact.recv_intra[r], exact.recv_inter[r])
        assert got == pytest.approx([float(v) for v in (f.sent_intra, f.sent_inter, f.recv_intra, f.recv_inter)],
                                    rel=1e-12, abs=1e-9)


def test_dropless_formulas_symbolic():
    T, D, b, lam = sympy.symbols("T D b lambda", positive=True)
    for shape in HAND_PLACEMENTS:
        placement = Placement(*shape)
        k, h = placement.node_experts, placement.rank_experts
        f = rank_bytes(placement, T, D, b, lam)["hosting"]
        assert sympy.simplify(f.sent_inter - T * D * b * (1 - lam)) == 0
        assert sympy.simplify(f.sent_intra - T * D * b * lam * (1 - sympy.Rational(h, k))) == 0
    E, N = 2, 4
    f = rank_bytes(Placement(E, N, 2), T, D, b, lam)
    assert sympy.simplify(f["hosting"].recv_inter - T * D * b * ((1 - lam) + sympy.Rational(N - E, E))) == 0
    assert f["expert-less"].sent_inter == T * D * b and f["expert-less"].recv_inter == 0


def test_router_ratios():
    placement = Placement(16, 8, 8)  # 2 experts per node
    assert uniform_ratio(placement) == router_ratio("hash", placement) == router_ratio("switch", placement) == 1 / 8
    assert router_ratio("locmoe", placement) == 1 - MEASURED_INTER_FACTOR * (1 - 1 / 8)
    assert router_ratio("locmoe", placement, inter_factor=1.0) == 1 / 8
    assert router_ratio("hash", Placement(16, 32, 8)) == 1 / 16  # an expert's node holds one of 16
    recorded = json.loads((ROOT / "benchmarks" / "results" / "locality.json").read_text())
    assert round(recorded["goals"]["inter_bytes_ratio"], 3) == MEASURED_INTER_FACTOR
    with pytest.raises(ValueError, match=r"router='top2' is invalid: use one of \['hash', 'switch', 'locmoe'\]"):
        router_ratio("top2", placement)
    with pytest.raises(ValueError, match=r"inter_factor=1.5 must be in \[0, 1\]"):
        router_ratio("locmoe", placement, inter_factor=1.5)


def test_placement_errors():
    with pytest.raises(ValueError, match="experts=16 must be a multiple of nodes=3"):
        Placement(16, 3, 8)
    with pytest.raises(ValueError, match="nodes=24 > experts=16 must be a multiple of experts"):
        Placement(16, 24, 8)
    with pytest.raises(ValueError, match="the 3 experts of a node must divide or be a multiple of per_node=2"):
        Placement(6, 2, 2)
    with pytest.raises(ValueError, match=r"lam=0.5 must be in \[0, 1\] \(1 when one node holds all 4 experts\)"):
        routing_counts(Placement(4, 1, 2), 8, 0.5)
    with pytest.raises(ValueError, match=r"lam=1.5 must be in \[0, 1\]"):
        routing_counts(Placement(4, 2, 2), 8, 1.5)


# ---- (c) the scenario ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def simulated():
    return simulate.simulate(SCENARIO)


def test_three_distinct_systems(simulated):
    read = cases(SCENARIO)
    v = read.hardware.values()
    by = {(p.case, p.system): p for p in simulated.predictions}
    assert [c.nodes for c in read.cases] == [8, 16, 32] and {c.E for c in read.cases} == {16}
    for case in read.cases:
        hash_, switch, loc = (by[(case.label, s)] for s in ("hash-router", "switch-router", "locmoe"))
        assert hash_.modelled and switch.modelled and loc.modelled and loc.form == "locality"
        assert (hash_.plan["router"], switch.plan["router"], loc.plan["router"]) == ("hash", "switch", "locmoe")
        # hash: uniform, no gate; switch: the gate GEMM and the measured skew (systems.MEASURED_SWITCH_MAX_MEAN)
        assert hash_.step_s < switch.step_s and hash_.breakdown["imbalance"] < switch.breakdown["imbalance"]
        placement = Placement(case.E, case.nodes, case.per_node)
        per_step = 2 * 2 * case.layers  # (dispatch + combine) x (forward + backward)
        for p, router in ((switch, "switch"), (loc, "locmoe")):
            lam = router_ratio(router, placement)
            assert p.breakdown["locality_ratio"] == lam
            f = rank_bytes(placement, case.tokens, case.D, v["b"], lam)
            if not placement.nodes_gt_experts:  # every rank alike: the formula of one rank
                # the learned routers' measured skew over the experts moves rows between experts: within 2 %
                assert p.breakdown["inter_node_bytes"] == pytest.approx(per_step * f["hosting"].sent_inter, rel=2e-2)
                assert p.breakdown["intra_node_bytes"] == pytest.approx(per_step * f["hosting"].sent_intra, rel=2e-2)
            else:  # E nodes of hosting ranks, N - E of expert-less ones
                h, x = f["hosting"], f["expert-less"]
                mean = per_step / 2 * (case.E * (h.sent_inter + h.recv_inter) + (case.nodes - case.E) * x.sent_inter)
                assert p.breakdown["inter_node_bytes"] == pytest.approx(mean / case.nodes, rel=2e-2)
                assert p.breakdown["inter_node_bytes_expertless"] == per_step / 2 * x.sent_inter
        gain = loc.breakdown["inter_node_bytes"] / switch.breakdown["inter_node_bytes"]
        if not placement.nodes_gt_experts:
            assert gain == pytest.approx(MEASURED_INTER_FACTOR, rel=2e-2)
        else:  # the expert-less nodes gain nothing: their ranks' bytes are the same under every router
            assert loc.breakdown["inter_node_bytes_expertless"] == switch.breakdown["inter_node_bytes_expertless"]
            # per rank, sent + received in T*D*b: an expert's node 2(1 - lam) + (N - E)/E, an expert-less one 1;
            # so the cluster's mean is [2E(1 - lam) + 2(N - E)] / N, with 1 - lam = f (1 - 1/E) under LocMoE
            k, extra = 1 / case.E, case.nodes - case.E
            expected = (case.E * MEASURED_INTER_FACTOR * (1 - k) + extra) / (case.E * (1 - k) + extra)
            assert gain == pytest.approx(expected, rel=2e-2) and gain > MEASURED_INTER_FACTOR * 0.98
        assert loc.step_s < switch.step_s and loc.breakdown["exposed_a2a"] < switch.breakdown["exposed_a2a"]
        # both learned routers carry the measured skew: their busiest device computes more than the hash router's
        assert min(loc.breakdown["expert_compute"], switch.breakdown["expert_compute"]) > hash_.breakdown["expert_compute"]


def test_table_names_the_three_systems_and_nodes_gt_experts(simulated):
    text = simulated.table()
    for size in (64, 128, 256):
        for system in ("hash-router", "switch-router", "locmoe"):
            assert f"pangu-sigma-like W={size} {system} (" in text
    assert "pangu-sigma-like W=256: 32 nodes > 16 experts: 16 nodes hold no local expert" in text
    assert "not modelled yet" not in text
    assert "locality set-up: each of the E experts on one home node" in text


def test_capacity_from_the_scenario_system():
    """A system's capacity_factor and delta: C rows per (source rank, expert), the floor from delta (D = 5120)."""
    scenario = json.loads(SCENARIO.read_text())
    scenario["cluster_sizes_devices"] = [64]
    # 8192 tokens per device (the set-up's own batch note gives 256, where no capacity clips)
    scenario["batch"] = {"global_batch_sequences": 8 * 64, "sequence_length": 1024}
    uncapped = simulate.simulate(scenario)
    delta = 3.8 / math.sqrt(5120)  # floor = 1/(16 * mass) ~ 430 rows > T c_f / E = 8192 * 0.5 / 16 = 256
    scenario["systems"] = [{**s, "capacity_factor": 0.5, "delta": delta} for s in scenario["systems"]]
    capped = {p.system: p for p in simulate.simulate(scenario).predictions}
    case = cases(scenario).cases[0]
    assert case.tokens == 8192
    C = expert_capacity(case.tokens, 16, 0.5, capacity_floor(delta, 16, case.D))
    assert C == math.ceil(capacity_floor(delta, 16, case.D)) > case.tokens * 0.5 / 16  # the floor binds
    placement, b = Placement(16, 8, 8), 2
    for system, router in (("switch-router", "switch"), ("locmoe", "locmoe")):
        p = capped[system]
        assert p.plan["cap"] == C
        f = rank_bytes(placement, case.tokens, case.D, b, router_ratio(router, placement), C)["hosting"]
        assert p.breakdown["inter_node_bytes"] == pytest.approx(4 * case.layers * f.sent_inter, rel=2e-2)  # skew
        dropless = next(q for q in uncapped.predictions if q.system == system and q.case == case.label)
        clipped = {key: p.breakdown[key] < dropless.breakdown[key] for key in ("inter_node_bytes", "intra_node_bytes")}
        # the switch sends T/16 = 512 rows to every expert: clipped everywhere; LocMoE sends (1 - lam) T / 14 ~ 167
        # to each remote expert (kept) and lam T / 2 ~ 2924 to each local one (clipped)
        assert clipped == ({"inter_node_bytes": True, "intra_node_bytes": True} if router == "switch" else
                           {"inter_node_bytes": False, "intra_node_bytes": True})


def test_locality_ratio_given_by_the_scenario():
    """A system's `locality_ratio` replaces its router's (e.g. a switch router measured to keep 40 % on-node)."""
    scenario = json.loads(SCENARIO.read_text())
    scenario["cluster_sizes_devices"] = [64]
    scenario["systems"] = [{**s, "locality_ratio": 0.4} if s["id"] == "switch-router" else s
                           for s in scenario["systems"]]
    result = simulate.simulate(scenario)
    switch = next(p for p in result.predictions if p.system == "switch-router")
    case = cases(SCENARIO).cases[0]
    f = rank_bytes(Placement(16, 8, 8), case.tokens, case.D, 2, 0.4)["hosting"]
    assert switch.breakdown["locality_ratio"] == 0.4
    assert switch.breakdown["inter_node_bytes"] == pytest.approx(4 * case.layers * f.sent_inter, rel=2e-2)
    assert "switch-router (switch): locality ratio 0.4 (the set-up's)" in result.table()
