"""The hierarchical (2D) all-to-all (`Plan(hierarchical_a2a=True)`, `moepass.runtime.hierarchical`): equal to
the flat all-to-all exactly, its bytes per link and stage equal to `cost_model.hierarchical`, the graph at
scale, and the Plan errors.

- the ops alone at W=4 as 2 nodes x 2 ranks: uneven counts (zero rows to some peers, a rank that sends
  nothing, rows past the counts that stay home; seeded, and hypothesis-drawn): outputs and input gradients
  bit-equal to the flat `moe_comm.all_to_all`, both directions; counted bytes per stage and link = the
  exact formula;
- EP with hierarchical_a2a=True: bit-equal to the flat EP (outputs, every gradient) on a sample model and HF
  Mixtral, and equal to the single-device original (the EP parity cases of tests/test_ep.py and
  tests/test_ep_parity.py, run with the plan field); the locality form bit-equal with and without it;
- the EP byte counters on a fixed routing: each stage = the formula, inter-node = the flat exchange's;
- torch.compile(fullgraph=True): one graph holding the stage ops; aot_eager trains with eager's numbers;
- the fake process group at W=16 as 4 x 4: the stage nodes, their groups, the one host sync, shapes with
  unbacked row counts; `explain` shows the stages;
- the PlanErrors (plan fields, and the EP group's geometry at compile).

Shape legend: P ranks of the EP group = n nodes x r ranks, L buckets per rank, B = P*L, D width.
"""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import fake_process_group, fake_values, pool  # noqa: E402
from test_ep import case_parity  # noqa: E402
from test_ep_parity import case_hf_parity  # noqa: E402

import moepass  # noqa: E402
from cost_model import ep as cm_ep  # noqa: E402
from cost_model import hierarchical as cm  # noqa: E402
from moepass import PlanError  # noqa: E402
from samples.models import routed_loop_moe  # noqa: E402

pytestmark = pytest.mark.distributed

W, NODES, PER_NODE = 4, 2, 2
BYTES = 4  # fp32


# ----------------------------------------------------------------------------------------------
# Helpers that run inside the ranks.
# ----------------------------------------------------------------------------------------------


def _wait(t):
    return torch.ops.moe_comm.wait(t)


