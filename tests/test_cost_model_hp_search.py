"""Cost model: HP priced next to EP in the plan search, against figures priced by hand from the converted block's
sizes (tests/cost_by_hand.py: `hp_by_hand`)."""

from __future__ import annotations

import pytest
import sympy

from cost_model import ep as cm
from cost_model import hp as hp_cm
from cost_model import symbols as S
from cost_model.presets import A100, H100
from cost_model.search import EPSpace, HPSpace, PlanSpace, Pricing, search
from moepass import Plan
from tests.cost_by_hand import fine_grained, hp_by_hand, spec


def test_hp_layer_bytes_do_not_depend_on_k():
    x = {name: info.symbol for name, info in S.TABLE.items()} | {"G": 8}
    terms = hp_cm.hp_layer(x, ep=8, dp=1, cross_node=False)
    sent = sympy.sympify(cm.A2A_PER_LAYER * terms.a2a_bytes)
    assert S.K not in sent.free_symbols and S.K in sympy.sympify(terms.compute).free_symbols
    assert sympy.simplify(sent - 4 * S.T * S.H * S.h * 7 * S.b / 8) == 0
    assert sympy.simplify(hp_cm.step_bytes(S.T, S.H, S.h, 8, S.b) - sent) == 0
    ep_sent = sympy.sympify(cm.A2A_PER_LAYER * cm.ep_layer({**x, "c_f": 1}, ep=8, n=1, dp=1, dropless=True,
                                                           cross_node_dp=False).a2a_bytes)
    assert sympy.diff(ep_sent, S.K) != 0  # EP's grows with K


