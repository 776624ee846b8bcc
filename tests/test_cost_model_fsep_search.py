"""Cost model: FSEP priced next to EP in the plan search, against figures priced by hand from the runtime
planner's table (tests/cost_by_hand.py: `fsep_by_hand`)."""

from __future__ import annotations

import numpy as np
import pytest

from cost_model import ep as cm
from cost_model import fsep as fsep_cm
from cost_model import schedule
from cost_model import symbols as S
from cost_model.presets import A100
from cost_model.search import EPSpace, FSEPSpace, PlanSpace, Pricing, search
from moepass import Plan
from tests.cost_by_hand import MIXTRAL_8, fsep_by_hand, spec


def _uniform(W: int, E: int, T: int, K: int) -> np.ndarray:
    assert T * K % E == 0
    return np.full((W, E), T * K // E, dtype=np.int64)


def _ep(result, ep_size: int, n: int):
    return next(c for c in result.ranked if c.form == "ep" and c.ep_size == ep_size and c.a2a_chunks == n
                and c.capacity_factor is None and c.packing == 1)


def test_fsep_is_priced_next_to_ep_and_loses_by_its_restore_under_balanced_routing():
    L, W, T, K, D, F, m = 8, 8, 2 * 4096, 2, 4096, 14336, 3
    v = A100.values()
    # no dense parameters: neither form has a dense all-reduce, so FSEP with C=1 is EP plus its restores
    result = search(MIXTRAL_8, (1, 8), (2, 4096), PlanSpace(ep=EPSpace(packings=(1,))), profile=A100,
                    pricing=Pricing(dense_params=0))
    fsep = [c for c in result.ranked if c.form == "fsep"]
    assert {(c.slots, c.a2a_chunks) for c in fsep} == {(C, n) for C in (1, 2, 3) for n in schedule.DEFAULT_CHUNKS}
    assert all(c.ep_size == W and c.label == f"fsep C={c.slots} n={c.a2a_chunks}" for c in fsep)
    assert result.best.form == "ep"
    S_e = m * D * F
    for c in fsep:
        step, memory = fsep_by_hand(_uniform(W, 8, T, K), A100, C=c.slots, G=8, D=D, F=F, m=m, layers=L,
                                    n=c.a2a_chunks)
        assert float(c.formula.step) == pytest.approx(step, rel=1e-9), c.label
        assert float(c.formula.memory) == pytest.approx(memory, rel=1e-9), c.label
        if c.slots == 1:  # one expert per device: EP over the 8 ranks, plus the restores and the slices back
            restore, t_g = (v["alpha"] + S_e / W * b * (W - 1) / v["B_intra"] for b in (v["b"], v["b_g"]))
            bwd = 2 * T * K / W * 2 * m * D * F / (v["R"] * v["eta"])  # the earlier layer's expert backward
            slices = t_g + (L - 1) * max(0.0, t_g - bwd)  # the first block waits, the others are deferred
            # and less EP's Lancet overlap (FSEP's FFN reads restored weights: no deferred weight GEMMs): per layer
            # the last dispatch-backward chunk, in flight during the weight GEMMs (their forward's FLOPs)
            intra, _ = cm.a2a_bytes(T, K, D, W, 8, v["b"])
            lancet = min(v["alpha"] + intra / v["B_intra"] / c.a2a_chunks, bwd / 2 / c.a2a_chunks)
            assert float(c.formula.step) == pytest.approx(
                float(_ep(result, W, c.a2a_chunks).formula.step) + L * lancet + 2 * L * restore + slices, rel=1e-9)
    best_fsep = min(fsep, key=lambda c: c.step)
    assert best_fsep.slots == 1 and best_fsep.step > result.best.step


def test_fsep_wins_under_strong_skew():
    L, W, T, K, D, F, m, E = 8, 8, 2 * 4096, 2, 4096, 14336, 3, 8
    v = A100.values()
    # no dense parameters (as in the FSEP test above): EP and FSEP priced by hand without a dense all-reduce
    result = search(MIXTRAL_8, (1, 8), (2, 4096), PlanSpace(ep=EPSpace(packings=(1,))), profile=A100,
                    pricing=Pricing(imbalance=2.5, dense_params=0))
    # the skew realised: every rank routes with one Zipf popularity whose EP max/mean is 2.5
    counts = fsep_cm.integer_rows(cm.zipf_counts(T, K, E, W, cm.zipf_for_imbalance(2.5, T, K, E, W)))
    assert cm.imbalance(cm.rank_rows(counts, W)) == pytest.approx(2.5, rel=1e-3)
    fsep = {(c.slots, c.a2a_chunks): c for c in result.ranked if c.form == "fsep"}
    assert set(fsep) == {(C, n) for C in (1, 2, 3) for n in schedule.DEFAULT_CHUNKS}
    for (C, n), c in fsep.items():
        step, memory = fsep_by_hand(counts, A100, C=C, G=8, D=D, F=F, m=m, layers=L, n=n)
        assert float(c.formula.step) == pytest.approx(step, rel=1e-9), c.label
        assert float(c.formula.memory) == pytest.approx(memory, rel=1e-9), c.label
        assert c.routing[0].ep_rho == pytest.approx(2.5, rel=1e-3)
    assert fsep[3, 1].routing[0].rho < 1.1 and fsep[3, 1].routing[0].table == "proportional"
    # EP pays the busiest rank's 2.5x rows (n=1: dispatch and combine forward, combine backward, not hidden; the
    # dispatch backward in flight during the weight GEMMs, Lancet, which take longer)
    rows = 2.5 * T * K
    t_a = v["alpha"] + rows * (W - 1) / W * D * v["b"] / v["B_intra"]
    wgrad = rows * 2 * m * D * F / (v["R"] * v["eta"])
    assert wgrad > t_a
    ep_step = L * (3 * wgrad + 3 * t_a + v["alpha"])
    assert float(_ep(result, W, 1).formula.step) == pytest.approx(ep_step, rel=1e-9)
    best = result.best
    assert best.form == "fsep" and best.slots in (2, 3)
    assert best.step < min(c.step for c in result.eligible() if c.form == "ep")  # dropless EP
    assert best.step < 0.6 * ep_step
    assert "planner max/mean" in result.table() and f"best: {best.label}" in result.table()
    assert float(result.expression_substituted.subs(S.T, T)) == pytest.approx(float(best.formula.step), rel=1e-3)
    # the winner as a Plan: directly, and as form="auto" resolves it (Plan.as_form: batch and hardware kept)
    kwargs = result.to_plan_kwargs()
    assert kwargs == {"form": "fsep", "ep_size": W, "slots_per_device": best.slots, "capacity_factor": None,
                      "a2a_chunks": best.a2a_chunks, "packing": 1}
    plan = Plan(**kwargs)
    assert (plan.form, plan.slots_per_device, plan.ep_size) == ("fsep", best.slots, W)
    auto = Plan(form="auto", batch=(2, 4096), hardware="a100").as_form(**kwargs)
    assert auto.form == "fsep" and auto.packing == 1 and auto.planner == "auto" and auto.hardware == "a100"


def test_fsep_candidates_need_a_slot_for_every_expert():
    def slots(*args, forms=("single", "ep", "fsep", "hp"), tried=None) -> set[int]:
        space = PlanSpace(forms=forms, ep=EPSpace(a2a_chunks=(1,)), fsep=FSEPSpace(slots=tried, a2a_chunks=(1,)))
        return {c.slots for c in search(*args, space, profile=A100).ranked if c.form == "fsep"}

    E16 = [spec(16, 2, 512, 1024)]
    assert slots(E16, (1, 4), (4, 1024), tried=tuple(range(1, 8))) == {4, 5, 6, 7}  # W*C >= E = 16
    assert slots(E16, (1, 4), (4, 1024)) == {4, 5, 6}  # ceil(E/W) .. ceil(E/W) + 2
    assert slots(E16, (2, 4), (4, 1024)) == {2, 3, 4}
    assert slots(E16 + [spec(32, 2, 512, 1024)], (2, 4), (4, 1024)) == {4, 5, 6}  # one C for every block
    assert slots(E16, (1, 4), (4, 1024), forms=("single", "ep", "hp")) == set()  # FSEP not in the space
    assert slots(E16, (1, 4), (4, 1024), tried=(4,)) == {4}
    assert slots(E16, (1, 1), (4, 1024)) == set()  # one rank: nothing to shard
    from cost_model.search import BlockShape

    capped = search([BlockShape(E=8, K=2, D=512, F=1024, m=3, cf=1.25)], (1, 4), (4, 1024), profile=A100)
    assert not any(c.form == "fsep" for c in capped.ranked)
    assert "dropless blocks only" in capped.not_modelled["fsep"] and "fsep: FSEP is priced" in capped.table()
    with pytest.raises(ValueError, match="imbalance=0.5"):
        search(E16, (1, 4), (4, 1024), profile=A100, pricing=Pricing(imbalance=0.5))


def test_form_auto_picks_fsep_when_only_its_shards_fit():
    """Mixtral-8x7B-like, 24 layers on 2 x 8 A100 at 1024 tokens per rank: EP over 8 ranks keeps E/8 whole
    experts per rank (with optimizer state), which does not fit in 80 GB with the dense layers' replicated state;
    FSEP shards them over all 16. (At 32 layers nothing fits as moepass builds it, FSEP included: 88 GB per rank,
    the dense weights' 34 GB of Adam state counted.)"""
    from types import SimpleNamespace

    from moepass.api import resolve_auto
    from moepass.runtime.topology import Topology

    report = SimpleNamespace(blocks=[spec(8, 2, 4096, 14336)] * 24)
    auto = Plan(form="auto", batch=(1, 1024), topology=Topology(2, 8), hardware="a100")
    plan, result = resolve_auto(auto, report)
    assert not any(c.feasible for c in result.ranked if c.form in ("ep", "single"))
    assert (plan.form, plan.ep_size, plan.slots_per_device, plan.packing) == ("fsep", 16, result.best.slots, 1)
    # a slots_per_device given with form="auto" is the only C the search prices
    plan2, result2 = resolve_auto(auto.replace(slots_per_device=2), report)
    assert {c.slots for c in result2.ranked if c.form == "fsep"} == {2} and plan2.slots_per_device == 2
    # when EP wins, the FSEP-only fields are reset (Plan rejects them on form="ep")
    small = SimpleNamespace(blocks=MIXTRAL_8)  # "single" needs 194 GB
    plan3, _ = resolve_auto(auto.replace(topology=Topology(1, 8), batch=(2, 4096), slots_per_device=1), small)
    assert plan3.form == "ep" and plan3.slots_per_device is None


def test_form_auto_prices_the_gradient_sync_the_plan_runs_and_the_models_dense_parameters():
    """form="auto" with Plan(grad_sync="scheduler") ranks the plans under Lina's priority rule with the plan's
    micro-op size, and with the model's own dense parameters (embeddings included) when given the model."""
    from types import SimpleNamespace

    from torch import nn

    from cost_model.search import BlockShape, dense_params_of
    from moepass.api import resolve_auto
    from moepass.runtime.topology import Topology

    blocks = [spec(8, 2, 1024, 4096)] * 4
    report = SimpleNamespace(blocks=blocks)
    model = nn.Embedding(50000, 1024)  # stands for the dense part: 51.2 M parameters, no experts
    auto = Plan(form="auto", batch=(4, 1024), topology=Topology(1, 8), hardware="h100")
    shapes = [BlockShape.of(b, 4 * 1024) for b in blocks]
    assert dense_params_of(model, shapes) == 0  # fewer parameters than the blocks' experts: clamped at 0
    model = nn.Embedding(500000, 1024)
    dense = dense_params_of(model, shapes)
    assert dense == 500000 * 1024 - 4 * 8 * 3 * 1024 * 4096
    for grad_sync, schedule_name in (("none", "fair"), ("scheduler", "priority")):
        plan = auto.replace(grad_sync=grad_sync, micro_op_bytes=1 << 20)
        _, result = resolve_auto(plan, report, model)
        expected = search(blocks, Topology(1, 8), (4, 1024), profile="h100",
                          pricing=Pricing(dense_params=dense, schedule=schedule_name, micro_op_bytes=1 << 20))
        assert [(c.label, float(c.step)) for c in result.ranked] == [(c.label, float(c.step)) for c in expected.ranked]
    fair = resolve_auto(auto, report, model)[1]
    priority = resolve_auto(auto.replace(grad_sync="scheduler"), report, model)[1]
    bare = resolve_auto(auto, report)[1]  # no model: attention-only dense gradients
    fair_ep, priority_ep, bare_ep = (min(float(c.step) for c in r.ranked if c.form == "ep") for r in (fair, priority, bare))
    assert priority_ep < fair_ep and bare_ep < fair_ep


