"""The cost model prices blocks with zero-compute experts by the assignments that reach FFN experts (issue 17).

A LongCat-Flash-style block routes among R = E + Z experts: E FFN experts and Z zero-compute ones (identity
or zero). moepass's EP form sends and computes only the FFN assignments (tests/test_detect_zoo.py:
`test_identity_rows_never_cross_the_all_to_all`), a share phi = `BlockShape.ffn_fraction` of the T*K (E/R
under uniform routing). Checked here:

- EP's all-to-all bytes, expert compute and activation memory against closed formulas at T*K*phi rows
  (E = 8 FFN + 4 zero-compute experts: 8/12 of the plain block's), a whole step by hand, and the same
  formulas as sympy expressions in phi;
- FSEP priced by hand (`fsep_by_hand`) on the planner's counts of T*K*phi rows per rank, and never run:
  its rewrite refuses zero-compute experts, as capacity's does, so `best` / `form="auto"` skip them;
- `BlockShape.of` on specs detected from the zoo's zero-compute blocks, and `form="auto"` on one;
- search and simulate agree: the same bytes and expert compute for the same FFN rows, and Lina's chunks
  and packing picked by the search are the timeline's best (as tests/test_cost_model_lina.py checks for
  plain blocks), where pricing every assignment (phi = 1) picks a slower plan;
- the exact byte formula (`cost_model.ep.exact_a2a`) on the FFN counts equals the runtime's counters on
  the zoo's identity-expert block under EP (2 gloo ranks).

Shape legend: T tokens per rank, K top-k, D width, F expert width, E FFN experts, Z zero-compute experts,
R = E + Z router choices, W ranks, L layers.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import sympy
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402
from cost_by_hand import fsep_by_hand  # noqa: E402
from zoo_blocks import IdentityExperts, Relu2Experts, ZeroExpertsFirst, softmax_topk  # noqa: E402

import moepass  # noqa: E402
from cost_model import ep as cm  # noqa: E402
from cost_model import fsep as fsep_cm  # noqa: E402
from cost_model import schedule, simulate  # noqa: E402
from cost_model import symbols as S  # noqa: E402
from cost_model.presets import A100, H100, MICRO_OP_BYTES  # noqa: E402
from cost_model.scenarios import Case  # noqa: E402
from cost_model.search import (  # noqa: E402
    ZERO_COMPUTE_REFUSED,
    BlockShape,
    EPSpace,
    FSEPSpace,
    PlanSpace,
    Pricing,
    search,
    skewed_counts,
)
from moepass.spec import MoESpec  # noqa: E402

L, W, K, D, F, m, E, Z = 4, 8, 2, 4096, 14336, 3, 8, 4
T = 3 * 4096  # T*K*E/R = 16384 FFN rows per rank: 2048 per expert under uniform routing
BATCH = (3, 4096)
PHI = E / (E + Z)
PLAIN = BlockShape(E=E, K=K, D=D, F=F, m=m, cf=None)
ZERO_COMPUTE = dataclasses.replace(PLAIN, ffn_fraction=PHI)
TOLERANCE = 0.025  # tests/test_cost_model_lina.py's: the search's pick within 2.5 % of the timeline's best


def _by_label(result) -> dict:
    return {c.label: c for c in result.ranked}


# ---- EP: bytes, compute and memory of the FFN rows ---------------------------------------------------------


def test_ep_prices_only_the_assignments_that_reach_ffn_experts():
    v = A100.values()
    assert v["r_c"] == v["c_layer"] == v["c_expert"] == v["c_row"] == v["c_act"] == 0  # no host terms to price
    common = dict(profile=A100, pricing=Pricing(dense_params=0))
    space = PlanSpace(forms=("single", "ep"), ep=EPSpace(capacity_factors=(None,), packings=(1,)))
    plain = _by_label(search([PLAIN] * L, (1, W), BATCH, space, **common))
    zero = _by_label(search([ZERO_COMPUTE] * L, (1, W), BATCH, space, **common))
    assert set(plain) == set(zero) and len(zero) == 1 + 3 * len(schedule.DEFAULT_CHUNKS)  # single, ep 2 / 4 / 8
    rows = T * K * 8 / 12  # the FFN assignments: 8 of the 12 router choices
    per_row = 2 * m * D * F / (v["R"] * v["eta"])  # forward seconds of one routed row
    for label, c in zero.items():
        ep = c.ep_size
        sent = L * rows * D * v["b"] * (ep - 1) / ep  # per rank and direction: the FFN rows bound for other ranks
        assert float(c.formula.a2a_bytes) == pytest.approx(sent, rel=1e-12), label
        assert float(c.formula.a2a_bytes) == pytest.approx(8 / 12 * float(plain[label].formula.a2a_bytes), rel=1e-12)
        assert float(c.formula.compute) == pytest.approx(L * 3 * rows * per_row, rel=1e-12), label
        assert float(c.formula.compute) == pytest.approx(8 / 12 * float(plain[label].formula.compute), rel=1e-12)
        # the experts' weights do not shrink (zero-compute experts have none); the activations kept do
        memory = L * (E * m * D * F / ep * v["s"] + rows * (2 * D + m * F) * v["b"])
        assert float(c.formula.memory) == pytest.approx(memory, rel=1e-12), label
        assert c.feasible == (memory <= float(A100.memory)) and c.step < plain[label].step, label
    # EP over the 8 ranks, one chunk: dispatch and combine forward and the combine backward not hidden, + the split
    # sizes; the dispatch backward in flight during the weight GEMMs (Lancet), which take longer
    t_a = v["alpha"] + rows * (W - 1) / W * D * v["b"] / v["B_intra"]
    assert rows * per_row > t_a
    step = L * (3 * rows * per_row + 3 * t_a + v["alpha"])
    assert float(zero["ep=8 dropless n=1"].formula.step) == pytest.approx(step, rel=1e-12)


def test_the_formulas_stay_symbolic_in_phi():
    x = {name: info.symbol for name, info in S.TABLE.items()}
    plan = dict(ep=8, n=4, dp=2, dropless=True, cross_node_dp=True, policy="priority")
    plain, zero = cm.ep_layer(x, **plan), cm.ep_layer({**x, "phi": S.phi}, **plan)
    for term in ("a2a_bytes", "compute"):
        assert sympy.simplify(getattr(zero, term) - S.phi * getattr(plain, term)) == 0, term
    # activations scale with the FFN rows, the expert weights do not
    assert sympy.simplify(sympy.diff(zero.memory, S.phi) - S.T * S.K * S.rho * (2 * S.D + S.m * S.F) * S.b) == 0
    assert sympy.sympify(zero.step).subs(S.phi, 1) == sympy.sympify(plain.step)  # phi = 1: the plain block
    assert S.phi in sympy.sympify(zero.step).free_symbols and S.phi not in sympy.sympify(plain.step).free_symbols
    # FSEP: rho and the all-to-all's rows are over the mean FFN rows T*K*phi
    fsep = dict(W=8, C=2, n=2, rho=S.rho, a2a_rows=(sympy.Rational(1, 4), sympy.Rational(1, 2)))
    f_plain, f_zero = fsep_cm.fsep_layer(x, **fsep), fsep_cm.fsep_layer({**x, "phi": S.phi}, **fsep)
    assert sympy.simplify(f_zero.a2a_bytes - S.phi * f_plain.a2a_bytes) == 0
    assert sympy.simplify(f_zero.compute - S.phi * f_plain.compute) == 0
    assert cm.routed_rows(S.T, S.K, rho=S.rho, phi=S.phi) == S.T * S.K * S.phi * S.rho
    assert cm.routed_rows(S.T, S.K, cf=S.cf, phi=S.phi) == S.T * S.K * S.phi * S.cf
    # phi is optional: a figure dict without it prices the plain block, so it is not in the table every
    # general layer carries; `python -m cost_model symbols` lists it with its default
    assert "phi" not in S.TABLE and S.OPTIONAL["phi"].default == 1 and S.phi.is_positive
    assert any(line.startswith("phi") and line.endswith("(optional, default 1)") for line in S.table().splitlines())
    # the search's winner formula shows phi for a zero-compute model (and only then); substituted, its step
    space = PlanSpace(forms=("single", "ep"), ep=EPSpace(packings=(1,)))
    zero_result = search([ZERO_COMPUTE] * L, (1, W), BATCH, space, profile=A100)
    plain_result = search([PLAIN] * L, (1, W), BATCH, space, profile=A100)
    assert S.phi in zero_result.expression.free_symbols and S.phi not in plain_result.expression.free_symbols
    assert zero_result.expression_substituted.free_symbols <= {S.T}
    assert float(zero_result.expression_substituted.subs(S.T, T)) == pytest.approx(float(zero_result.best.formula.step),
                                                                                 rel=1e-3)


def test_block_shape_refuses_a_fraction_outside_0_1():
    for bad in (0.0, 1.5, -0.25):
        with pytest.raises(ValueError, match=rf"^BlockShape.ffn_fraction={bad!r} is invalid: it is the share of "
                                             r"the routed assignments that reach FFN experts, in \(0, 1\]"):
            dataclasses.replace(PLAIN, ffn_fraction=bad)


# ---- FSEP and capacity: priced on the FFN rows, never run --------------------------------------------------


def test_fsep_plans_the_ffn_rows_and_is_never_picked():
    space = PlanSpace(forms=("single", "ep", "fsep"), ep=EPSpace(packings=(1,), a2a_chunks=(1,), capacity_factors=(None,)),
                      fsep=FSEPSpace(a2a_chunks=(1,)))
    common = dict(profile=A100, pricing=Pricing(imbalance=2.5, dense_params=0))
    # strong skew: FSEP wins the plain block (tests/test_cost_model_fsep_search.py: test_fsep_wins_under_strong_skew)
    plain = search([PLAIN] * L, (1, W), BATCH, space, **common)
    zero = search([ZERO_COMPUTE] * L, (1, W), BATCH, space, **common)
    assert plain.best.form == "fsep"
    # the planner sees [W, E] counts of T*K*phi rows per rank, with the plain block's popularity
    counts = skewed_counts(T, K, E, W, 2.5, PHI)
    np.testing.assert_allclose(counts.sum(axis=1), T * K * 8 / 12, rtol=1e-12)
    np.testing.assert_allclose(counts, PHI * skewed_counts(T, K, E, W, 2.5), rtol=1e-12)
    fsep = [c for c in zero.ranked if c.form == "fsep"]
    assert {c.slots for c in fsep} == {1, 2, 3}
    for c in fsep:
        step, memory = fsep_by_hand(fsep_cm.integer_rows(counts), A100, C=c.slots, G=W, D=D, F=F, m=m, layers=L)
        assert float(c.formula.step) == pytest.approx(step, rel=1e-9), c.label
        assert float(c.formula.memory) == pytest.approx(memory, rel=1e-9), c.label
        assert not c.feasible and ZERO_COMPUTE_REFUSED["fsep"] in c.notes, c.label
    # its rewrite refuses the block: best is EP although FSEP would be cheaper, and the table says why
    assert zero.best.form == "ep" and min(c.step for c in fsep) < zero.best.step
    assert ZERO_COMPUTE_REFUSED["fsep"] in zero.table(limit=len(zero.ranked))


def test_fsep_under_uniform_routing_is_the_plain_blocks_at_phi():
    common = dict(profile=A100, pricing=Pricing(dense_params=0))
    space = PlanSpace(forms=("single", "ep", "fsep"),
                      ep=EPSpace(sizes=(W,), packings=(1,), a2a_chunks=(1,), capacity_factors=(None,)),
                      fsep=FSEPSpace(slots=(1, 2), a2a_chunks=(1,)))
    plain = {c.label: c for c in search([PLAIN] * L, (1, W), BATCH, space, **common).ranked if c.form == "fsep"}
    zero = {c.label: c for c in search([ZERO_COMPUTE] * L, (1, W), BATCH, space, **common).ranked if c.form == "fsep"}
    uniform = np.full((W, E), T * K * 8 // 12 // E, dtype=np.int64)  # 2048 FFN rows per expert and rank
    for label, c in zero.items():
        assert c.routing[0].rho == 1.0 and c.routing[0].a2a_rows == plain[label].routing[0].a2a_rows
        assert float(c.formula.a2a_bytes) == pytest.approx(PHI * float(plain[label].formula.a2a_bytes), rel=1e-12)
        assert float(c.formula.compute) == pytest.approx(PHI * float(plain[label].formula.compute), rel=1e-12)
        step, _ = fsep_by_hand(uniform, A100, C=c.slots, G=W, D=D, F=F, m=m, layers=L)
        assert float(c.formula.step) == pytest.approx(step, rel=1e-9), label


def test_capacity_is_priced_on_the_ffn_rows_and_never_picked():
    plain = BlockShape(E=8, K=2, D=512, F=1024, m=3, cf=None)
    common = dict(profile=A100, pricing=Pricing(imbalance=2.5))
    space = PlanSpace(allow_math_changes=True)
    # under heavy skew capping pays for the plain block (tests/test_cost_model.py), and is not run for this one
    assert search([plain], (1, 8), (4, 1024), space, **common).best.capacity_factor is not None
    result = search([dataclasses.replace(plain, ffn_fraction=PHI)], (1, 8), (4, 1024), space, **common)
    assert result.best.capacity_factor is None
    capped = [c for c in result.ranked if c.capacity_factor is not None]
    assert capped and all(not c.feasible and ZERO_COMPUTE_REFUSED["capacity"] in c.notes for c in capped)
    assert all(ZERO_COMPUTE_REFUSED["capacity"] not in c.notes for c in result.ranked if c.capacity_factor is None)
    b = A100.values()["b"]
    for c in capped:  # cf * T*K*phi / E slots per FFN expert: the padded buffers of the FFN rows
        ep = c.ep_size // c.packing
        sent = c.capacity_factor * 4096 * 2 * PHI * 512 * b * (ep - 1) / ep
        assert float(c.formula.a2a_bytes) == pytest.approx(sent, rel=1e-12), c.label


# ---- specs from the zoo, and form="auto" ----------------------------------------------------------------------


def _detected(block_class) -> MoESpec:
    torch.manual_seed(0)
    (spec,) = moepass.detect(block_class()).blocks
    return spec


def test_the_fraction_of_zoo_blocks_and_form_auto():
    from moepass.api import resolve_auto
    from moepass.runtime.topology import Topology

    identity, zeros, plain = (_detected(c) for c in (IdentityExperts, ZeroExpertsFirst, Relu2Experts))
    assert identity.experts.identity_experts and zeros.experts.zero_experts  # 4 FFN + 2 zero-compute experts
    for spec in (identity, zeros):
        shape = BlockShape.of(spec, 64)
        assert (shape.E, shape.ffn_fraction, spec.experts.routed_experts) == (4, 4 / 6, 6)
    assert BlockShape.of(plain, 64).ffn_fraction == 1.0 and not BlockShape.of(plain, 64).zero_compute
    auto = moepass.Plan(form="auto", batch=(4, 512), topology=Topology(1, 2), hardware="h100")
    chosen, result = resolve_auto(auto, SimpleNamespace(blocks=[identity]))
    assert result.shapes[0].ffn_fraction == 4 / 6 and chosen.form == result.best.form
    ep = next(c for c in result.ranked if c.label == "ep=2 dropless n=1")
    bytes_ = H100.values()["b"]
    assert float(ep.formula.a2a_bytes) == pytest.approx(2048 * 2 * 4 / 6 * 16 * bytes_ / 2, rel=1e-12)
    # a Mixtral-sized zero-compute block, 32 layers on 2 x 8 A100: only FSEP's shards would fit (as for the
    # plain block in tests/test_cost_model_fsep_search.py), but its rewrite refuses the block: no plan, and the reason
    big = identity.replace(experts=dataclasses.replace(identity.experts, hidden_dim=4096, ffn_dim=14336))
    assert BlockShape.of(big, 1024).ffn_fraction == 4 / 6
    auto = moepass.Plan(form="auto", batch=(1, 1024), topology=Topology(2, 8), hardware="a100")
    with pytest.raises(ValueError, match=r"^no feasible plan: every candidate exceeds device memory or cannot "
                                         r"run these blocks \(the table's notes say which\)"):
        resolve_auto(auto, SimpleNamespace(blocks=[big] * 32))
    result = search([big] * 32, (2, 8), (1, 1024), profile="a100")
    fsep = [c for c in result.ranked if c.form == "fsep"]
    assert fsep and all(ZERO_COMPUTE_REFUSED["fsep"] in c.notes for c in fsep)
    assert any(float(c.formula.memory) <= float(A100.memory) for c in fsep)  # fits: refused, not too large
    assert not any(c.feasible for c in result.ranked if c.form in ("ep", "single"))


def test_the_compile_time_schedule_sizes_the_ffn_rows():
    """`moepass.schedule` (a2a_chunks / packing "auto", the micro-op floor) sizes the dispatch as the rows that
    reach FFN experts: transfer and compute at E/R of the same block without its zero-compute experts."""
    from moepass.schedule import layer_times, micro_op_chunks

    identity = _detected(IdentityExperts)
    plain = identity.replace(experts=dataclasses.replace(identity.experts, identity_experts=(), zero_experts=()),
                             router=dataclasses.replace(identity.router, num_experts=identity.experts.num_experts))
    zc, full = (layer_times(s, 4096, 2, 2, hardware="h100") for s in (identity, plain))
    assert zc.transfer == pytest.approx(full.transfer * 4 / 6, rel=1e-12) and zc.transfer > 0
    assert zc.compute == pytest.approx(full.compute * 4 / 6, rel=1e-12)
    row = identity.top_k * identity.experts.hidden_dim * 4  # fp32 bytes per assignment
    assert micro_op_chunks(identity, 6000, 1000 * row, 4) == 4  # 6000 * 4/6 = 4000 rows: 4 chunks, not 6
    assert micro_op_chunks(plain, 6000, 1000 * row, 4) == 6


# ---- search and simulate agree --------------------------------------------------------------------------------


def _case(layers: int, D_: int, F_: int, gated: bool, E_: int, nodes: int, per_node: int, tokens: int) -> Case:
    return Case(label="zero-compute", layers=layers, D=D_, F=F_, E=E_, K=2, gated=gated, nodes=nodes,
                per_node=per_node, tokens=tokens, seq=1024, ep=nodes * per_node)


@pytest.mark.parametrize("phi", [1.0, PHI], ids=["plain", "zero-compute"])
def test_simulate_prices_the_same_rows_as_search(phi):
    case = _case(L, 2048, 1408, True, 8, 1, 8, 8192)
    counts = cm.zipf_counts(case.tokens, 2, 8, 8, 0.0) * phi  # uniform routing of the FFN rows
    _, breakdown, _ = simulate.predict(case, A100, counts)
    shape = BlockShape(E=8, K=2, D=2048, F=1408, m=3, cf=None, ffn_fraction=phi)
    space = PlanSpace(forms=("single", "ep"),
                      ep=EPSpace(sizes=(8,), capacity_factors=(None,), a2a_chunks=(1,), packings=(1,)))
    result = search([shape] * L, (1, 8), (8, 1024), space, profile=A100)
    c = next(c for c in result.ranked if c.label == "ep=8 dropless n=1")
    # the busiest rank's dispatch and combine, forward and backward: 4 times the search's bytes per direction
    assert breakdown["token_a2a_bytes"] == pytest.approx(4 * float(c.formula.a2a_bytes), rel=1e-12)
    assert breakdown["token_a2a_bytes"] == pytest.approx(4 * L * 8192 * 2 * phi * 2048 * 2 * 7 / 8, rel=1e-12)
    assert breakdown["expert_compute"] == pytest.approx(float(c.formula.compute), rel=1e-9)


# (hardware, nodes, ranks per node, D, F, gated, Z, tokens per rank), E = 8 FFN experts: set-ups where pricing
# every assignment (phi = 1) picks another (chunks, packing) than pricing the FFN rows
LINA_CASES = {
    "h100-1x4-gelu-Z4": (H100, 1, 4, 1024, 4096, False, 4, 8192),
    "h100-2x4-gelu-Z4": (H100, 2, 4, 1024, 4096, False, 4, 8192),
    "h100-1x8-swiglu-Z8": (H100, 1, 8, 4096, 2048, True, 8, 8192),
    "a100-2x4-gelu-Z16": (A100.with_figures("test: 100 Gb/s between nodes", inter_bw=12.5e9), 2, 4, 1024, 4096,
                          False, 16, 8192),
}


@pytest.mark.parametrize("name", LINA_CASES)
def test_lina_choice_on_the_ffn_rows_is_the_timeline_best(name):
    hw, nodes, per_node, D_, F_, gated, Z_, tokens = LINA_CASES[name]
    case = _case(8, D_, F_, gated, 8, nodes, per_node, tokens)
    phi = 8 / (8 + Z_)
    micro_op = MICRO_OP_BYTES
    counts = cm.zipf_counts(tokens, 2, 8, case.ep, 0.0) * phi
    steps = {}  # the timeline's step of every (chunks, packing) the search may pick
    for P in (1, 2, 4):
        if case.ep % P == 0 and case.ep // P >= 2:
            for n in schedule.DEFAULT_CHUNKS:
                steps[n, P] = simulate.predict(case, hw, counts, chunks=n, policy="priority", bucket_bytes=micro_op,
                                               packing=P)[0]
    best = min(steps, key=lambda k: (steps[k], k))

    def pick(fraction: float) -> tuple[int, int]:  # as `simulate._lina_choice` asks the search
        shape = BlockShape(E=8, K=2, D=D_, F=F_, m=3 if gated else 2, cf=None, ffn_fraction=fraction)
        space = PlanSpace(forms=("single", "ep"), ep=EPSpace(sizes=(case.ep,), capacity_factors=(None,),
                                                             packings=(1, 2, 4)))
        pricing = Pricing(dense_params=case.dense_params * case.layers, schedule="priority",
                          micro_op_bytes=micro_op)
        result = search([shape] * case.layers, (nodes, per_node), (tokens // 1024, 1024), space, profile=hw,
                        pricing=pricing)
        c = next(c for c in result.ranked if c.form == "ep")
        return c.a2a_chunks, c.packing

    # the search prices its candidates on this timeline (`cost_model.model_cases`): its pick on the FFN rows is the
    # timeline's best (every assignment priced, phi = 1, it prices another step: its pick may differ)
    assert steps[pick(phi)] / steps[best] - 1 <= 1e-9, (pick(phi), best)


# ---- the exact byte formula on the FFN counts is the runtime's counters ------------------------------------------


def case_zero_compute_counters(rank, world):
    """One fwd+bwd of the zoo's identity-expert block under EP; this rank's counters and router choices."""
    from moepass.runtime.topology import Topology

    torch.manual_seed(0)
    block = IdentityExperts()
    x = torch.randn(6, 5, 16, generator=torch.Generator().manual_seed(7 + rank))
    _, idx_TK = softmax_topk(block.router(x.reshape(-1, 16)))
    layer = moepass.compile(copy.deepcopy(block), moepass.Plan(form="ep", topology=Topology(1, world), a2a_chunks=1))
    moepass.reset_comm_stats()
    layer(x.requires_grad_()).sum().backward()  # the input's gradient: the dispatch's backward runs too
    return {"stats": moepass.comm_stats(), "chosen": idx_TK.tolist()}


@pytest.mark.distributed
def test_exact_bytes_of_the_ffn_counts_equal_the_counters():
    results = pool(2).run(case_zero_compute_counters, timeout=120)
    spec = _detected(IdentityExperts)
    ffn = spec.experts.ffn_ids  # router ids of the 4 FFN experts, in FFN-expert order
    counts_SE = np.zeros((2, len(ffn)), dtype=np.int64)  # [source rank, FFN expert] assignments
    zero_compute = 0
    for r, res in enumerate(results):
        for token in res["chosen"]:
            for e in token:
                if e in ffn:
                    counts_SE[r, ffn.index(e)] += 1
                else:
                    zero_compute += 1
    assert zero_compute > 0 and (counts_SE.sum(axis=1) > 0).all()  # both kinds on the ranks' batches
    rows_PP = cm.rank_rows(counts_SE, ep=2)
    dispatch = cm.exact_a2a(rows_PP, 16, 4, G=2)
    for r, res in enumerate(results):
        s = res["stats"]
        for kind, a2a in (("dispatch", dispatch), ("combine", dispatch.transposed()),
                          ("combine_bwd", dispatch), ("dispatch_bwd", dispatch.transposed())):
            assert s[kind]["intra"] == int(a2a.sent_intra[r]), (r, kind, s[kind])
            assert s[kind]["inter"] == 0 and s[kind]["self"] == int(rows_PP[r, r]) * 16 * 4, (r, kind, s[kind])