def case_ops(rank, world, counts_SB, extra_S, D, nodes=NODES):
    """Rank r sends `counts_SB[r]` rows per bucket (B = P*L, blocked by peer) plus `extra_S[r]` rows past the
    counts (they stay home): the flat dispatch + combine and the hierarchical ones on the same rows and output
    gradients must give bit-equal outputs and input gradients. Returns this rank's byte counters."""
    from moepass.runtime import collectives as comm
    from moepass.runtime import hierarchical as hcomm
    from moepass.runtime.topology import Topology, ep_groups, node_groups

    groups = ep_groups(Topology(nodes, world // nodes), None, "cpu")
    hier = node_groups(groups)
    ep, intra, inter = groups.ep_group.group_name, hier.intra_group.group_name, hier.inter_group.group_name
    g = torch.Generator().manual_seed(rank)
    send_B = torch.tensor(counts_SB[rank])
    recv_B = _wait(comm.exchange_counts(send_B, ep))
    x = torch.randn(int(send_B.sum()) + extra_S[rank], D, generator=g)
    gy = torch.randn(int(recv_B.sum()), D, generator=g)
    gz = torch.randn(x.shape[0], D, generator=g)
    totals = hcomm.node_count_totals(send_B, recv_B, hier.nodes, hier.ranks_per_node)
    tables = hcomm.node_split_table(send_B, recv_B, _wait(comm.exchange_counts(totals, intra)), hier.nodes)
    assert tables.device.type == "cpu" and tables.shape == (2, 3 * groups.ep_size)
    moepass.reset_comm_stats()
    results = {}
    for how in ("flat", "hier"):
        xg = x.clone().requires_grad_()
        if how == "flat":
            y = _wait(comm.all_to_all(xg, send_B, recv_B, ep, "flat_dispatch", -1))
            z = _wait(comm.all_to_all(y * 3.0, recv_B, send_B, ep, "flat_combine", x.shape[0]))
        else:
            y = hcomm.hierarchical_all_to_all(xg, tables[0], intra, inter, "dispatch")
            z = hcomm.hierarchical_all_to_all(y * 3.0, tables[1], intra, inter, "combine", x.shape[0])
        ((y * gy).sum() + (z * gz).sum()).backward()
        results[how] = (y.detach(), z.detach(), xg.grad)
    for a, b, what in zip(results["flat"], results["hier"], ("dispatch out", "combine out", "x grad")):
        assert a.shape == b.shape and torch.equal(a, b), (what, (a - b).abs().max())
    assert torch.equal(results["hier"][1][int(send_B.sum()):], torch.zeros(extra_S[rank], D))  # the zero tail
    return moepass.comm_stats()


def fixed_routing(rank, tokens, E):
    """The (first, second) expert of each token of `rank`: uneven, and none to the experts of the next rank."""
    allowed = [e for e in range(E) if e * W // E != (rank + 1) % W]
    first = [(3 * rank + t) % len(allowed) for t in range(tokens)]
    return [(allowed[i], allowed[(i + 1 + t % (len(allowed) - 1)) % len(allowed)]) for t, i in enumerate(first)]


def case_ep_bytes(rank, world, tokens, D, E, hierarchical):
    """One forward+backward of the routed block under EP (flat or hierarchical); this rank's counters."""
    torch.manual_seed(0)
    plan = moepass.Plan(form="ep", topology=moepass.Topology(NODES, world // NODES), hierarchical_a2a=hierarchical)
    cm_block = moepass.compile(routed_loop_moe(D, E), plan)
    x = torch.zeros(tokens, D)
    for t, (a, b) in enumerate(fixed_routing(rank, tokens, E)):
        x[t, a], x[t, b] = 1.0, 0.9
    moepass.reset_comm_stats()
    cm_block(x.requires_grad_()).sum().backward()
    return moepass.comm_stats()


def _exact_pair(model, plan_kw, step):
    """Compile `model` flat and hierarchical; `step(cm)` -> (outputs, loss); every output and logical gradient
    must be bit-equal. Returns the number of gradients compared."""
    import copy

    from moepass.runtime import collectives as comm
    from moepass.runtime import hierarchical as hcomm
    from moepass.runtime.grads import all_reduce_replicated_grads

    got = {}
    for hierarchical in (False, True):
        plan = moepass.Plan(topology=moepass.Topology(NODES, W // NODES), hierarchical_a2a=hierarchical, **plan_kw)
        cm_model = moepass.compile(copy.deepcopy(model), plan)
        outs, loss = step(cm_model)
        loss.backward()
        all_reduce_replicated_grads(cm_model)
        grads = {n: g.detach().clone() for n, (g, _) in moepass.logical_grads(cm_model).items()}
        targets = [n.target for gm in cm_model.moepass_info.rewritten.values() for n in gm.graph.nodes]
        got[hierarchical] = ([o.detach() for o in outs], grads, targets)
    (flat_outs, flat_grads, flat_targets), (outs, grads, targets) = got[False], got[True]
    blocks = targets.count(hcomm.INTER_NODE_ALL_TO_ALL) // 2
    assert blocks >= 1 and targets.count(hcomm.INTRA_NODE_ALL_TO_ALL) == 2 * blocks, targets
    assert targets.count(comm.ALL_TO_ALL) == 0 and flat_targets.count(comm.ALL_TO_ALL) == 2 * blocks
    for a, b in zip(flat_outs, outs):
        assert torch.equal(a, b), (a - b).abs().max()
    assert flat_grads.keys() == grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, flat_grads[name]), (name, (g - flat_grads[name]).abs().max())
    return len(grads)


def case_exact_sample(rank, world, style):
    """The demo LM (`style` experts): hierarchical EP bit-equal to flat EP."""
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    model = tiny_mixtral(style=style, vocab_size=64, dim=32, ffn_dim=64, num_experts=8, top_k=2, layers=2, heads=4)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(100 + rank))

    def step(cm_model):
        return [cm_model(tokens[:, :-1])], cm_model.loss(tokens)

    return _exact_pair(model, {"form": "ep"}, step)


def case_exact_hf(rank, world, family):
    """An HF causal LM: hierarchical EP bit-equal to flat EP (logits, loss, every gradient)."""
    from samples import hf_models as H

    model, _ = H.build(family)
    gen = torch.Generator().manual_seed(21 + rank)
    ids = torch.randint(1, H.VOCAB, (2, H.SEQ), generator=gen)
    labels = torch.randint(1, H.VOCAB, ids.shape, generator=gen)

    def step(cm_model):
        out = cm_model(input_ids=ids, labels=labels)
        return [out.logits, out.loss], out.loss

    return _exact_pair(model, {"form": "ep"}, step)


def case_exact_locality(rank, world, capacity_factor):
    """The locality form (learned gate, floor capacity): bit-equal with and without hierarchical_a2a,
    outputs, the auxiliary losses and every gradient."""
    from test_locality import Net

    torch.manual_seed(0)
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(7 + rank))

    def step(cm_model):
        out = cm_model(x)
        aux = moepass.aux_loss(cm_model)
        return [out, aux], out.square().sum() + aux

    return _exact_pair(Net(), {"form": "locality", "gate": "learned", "mu": 0.3, "capacity_factor": capacity_factor},
                       step)


def case_torch_compile(rank, world):
    """torch.compile(fullgraph=True) over hierarchical EP: one graph; aot_eager trains with eager's numbers."""
    import torch._dynamo

    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    cm_model = moepass.compile(tiny_mixtral(vocab_size=64, dim=32, ffn_dim=64, num_experts=4, top_k=2, layers=2,
                                            heads=4),
                               moepass.Plan(form="ep", topology=moepass.Topology(NODES, world // NODES),
                                            hierarchical_a2a=True))
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1 + rank))

    def loss_of(forward):
        cm_model.zero_grad()
        loss = forward(tokens[:, :-1]).flatten(0, 1).log_softmax(-1).gather(1, tokens[:, 1:].reshape(-1, 1)).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in cm_model.named_parameters() if p.grad is not None}

    eager_loss, eager_grads = loss_of(cm_model)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(cm_model, backend=counting, fullgraph=True)(tokens[:, :-1])
    stage_nodes = sum(n.target in (torch.ops.moe_comm.intra_node_all_to_all.default,
                                   torch.ops.moe_comm.inter_node_all_to_all.default)
                      for gm in graphs for n in gm.graph.nodes)
    torch._dynamo.reset()
    loss, grads = loss_of(torch.compile(cm_model, backend="aot_eager", fullgraph=True))
    assert grads.keys() == eager_grads.keys()
    return {"graphs": len(graphs), "stage_nodes": stage_nodes, "loss_err": (loss - eager_loss).abs().item(),
            "grad_err": max((grads[n] - g).abs().max().item() for n, g in eager_grads.items())}


# ----------------------------------------------------------------------------------------------
# Tests.
# ----------------------------------------------------------------------------------------------


def _assert_stage(stats, kind, link, sent, self_bytes):
    other = "inter" if link == "intra" else "intra"
    entry = stats[kind]
    assert (entry[link], entry["self"], entry[other], entry["calls"]) == (int(sent), int(self_bytes), 0, 1), (kind,
                                                                                                           entry)


def _assert_hierarchical_bytes(stats, kind, rows_PP, D, rank):
    """Forward stages = the formula's sent bytes; backward stages = its received bytes (sent back)."""
    exact = cm.exact_hierarchical(rows_PP, D, BYTES, NODES, PER_NODE)
    _assert_stage(stats, f"{kind}_intra", "intra", exact.sent_intra[rank], exact.self_intra[rank])
    _assert_stage(stats, f"{kind}_inter", "inter", exact.sent_inter[rank], exact.self_inter[rank])
    _assert_stage(stats, f"{kind}_bwd_intra", "intra", exact.recv_intra[rank], exact.self_intra[rank])
    _assert_stage(stats, f"{kind}_bwd_inter", "inter", exact.recv_inter[rank], exact.self_inter[rank])
    flat = cm_ep.exact_a2a(rows_PP, D, BYTES, G=PER_NODE)
    # rows cross the nodes once: a node sends the flat exchange's inter-node bytes (its ranks share them otherwise)
    assert np.array_equal(exact.sent_inter.reshape(NODES, -1).sum(1), flat.sent_inter.reshape(NODES, -1).sum(1))
    assert np.array_equal(exact.recv_inter.reshape(NODES, -1).sum(1), flat.recv_inter.reshape(NODES, -1).sum(1))
    return exact


def node_sums(results, kind, link="inter"):
    """Bytes of `kind` on `link` that the ranks of each node sent, by node (from the ranks' counters)."""
    return [sum(stats[kind][link] for stats in results[a * PER_NODE:(a + 1) * PER_NODE]) for a in range(NODES)]


def random_counts(seed, L):
    """[P, B] counts 0..4 with zero rows to one peer per rank, one rank that sends nothing (seed 1)."""
    g = np.random.default_rng(seed)
    counts = g.integers(0, 5, (W, W, L))
    for r in range(W):
        counts[r, (r + seed) % W] = 0
    if seed == 1:
        counts[2] = 0
    return counts.reshape(W, W * L)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ops_equal_flat_exactly_and_count_the_formula(seed):
    L, D = 2, 3
    counts_SB = random_counts(seed, L)
    stats_by_rank = pool(W).run(case_ops, counts_SB.tolist(), [seed] * W, D)
    rows_PP = counts_SB.reshape(W, W, L).sum(2)
    for kind in ("dispatch", "combine"):  # the runtime's counters: each node's inter-node bytes as flat
        assert node_sums(stats_by_rank, f"{kind}_inter") == node_sums(stats_by_rank, f"flat_{kind}")
        assert node_sums(stats_by_rank, f"{kind}_bwd_inter") == node_sums(stats_by_rank, f"flat_{kind}_bwd")
    for rank, stats in enumerate(stats_by_rank):
        dispatch = _assert_hierarchical_bytes(stats, "dispatch", rows_PP, D, rank)
        _assert_hierarchical_bytes(stats, "combine", rows_PP.T, D, rank)
        # stage 1 moves every row not bound for the sender's own local index: more intra bytes than flat
        assert stats["dispatch_intra"]["intra"] >= stats["flat_dispatch"]["intra"]
        assert dispatch.sent_intra[rank] + dispatch.self_intra[rank] == rows_PP[rank].sum() * D * BYTES


@pytest.mark.parametrize("nodes", [3, 2])
def test_ops_equal_flat_on_unequal_geometry(nodes):
    """W=6 as 3 nodes x 2 ranks and 2 x 3 (nodes != ranks per node: a mixed-up axis cannot pass)."""
    world, L = 6, 2
    counts = np.random.default_rng(nodes).integers(0, 4, (world, world * L))
    counts[1, :] = 0
    counts[:, 4 * L:5 * L] = 0  # nobody sends to rank 4
    stats_by_rank = pool(world).run(case_ops, counts.tolist(), [1] * world, 3, nodes=nodes)
    rows_PP = counts.reshape(world, world, L).sum(2)
    for rank, stats in enumerate(stats_by_rank):
        exact = cm.exact_hierarchical(rows_PP, 3, BYTES, nodes, world // nodes)
        _assert_stage(stats, "dispatch_intra", "intra", exact.sent_intra[rank], exact.self_intra[rank])
        _assert_stage(stats, "dispatch_inter", "inter", exact.sent_inter[rank], exact.self_inter[rank])


def test_stage_splits_pair_up():
    """Every stage's rows sent by a rank to a peer = the rows that peer expects from it (any geometry), from
    the node counts each rank would receive; bad tables are ValueErrors."""
    from moepass.runtime import hierarchical as hcomm

    for nodes, per_node, L in ((2, 2, 1), (3, 2, 2), (2, 3, 1), (4, 4, 1)):
        P = nodes * per_node
        counts_SB = torch.from_numpy(np.random.default_rng(P).integers(0, 5, (P, P * L)))
        recv_SB = counts_SB.view(P, P, L).transpose(0, 1).reshape(P, P * L)  # what the count exchange delivers
        totals = [hcomm.node_count_totals(counts_SB[p], recv_SB[p], nodes, per_node).view(per_node, -1)
                  for p in range(P)]
        node = [p // per_node for p in range(P)]
        tables = [hcomm.node_split_table(counts_SB[p], recv_SB[p], torch.cat(
            [totals[node[p] * per_node + i][p % per_node] for i in range(per_node)]), nodes) for p in range(P)]
        for row in (0, 1):
            for stage, peers_of in (("intra", lambda p: [node[p] * per_node + i for i in range(per_node)]),
                                    ("inter", lambda p: [a * per_node + p % per_node for a in range(nodes)])):
                peers = len(peers_of(0))
                splits = [hcomm.stage_splits(stage, tables[p][row], peers) for p in range(P)]
                for p in range(P):
                    for g, q in enumerate(peers_of(p)):
                        assert splits[p].send[g] == splits[q].recv[peers_of(q).index(p)], (nodes, per_node, stage, p, q)
            stage2_in = [sum(hcomm.stage_splits("intra", tables[p][row], per_node).recv) for p in range(P)]
            assert stage2_in == [sum(hcomm.stage_splits("inter", tables[p][row], nodes).sizes) for p in range(P)]
    with pytest.raises(ValueError, match="hierarchical stage 'cross' is invalid"):
        hcomm.stage_splits("cross", torch.zeros(12, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=re.escape("the split table must be a row of node_split_table (a CPU vector "
                                                   "of 3*P entries, P a multiple of the group's 2 ranks), got (10,)")):
        hcomm.stage_splits("intra", torch.zeros(10, dtype=torch.int64), 2)


@settings(max_examples=12, deadline=None)
@given(counts=hnp.arrays(np.int64, (W, W * 3), elements=st.integers(0, 3)),
       extra=st.lists(st.integers(0, 2), min_size=W, max_size=W))
def test_ops_equal_flat_on_any_counts(counts, extra):
    """Any counts (all zero included): bit-equal outputs and gradients (asserted in the ranks)."""
    pool(W).run(case_ops, counts.tolist(), extra, 2)


def test_ep_bytes_per_stage_equal_the_formula():
    tokens, D, E = 6, 16, 8
    hier = pool(W).run(case_ep_bytes, tokens, D, E, True)
    flat = pool(W).run(case_ep_bytes, tokens, D, E, False)
    counts_SE = np.zeros((W, E), dtype=np.int64)
    for r in range(W):
        for pair in fixed_routing(r, tokens, E):
            for e in pair:
                counts_SE[r, e] += 1
    rows_PP = cm_ep.rank_rows(counts_SE, W)
    assert (rows_PP == 0).any()  # some pairs exchange nothing
    L = E // W
    for kind in ("dispatch", "combine"):  # each node's inter-node bytes = the flat EP's
        assert node_sums(hier, f"{kind}_inter") == node_sums(flat, kind)
        assert node_sums(hier, f"{kind}_bwd_inter") == node_sums(flat, f"{kind}_bwd")
    for rank, stats in enumerate(hier):
        for kind, rows in (("dispatch", rows_PP), ("combine", rows_PP.T)):
            _assert_hierarchical_bytes(stats, kind, rows, D, rank)
        assert "dispatch" not in stats and "combine" not in stats
        # counts: the flat exchange (L int64 per peer) + the node counts (2n int64 per rank of the node), 2 calls
        assert stats["counts"] == {"intra": (PER_NODE - 1) * (L + 2 * NODES) * 8, "inter": (W - PER_NODE) * L * 8,
                                   "self": (L + 2 * NODES) * 8, "calls": 2}


def test_uniform_formula_is_the_exact_count_of_uniform_routing():
    for nodes, per_node in ((2, 2), (4, 4), (2, 8), (3, 2)):
        P = nodes * per_node
        counts = np.full((P, 2 * P), 3)  # 3 rows from every rank to every expert: T*K = 6P rows per rank
        T, K, D = 3 * P, 2, 5
        exact = cm.exact_hierarchical(cm_ep.rank_rows(counts, P), D, BYTES, nodes, per_node)
        intra, inter = cm.stage_bytes(T, K, D, nodes, per_node, BYTES)
        assert np.allclose(exact.sent_intra, intra) and np.allclose(exact.sent_inter, inter)
        assert np.allclose(exact.recv_intra, intra) and np.allclose(exact.recv_inter, inter)
        flat_intra, flat_inter = cm_ep.a2a_bytes(T, K, D, P, per_node, BYTES)
        assert float(inter) == pytest.approx(float(flat_inter)) and float(intra) >= float(flat_intra)
        assert cm.inter_messages(nodes, per_node) == (P - per_node, nodes - 1)
        # the slowest rank's time of the exact count = the closed form's (uniform: every rank is the slowest)
        assert exact.time(1e11, 1e10, 2e-5) == pytest.approx(float(cm.hierarchical_time(intra, inter, 1e11, 1e10,
                                                                                        2e-5)))


@pytest.mark.parametrize("style", ["fused", "loop"])
def test_ep_sample_equals_flat_exactly(style):
    assert all(n > 0 for n in pool(W).run(case_exact_sample, style))


def test_ep_hf_mixtral_equals_flat_exactly():
    pytest.importorskip("transformers")
    assert all(n > 0 for n in pool(W).run(case_exact_hf, "mixtral"))


@pytest.mark.parametrize("style", ["fused", "gshard"])
def test_ep_sample_equals_single_device(style):
    reports = pool(W).run(case_parity, style, nodes=NODES, hierarchical_a2a=True)
    assert all(r["forms"] == ["ep"] for r in reports)


def test_ep_hf_mixtral_equals_single_device():
    pytest.importorskip("transformers")
    reports = pool(W).run(case_hf_parity, "mixtral", nodes=NODES, hierarchical_a2a=True)
    assert all(set(r["forms"].values()) == {"ep"} for r in reports)


@pytest.mark.parametrize("capacity_factor", [None, 0.25])
def test_locality_equals_flat_exactly(capacity_factor):
    assert all(n > 0 for n in pool(W).run(case_exact_locality, capacity_factor))


def test_torch_compile_one_graph_with_eager_numbers():
    for rank, res in enumerate(pool(W).run(case_torch_compile, timeout=300)):
        assert res["graphs"] == 1 and res["stage_nodes"] == 2 * 2 * 2, (rank, res)  # 2 layers x 2 directions
        assert res["loss_err"] <= 1e-6 and res["grad_err"] <= 1e-6, (rank, res)


def test_fake_pg_world_16_graph():
    from moepass.runtime import collectives as comm
    from moepass.runtime import hierarchical as hcomm
    from moepass.runtime.topology import group_info
    from samples.models import tiny_mixtral

    world, rank, E = 16, 13, 32
    with fake_process_group(world, rank):
        torch.manual_seed(0)
        model = tiny_mixtral(style="fused", vocab_size=32, dim=16, ffn_dim=16, num_experts=E, top_k=4, layers=1)
        cm_model = moepass.compile(model, moepass.Plan(form="ep", topology=moepass.Topology(4, 4),
                                                       hierarchical_a2a=True))
        gm = cm_model.layers[0].mlp
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        targets = [n.target for n in calls]
        assert targets.count(comm.ALL_TO_ALL) == 0
        assert targets.count(hcomm.INTRA_NODE_ALL_TO_ALL) == targets.count(hcomm.INTER_NODE_ALL_TO_ALL) == 2
        assert targets.count(comm.EXCHANGE_COUNTS) == 2  # the flat count exchange + the node counts
        assert targets.count(comm.WAIT) == 6  # counts, node counts, 2 x (stage 1, stage 2)
        ops = sorted({t._opname for t in targets if isinstance(t, torch._ops.OpOverload) and t.namespace == "moe_comm"})
        # one host sync (node_split_table), no flat all_to_all or its split table left
        assert ops == ["exchange_counts", "inter_node_all_to_all", "intra_node_all_to_all", "node_split_table",
                       "wait"], ops
        assert targets.count(hcomm.NODE_SPLIT_TABLE) == 1
        by_name = {n.name: n for n in calls}
        order = [n.name for n in calls]
        assert order.index("dispatch_intra") < order.index("dispatch_staged_ND") < order.index("dispatch_inter") \
            < order.index("x_RD") < order.index("combine_intra") < order.index("combine_inter") \
            < order.index("y_ND_combined")
        assert by_name["x_RD"].args[0] is by_name["dispatch_inter"]
        intra, inter = by_name["dispatch_intra"].args[2], by_name["dispatch_inter"].args[2]
        assert group_info(intra)[1] == [12, 13, 14, 15] and group_info(inter)[1] == [1, 5, 9, 13]
        assert by_name["combine_intra"].args[2] == intra and by_name["combine_inter"].args[2] == inter
        assert by_name["exchange_node_counts"].args[1] == intra
        assert all(n.meta["moepass"]["pass"] == "ep" for n in calls if n.target in (
            hcomm.INTRA_NODE_ALL_TO_ALL, hcomm.INTER_NODE_ALL_TO_ALL, comm.WAIT, comm.EXCHANGE_COUNTS))
        vals = fake_values(gm, torch.randn(2, 5, 16))
        assert vals["node_count_totals"].shape == (4 * 2 * 4,) and vals["node_splits"].shape == (2, 3 * 16)
        assert vals["node_splits"].device.type == "cpu"
        for name in ("dispatch_staged_ND", "x_RD", "combine_staged_ND"):
            assert vals[name].shape[1] == 16 and not isinstance(vals[name].shape[0], int), name
        assert vals["y_ND_combined"].shape == (40, 16) and vals["out"].shape == (2, 5, 16)
        # DP x EP: ep_size 8 = 2 nodes of 4, two EP groups
        cm_dp = moepass.compile(model, moepass.Plan(form="ep", ep_size=8, topology=moepass.Topology(4, 4),
                                                    hierarchical_a2a=True))
        names = {n.name: n for n in cm_dp.layers[0].mlp.graph.nodes}
        assert group_info(names["dispatch_intra"].args[2])[1] == [12, 13, 14, 15]
        assert group_info(names["dispatch_inter"].args[2])[1] == [9, 13]
        # a2a_chunks="auto" that would chunk the flat exchange (micro_op_bytes): the hierarchical one is not chunked
        plans = {h: moepass.Plan(form="ep", topology=moepass.Topology(4, 4), hierarchical_a2a=h, batch=(64, 4096),
                                 hardware="h100") for h in (False, True)}
        chunks = {h: [r["stats"] for r in moepass.compile(model, plan).layers[0].mlp.history
                      if r["pass"] == "schedule"][0] for h, plan in plans.items()}
        assert chunks[False]["chunks"] == 2 and chunks[True]["chunks"] == 1, chunks
        assert chunks[True]["chunks_from"].startswith("hierarchical_a2a: not chunked (auto: cost model on h100")


def test_node_groups_follow_the_world():
    """Node groups are cached within one world (one set per EP layout) and never handed to the next world."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moepass.runtime.topology import Topology, ep_groups, group_info, node_groups

    topology, made = Topology(2, 2), []
    for _ in range(2):
        dist.init_process_group("fake", rank=3, world_size=4, store=FakeStore())
        try:
            groups = ep_groups(topology, 4, "cpu")
            made.append(node_groups(groups))
            assert node_groups(groups) is made[-1]
            for group, ranks in ((made[-1].intra_group, [2, 3]), (made[-1].inter_group, [1, 3])):
                assert dist.distributed_c10d._resolve_process_group(group.group_name) is group
                assert group_info(group.group_name) == (topology, ranks) == (topology, dist.get_process_group_ranks(
                    group))
        finally:
            dist.destroy_process_group()
    assert made[0] is not made[1] and (made[1].nodes, made[1].ranks_per_node) == (2, 2)


def test_explain_shows_the_stages():
    from samples.models import tiny_mixtral

    model = tiny_mixtral(style="fused", vocab_size=32, dim=16, ffn_dim=16, num_experts=8, top_k=2, layers=1)
    text = moepass.explain(model, moepass.Plan(form="ep", topology=moepass.Topology(2, 2), hierarchical_a2a=True))
    for piece in ("moe_comm.intra_node_all_to_all", "moe_comm.inter_node_all_to_all", "exchange_node_counts"):
        assert piece in text, text[-3000:]
    assert "moe_comm.all_to_all" not in text


PLAN_ERRORS = [
    (dict(form="ep", hierarchical_a2a=1), "Plan.hierarchical_a2a=1 is invalid: use True or False."),
    (dict(form="fsep", hierarchical_a2a=True),
     "Plan.hierarchical_a2a=True has no effect with form='fsep': it splits the token all-to-all of form='ep' and "
     "form='locality' into an intra-node and an inter-node stage. Use one of those forms, or leave it False."),
    (dict(hierarchical_a2a=True), "has no effect with form='single'"),
    (dict(form="auto", hierarchical_a2a=True), "has no effect with form='auto'"),
    (dict(form="ep", topology=moepass.Topology(1, 4), hierarchical_a2a=True),
     "Plan.hierarchical_a2a=True is invalid with Plan.topology=Topology(nodes=1, ranks_per_node=4): it needs >= 2 "
     "nodes of >= 2 ranks (with one node every link is intra-node, with one rank per node the intra-node stage is "
     "empty: the exchange would be the flat one). Leave it False."),
    (dict(form="locality", mu=0.1, topology=moepass.Topology(4, 1), hierarchical_a2a=True),
     "Plan.topology=Topology(nodes=4, ranks_per_node=1): it needs >= 2 nodes of >= 2 ranks"),
    (dict(form="ep", a2a_chunks=2, hierarchical_a2a=True),
     "Plan.a2a_chunks=2 with hierarchical_a2a=True is not built: the schedule pass chunks the flat exchange only. "
     "Use a2a_chunks=1 or 'auto' (which then picks 1), or hierarchical_a2a=False."),
    (dict(form="ep", blocks={"layers.*": {"form": "hp", "hierarchical_a2a": True}}), "has no effect with form='hp'"),
]


@pytest.mark.parametrize("kwargs,message", PLAN_ERRORS)
def test_plan_errors(kwargs, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        moepass.Plan(**kwargs)


def test_plan_accepts_ep_and_locality():
    assert moepass.Plan(form="ep", topology=moepass.Topology(2, 2), hierarchical_a2a=True).hierarchical_a2a
    assert moepass.Plan(form="locality", mu=0.1, hierarchical_a2a=True).hierarchical_a2a  # a2a_chunks: ep, fsep only


COMPILE_ERRORS = [  # (world, nodes, ep_size): the EP group's geometry is only known at compile
    (4, 2, 2, "the EP group of 2 ranks lies inside one node of 2 ranks: every link is intra-node"),
    (12, 3, 6, "the EP group of 6 ranks does not cover whole nodes of 4 ranks"),
]


@pytest.mark.parametrize("world,nodes,ep_size,why", COMPILE_ERRORS)
def test_compile_errors_name_the_ep_group(world, nodes, ep_size, why):
    topology = moepass.Topology(nodes, world // nodes)
    with fake_process_group(world, 1), pytest.raises(PlanError) as err:
        moepass.compile(routed_loop_moe(16, 12), moepass.Plan(form="ep", ep_size=ep_size, topology=topology,
                                                          hierarchical_a2a=True))
    assert str(err.value) == (
        f"Plan.hierarchical_a2a=True is invalid for Plan.topology=Topology(nodes={nodes}, ranks_per_node="
        f"{world // nodes}) and ep_size={ep_size}: {why}. It needs "
        f"an EP group of >= 2 whole nodes with >= 2 ranks each (ep_size a multiple of ranks_per_node, >= "
        f"2*ranks_per_node); otherwise leave it False (the flat exchange).")
