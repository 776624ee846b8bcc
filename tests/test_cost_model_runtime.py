"""The cost model's exact byte formula (`cost_model.ep.exact_a2a`) against moepass's runtime counters.

Two gloo ranks (the session's pool, `tests/_dist.py`) run one forward + backward of an EP-compiled
LoopMoE whose router sends known tokens to known experts (input onehot(a) + 0.9 onehot(b) -> experts
a then b). The test builds the [source rank, expert] count matrix from that routing alone, feeds it to
the cost model, and requires `moepass.comm_stats()` to equal the formula byte for byte: dispatch and
combine, their backward passes, and the intra-/inter-node split by topology — Topology(1, 2) puts the
peer on the same node, Topology(2, 1) on the other — plus capacity (per source rank and expert, C =
ceil(cf * T * K / E), dropped assignments never sent).
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402

from cost_model import ep as cm  # noqa: E402

pytestmark = pytest.mark.distributed

W, T, D, E, K = 2, 12, 16, 4, 2
BYTES = 4  # fp32


def routing(rank: int) -> list[tuple[int, int]]:
    """(first, second) expert of each of rank's T tokens: skewed, different per rank, both ranks'
    experts used (rank 0 favours expert 0, rank 1 expert 3)."""
    first = [0, 0, 0, 1, 2, 3, 0, 0, 1, 1, 2, 0] if rank == 0 else [3, 3, 2, 3, 1, 0, 3, 3, 2, 2, 3, 1]
    return [(a, (a + 1 + (t % 3)) % E) for t, a in enumerate(first)]


def case_counters(rank, world, nodes, capacity):
    """One fwd+bwd of the routed block under EP; this rank's counters and the experts its router chose."""
    import moepass
    from samples.models import LoopMoE

    torch.manual_seed(0)
    block = LoopMoE(D, 2 * D, E, top_k=K)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[:, :E] = 10 * torch.eye(E)
    x = torch.zeros(T, D)
    for t, (a, b) in enumerate(routing(rank)):
        x[t, a], x[t, b] = 1.0, 0.9
    chosen = block.gate(x).topk(K, dim=-1).indices.tolist()
    plan = moepass.Plan(form="ep", topology=moepass.Topology(nodes, world // nodes), a2a_chunks=1,
                        capacity_factor=capacity)
    layer = moepass.compile(block, plan)
    moepass.reset_comm_stats()
    layer(x.requires_grad_()).sum().backward()
    return {"stats": moepass.comm_stats(), "chosen": chosen}


def counts_SE(capacity: float | None) -> np.ndarray:
    """[source rank, expert] rows each rank sends, from the routing alone (capacity: min(count, C))."""
    counts = np.zeros((W, E), dtype=np.int64)
    for r in range(W):
        for pair in routing(r):
            for e in pair:
                counts[r, e] += 1
    if capacity is not None:
        counts = np.minimum(counts, math.ceil(capacity * T * K / E))
    return counts


@pytest.mark.parametrize("nodes,capacity", [(1, None), (2, None), (2, 0.5), (1, 0.75)])
def test_counters_equal_exact_formula(nodes, capacity):
    results = pool(W).run(case_counters, nodes, capacity, timeout=60)
    for r, res in enumerate(results):  # the router did route as designed
        assert [tuple(p) for p in res["chosen"]] == routing(r)
    counts = counts_SE(capacity)
    if capacity is not None:
        assert (counts < counts_SE(None)).any()  # capacity binds somewhere: the test covers drops
    rows_PP = cm.rank_rows(counts, ep=W)
    dispatch = cm.exact_a2a(rows_PP, D, BYTES, G=W // nodes)
    combine = dispatch.transposed()
    link = "intra" if nodes == 1 else "inter"
    other = "inter" if nodes == 1 else "intra"
    for r, res in enumerate(results):
        s = res["stats"]
        for kind, a2a in (("dispatch", dispatch), ("combine", combine), ("combine_bwd", dispatch),
                          ("dispatch_bwd", combine)):
            assert s[kind]["intra"] == int(a2a.sent_intra[r]), (r, kind, s[kind], a2a)
            assert s[kind]["inter"] == int(a2a.sent_inter[r]), (r, kind, s[kind], a2a)
            assert s[kind][other] == 0 and s[kind][link] > 0
            assert s[kind]["self"] == int(rows_PP[r, r]) * D * BYTES  # local rows: counted as self, never sent
            assert s[kind]["calls"] == 1
        # the formula's per-rank received bytes are the peer's sent bytes: what the combine sends back
        assert s["combine"][link] == int(dispatch.recv_intra[r] + dispatch.recv_inter[r])
        assert s["counts"][link] == (E // W) * 8  # the split-size exchange: L int64 counts to the peer


def test_uniform_formula_is_the_mean_of_exact_counts():
    """Under uniform routing (every expert gets T*K/E rows from every rank) the exact count gives the
    closed form K*T*D*b*(ep-1)/ep per rank and direction, split by link as `a2a_bytes` says."""
    for ep, G in ((2, 1), (2, 2), (4, 2), (8, 4)):
        E_ = 2 * ep
        counts = np.full((ep, E_), 3)  # every rank sends 3 rows to every expert: T*K = 3*E_ rows
        T_ = 3 * E_ // K
        exact = cm.exact_a2a(cm.rank_rows(counts, ep), D, BYTES, G)
        intra, inter = cm.a2a_bytes(T_, K, D, ep, G, BYTES)
        assert np.allclose(exact.sent_intra, float(intra)) and np.allclose(exact.sent_inter, float(inter))


# ---- the host terms and the GEMM table (pure, no ranks) -------------------------------------------


def test_gpu_presets_have_no_host_terms():
    """The CPU-only terms are zero for the GPU presets: their layer time is the plain formula."""
    from cost_model.presets import PRESETS

    for hw in PRESETS.values():
        v = hw.values()
        assert v["c_layer"] == v["c_expert"] == v["c_row"] == v["c_act"] == v["r_c"] == 0.0
        x = {**v, "T": 4096, "K": 2, "D": 1024, "F": 4096, "m": 3, "E": 8, "G": 8, "rho": 1.0, "c_f": 1.0}
        terms = cm.ep_layer(x, ep=8, n=1, dp=1, dropless=True, cross_node_dp=False)
        assert terms.host == 0
        assert float(terms.compute) == pytest.approx(float(cm.compute_time(4096 * 2, 1024, 4096, 3, v["R"], v["eta"])))


def test_host_terms_and_recompute_add_up():
    from cost_model.presets import A100

    x = {**A100.values(), "T": 1000, "K": 2, "D": 64, "F": 128, "m": 3, "E": 8, "G": 2, "rho": 1.0, "c_f": 1.0}
    base = cm.ep_layer(x, ep=2, n=1, dp=1, dropless=True, cross_node_dp=False)
    host = {"c_layer": 1e-3, "c_expert": 1e-5, "c_row": 1e-9, "c_act": 2e-9}
    more = cm.ep_layer({**x, **host}, ep=2, n=1, dp=1, dropless=True, cross_node_dp=False)
    assert float(more.host) == pytest.approx(1e-3 + 1e-5 * 4 + 1e-9 * 2000 * 64 + 2e-9 * 2000 * 128)
    assert float(more.step - base.step) == pytest.approx(float(more.host))
    rec = cm.ep_layer({**x, "r_c": 1.0}, ep=2, n=1, dp=1, dropless=True, cross_node_dp=False)
    assert float(rec.compute / base.compute) == pytest.approx((3 + 2 / 3) / 3)  # gate + up recomputed


def test_gemm_rate_interpolates_the_table():
    import dataclasses

    from cost_model.presets import A100

    table = ((64, 64, 0.1), (64, 1024, 0.4), (512, 64, 0.2), (512, 1024, 0.8))
    hw = dataclasses.replace(A100, gemm_table=table)
    peak = float(A100.flops) * float(A100.efficiency)
    for D, M, eff in table:
        assert hw.gemm_rate(D, M) == pytest.approx(eff * peak)
    assert hw.gemm_rate(16, 16) == pytest.approx(0.1 * peak) and hw.gemm_rate(4096, 1 << 20) == pytest.approx(0.8 * peak)
    assert hw.gemm_rate(64, 256) == pytest.approx(0.2 * peak)  # halfway in log M between 0.1 and 0.4: geometric mean
    assert A100.gemm_rate(64, 64) == pytest.approx(float(A100.flops) * float(A100.efficiency))