def test_hp_bytes_per_rank_flat_in_k_in_the_search():
    T, D, P, L = 4096, 4096, 8, 2
    b = H100.values()["b"]
    Q = 8 * (D // 8)  # H = P = 8 heads of h = D/8
    by_hand = L * 4 * T * Q * (P - 1) / P * b  # dispatch + combine, forward and backward
    sent = {}
    for K in (1, 2, 4, 8):
        result = search([fine_grained(K)] * L, (1, 8), (1, T), PlanSpace(forms=("single", "ep", "hp"),
                        ep=EPSpace(a2a_chunks=(1,))), profile=H100)
        hp = next(c for c in result.ranked if c.form == "hp" and c.ep_size == P)
        assert (hp.latent[0].heads, hp.latent[0].head_dim, hp.latent[0].top_k) == (8, D // 8, K)
        sent[K] = cm.A2A_PER_LAYER * float(hp.formula.a2a_bytes)
        ep = next(c for c in result.ranked if c.form == "ep" and c.ep_size == 4 and c.capacity_factor is None
                  and c.packing == 1)  # E = 4K experts: EP over 4 ranks at every K
        ep_by_hand = L * 4 * K * T * D * 3 / 4 * b  # K rows of D per token
        assert cm.A2A_PER_LAYER * float(ep.formula.a2a_bytes) == pytest.approx(ep_by_hand, rel=1e-12)
    assert len(set(sent.values())) == 1 and sent[1] == pytest.approx(by_hand, rel=1e-12), sent


BANDWIDTH_BOUND = (8, 1)  # 8 nodes x 1 H100: every peer of an all-to-all over the one NDR NIC (44.5 GB/s)
FREE_NET = H100.with_figures("test: communication free", intra_bw=1e30, inter_bw=1e30, alpha=0.0)


def test_hp_beats_ep_at_k8_when_bandwidth_bound_and_not_when_communication_is_free():
    T, D, K, n, L, W = 4096, 4096, 8, 3, 2, 8
    E, F = 4 * K, 2 * 14336 // K
    blocks = [fine_grained(K)] * L
    result = search(blocks, BANDWIDTH_BOUND, (1, T), profile=H100, pricing=Pricing(dense_params=0))  # no dense all-reduce
    v = H100.values()
    hp = {c.ep_size: c for c in result.ranked if c.form == "hp"}
    assert set(hp) == {2, 4, 8}
    for P, c in hp.items():
        want = hp_by_hand(H100, T=T, D=D, E=E, K=K, F=F, n=n, W=W, G=1, P=P, layers=L)
        assert float(c.formula.step) == pytest.approx(want["step"], rel=1e-9), c.label
        assert float(c.formula.compute) == pytest.approx(want["compute"], rel=1e-9), c.label
        assert float(c.formula.memory) == pytest.approx(want["memory"], rel=1e-9), c.label
        assert c.latent[0].ffn_dim == want["ffn"] and c.math_changing and c.feasible
    # a lower bound for every exact plan, whatever its chunking: a pass takes at least its expert compute and
    # at least the time the network needs for dispatch + combine; the expert all-reduce hides behind 2x compute
    C = 2 * T * K * D * F * n / (v["R"] * v["eta"])

    def ring(nbytes: float, group: int) -> float:
        return 0.0 if group == 1 else v["alpha"] + 2 * (group - 1) / group * nbytes / v["B_inter"]

    expert_bytes = n * D * F * v["b_g"]
    bound = {"single": L * (3 * C + max(0.0, ring(E * expert_bytes, W) - 2 * C))}
    for ep in (2, 4, 8):
        X = K * T * D * v["b"] * (ep - 1) / ep / v["B_inter"]
        bound[f"ep={ep}"] = L * (max(C, 2 * X) + max(2 * C, 2 * X) + max(0.0, ring(E // ep * expert_bytes, W // ep)
                                                                         - 2 * C))
    # the per-layer formulas' claim (`Candidate.formula`); the step timeline, which also prices the dense compute
    # and runs HP's exchange unoverlapped, ranks EP over 8 first here (test_search_ranks_by_the_timeline)
    best_hp = hp[8]
    assert float(best_hp.formula.step) < min(bound.values()), (float(best_hp.formula.step), bound)
    exact = [c for c in result.eligible() if c.form in ("single", "ep")]
    assert min(float(c.formula.step) for c in exact) >= min(bound.values()) * (1 - 1e-12)
    assert result.best.form != "hp" and result.best is not best_hp  # math-changing: never picked by default
    assert min((c for c in result.ranked if c.feasible), key=lambda c: float(c.formula.step)) is best_hp

    # the same model with communication free: HP's projections and routers are work EP does not do (its
    # router is not priced), so exact plans tie or win up to the rounding of the active parameters (the
    # conversion rounds m down, to a multiple of 4 when that keeps 98% of them: HP may be that much faster)
    free = search(blocks, BANDWIDTH_BOUND, (1, T), profile=FREE_NET)
    free_hp = next(c for c in free.ranked if c.form == "hp" and c.ep_size == 8)
    want = hp_by_hand(FREE_NET, T=T, D=D, E=E, K=K, F=F, n=n, W=W, G=1, P=8, layers=L)
    assert float(free_hp.formula.step) == pytest.approx(want["step"], rel=1e-9) and want["step"] == pytest.approx(want["compute"])
    assert float(free.best.formula.step) == pytest.approx(L * 3 * C, rel=1e-9)
    kept = free_hp.latent[0].active_after / free_hp.latent[0].active_before  # 1 - what the rounding dropped
    assert float(free.best.formula.step) * kept * (1 - 1e-9) <= float(free_hp.formula.step) and float(free_hp.formula.step) / float(free.best.formula.step) - 1 < 1e-3


def test_hp_winner_builds_a_valid_plan_and_its_formula():
    from moepass.rewrite.latent import latent_shape

    T, L = 4096, 2
    blocks = [fine_grained(8)] * L
    result = search(blocks, BANDWIDTH_BOUND, (1, T), PlanSpace(allow_math_changes=True), profile=H100)
    best = result.best
    assert best.form == "hp" and best.ep_size == 8 and best.math_changing
    kwargs = result.to_plan_kwargs()
    assert kwargs == {"form": "hp", "ep_size": 8, "heads": 8, "head_dim": 512, "capacity_factor": None, "packing": 1}
    plan = Plan(**kwargs)
    assert plan.form == "hp" and plan.changes_math and (plan.heads, plan.head_dim) == (8, 512)
    assert latent_shape(blocks[0], plan, 8) == best.latent[0]  # the conversion the pipeline will make
    auto = Plan(form="auto", batch=(1, T), hardware="h100").as_form(**kwargs)
    assert auto.form == "hp" and auto.heads == 8
    assert float(result.expression_substituted.subs(S.T, T)) == pytest.approx(float(best.formula.step), rel=1e-3)
    assert {S.H, S.h, S.K, S.T} <= result.expression.free_symbols
    assert f"best: {best.label}" in result.table()


def test_hp_skips_what_it_cannot_convert():
    from cost_model.search import BlockShape

    three = search([spec(8, 2, 512, 1024)], (1, 4), (4, 1024), PlanSpace(hp=HPSpace(heads=3)), profile=A100)
    assert not any(c.form == "hp" for c in three.ranked)
    assert "P=2: Plan.heads=3 is invalid" in three.not_modelled["hp"] and "hp: not priced: " in three.table()
    some = search([spec(8, 2, 512, 1024)], (1, 4), (4, 1024), PlanSpace(hp=HPSpace(heads=2)), profile=A100)  # P=4 ∤ 2
    assert [c.ep_size for c in some.ranked if c.form == "hp"] == [2] and "P=4" in some.not_modelled["hp"]
    capped = search([BlockShape(E=8, K=2, D=512, F=1024, m=3, cf=1.25)], (1, 4), (4, 1024), profile=A100)
    assert not any(c.form == "hp" for c in capped.ranked) and "capacity" in capped.not_modelled["hp"]
    assert not any(c.form == "hp" for c in search([spec(8, 2, 512, 1024)], (1, 4), (4, 1024),
                                                  PlanSpace(forms=("single", "ep")), profile=A100).ranked)
    only = search([spec(8, 2, 512, 1024)], (1, 4), (4, 1024), PlanSpace(ep=EPSpace(sizes=(4,)),
                                                                         hp=HPSpace(sizes=(4,))), profile=A100)
    assert [c.ep_size for c in only.ranked if c.form == "hp"] == [4]


@pytest.mark.parametrize("heads", [None, 8])
def test_form_auto_never_picks_hp(heads):
    """Where HP is the fastest plan priced, form="auto" still picks an exact one: HP changes the model and is
    applied only when the plan names it (docs/DESIGN.md). Plan.heads given with auto shapes the HP rows, then is reset."""
    from types import SimpleNamespace

    from moepass.api import resolve_auto
    from moepass.runtime.topology import Topology

    report = SimpleNamespace(blocks=[fine_grained(8)] * 2)
    auto = Plan(form="auto", batch=(1, 4096), topology=Topology(*BANDWIDTH_BOUND), hardware="h100", heads=heads)
    plan, result = resolve_auto(auto, report)
    fastest = min((c for c in result.ranked if c.feasible), key=lambda c: c.step)
    assert fastest.form == "hp" and fastest.latent[0].heads == 8
    assert plan.form in ("single", "ep", "fsep") and not plan.changes_math
    assert (plan.heads, plan.head_dim) == (None, None)
    assert not result.allow_math_changes and result.best is not fastest and not result.best.math_changing

