"""The schedule pass and the priority scheduler under gloo (W=2, the shared spawned pool of tests/_dist.py).

- chunked EP (n = 2, 4) vs unchunked EP: outputs and input gradients bit for bit in fp32, parameter
  gradients within rtol 1e-6 (premise checked: every expert GEMM of every chunk has >= 4 rows, see
  moepass/schedule.py on MKL's small-row kernels);
- packing=2 vs plain EP: equal within tolerance; counted all-to-all bytes fall by the analytic amount;
- priority from the event log: with >= 8 micro-ops no all-to-all overlaps more than one all-reduce
  micro-op; plain DDP buckets (negative control) overlap more; gradients equal a plain all-reduce;
- random sleeps on each rank: no hang, identical collective sequence on every rank;
- the DDP communication hook gives DDP's gradients.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402

pytestmark = pytest.mark.distributed

D, F, E, K, T = 32, 64, 4, 2, 96  # block sizes; T tokens per rank
LM = dict(vocab_size=512, dim=128, ffn_dim=64, num_experts=4, top_k=2, layers=2, heads=4)
MICRO_OP_BYTES = 16 * 1024


# ----------------------------------------------------------------------------------------------
# Cases (run on every rank).
# ----------------------------------------------------------------------------------------------


def block_input(rank):
    return torch.randn(T, D, generator=torch.Generator().manual_seed(1000 + rank))


def min_rows_per_expert_chunk(block, world, n):
    """Fewest rows any expert GEMM sees in any chunk (all ranks' routings, computed locally)."""
    worst = 1 << 30
    per_rank = []
    for r in range(world):
        logits = block.gate(block_input(r)).float().softmax(-1)
        per_rank.append(logits.topk(K, dim=-1).indices)
    for j in range(n):
        counts = sum(torch.bincount(torch.tensor_split(e, n)[j].reshape(-1), minlength=E) for e in per_rank)
        worst = min(worst, int(counts.min()))
    return worst


def case_chunk_parity(rank, world, chunks):
    import moepass
    from samples.models import LoopMoE

    torch.manual_seed(0)
    block = LoopMoE(D, F, E, top_k=K)
    topo = moepass.Topology(1, world)
    runs = {}
    for n in (1, chunks):
        cm = moepass.compile(block, moepass.Plan(form="ep", a2a_chunks=n, topology=topo))
        x = block_input(rank).requires_grad_()
        y = cm(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7 + rank)))
        grads = {name: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for name, p in cm.named_parameters()}
        a2a = sum(1 for nd in cm.graph.nodes if nd.target is torch.ops.moe_comm.all_to_all.default)
        runs[n] = (y.detach(), x.grad, grads, a2a)
    (y1, gx1, g1, a1), (yn, gxn, gn, an) = runs[1], runs[chunks]
    worst_param = 0.0
    for name in g1:
        scale = g1[name].abs().max().item()
        torch.testing.assert_close(gn[name], g1[name], rtol=1e-6, atol=1e-6 * scale)
        worst_param = max(worst_param, ((gn[name] - g1[name]).abs().max().item()) / max(scale, 1e-30))
    return {"out_equal": torch.equal(y1, yn), "xgrad_equal": torch.equal(gx1, gxn), "param_rel": worst_param,
            "a2a_nodes": (a1, an), "min_rows": min_rows_per_expert_chunk(block, world, chunks)}


def fixed_routing(rank, tokens):
    """(first, second) expert of each token of `rank` in the packing test (always two distinct experts)."""
    return [((rank + t) % E, (rank + t + 1 + t % (E - 1)) % E) for t in range(tokens)]


def case_packing(rank, world):
    """packing=2 at W=2 (experts on 1 rank x 2 replicas) vs plain EP: outputs, grads; bytes."""
    import moepass
    from samples.models import LoopMoE
    torch.manual_seed(0)
    block = LoopMoE(D, F, E, top_k=K)
    with torch.no_grad():  # a router that picks experts a then b for onehot(a) + 0.9 onehot(b)
        block.gate.weight.zero_()
        block.gate.weight[:, :E] = 10 * torch.eye(E)
    topo = moepass.Topology(1, world)
    x0 = torch.zeros(8, D)
    for t, (a, b) in enumerate(fixed_routing(rank, 8)):
        x0[t, a], x0[t, b] = 1.0, 0.9
    out = {}
    for k in (1, 2):
        cm = moepass.compile(block, moepass.Plan(form="ep", packing=k, topology=topo))
        x = x0.clone().requires_grad_()
        moepass.reset_comm_stats()
        y = cm(x)
        y.sum().backward()
        stats = moepass.comm_stats()
        grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                 for name, p in cm.named_parameters()}
        out[k] = (y.detach(), x.grad, grads, stats, cm.layout.groups.ep_size)
    (y1, gx1, g1, s1, ep1), (y2, gx2, g2, s2, ep2) = out[1], out[2]
    torch.testing.assert_close(y2, y1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx2, gx1, rtol=1e-5, atol=1e-6)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-5, atol=1e-6)
    linked = {k: {kind: s[kind]["intra"] + s[kind]["inter"] for kind in ("dispatch", "combine")}
              for k, s in ((1, s1), (2, s2))}
    return {"ep": (ep1, ep2), "linked": linked, "self": (s1["dispatch"]["self"], s2["dispatch"]["self"])}


def _lm_setup(world, a2a_chunks=2):
    import moepass
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    model = tiny_mixtral(style="fused", **LM)
    cm = moepass.compile(model, moepass.Plan(form="ep", a2a_chunks=a2a_chunks, topology=moepass.Topology(1, world),
                                             micro_op_bytes=MICRO_OP_BYTES))
    return model, cm


def lm_tokens(world, rank, step):
    tokens = torch.randint(0, LM["vocab_size"], (world * 2, 33), generator=torch.Generator().manual_seed(50 + step))
    return tokens[rank * 2:(rank + 1) * 2]


def _replicated_grads(cm):
    from moepass.runtime.grad_sync import replicated_parameters

    return {n: p.grad.clone() for n, p in replicated_parameters(cm)}


def _reference_grads(world, rank, step):
    """Replicated grads after a plain per-tensor all-reduce (moepass.runtime.grads)."""
    from moepass.runtime.grads import all_reduce_replicated_grads

    _, cm = _lm_setup(world)
    cm.loss(lm_tokens(world, rank, step)).backward()
    all_reduce_replicated_grads(cm)
    return _replicated_grads(cm)


def case_priority(rank, world, mode, steps=2, sleeps=False):
    """mode "priority": moepass.DataParallel; "ddp": plain DDP with small buckets (the control);
    "hook": DDP with the priority comm hook. Returns overlap counts and the collective sequence."""
    import random

    from torch.nn.parallel import DistributedDataParallel as DDP

    import moepass
    from moepass.runtime import events, grad_sync, scheduler

    _, cm = _lm_setup(world)
    if mode == "priority":
        wrapped = moepass.DataParallel(cm)
        n_ops = len(wrapped.scheduler.cut(torch.empty(sum(p.numel() for _, p in
                                                          grad_sync.replicated_parameters(cm)))))
    else:
        wrapped = DDP(cm, bucket_cap_mb=MICRO_OP_BYTES / 2**20)
        n_ops = None
        if mode == "ddp":
            wrapped.register_comm_hook(None, events.ddp_logging_hook)
        else:
            state = scheduler.PriorityScheduler(MICRO_OP_BYTES)
            wrapped.register_comm_hook(state, grad_sync.priority_hook)
    rng = random.Random(rank * 7919)
    if sleeps:
        for module in cm.modules():
            if module.__class__.__name__ in ("Attention", "MoEGraphModule"):
                module.register_forward_hook(lambda *a: __import__("time").sleep(rng.uniform(0, 0.02)))
                module.register_full_backward_pre_hook(lambda *a: __import__("time").sleep(rng.uniform(0, 0.02)))
    log = events.EventLog(rank).start()
    waits, sequence, match = [], [], True
    try:
        for step in range(steps):
            log.clear()
            for p in cm.parameters():
                p.grad = None
            out = wrapped(lm_tokens(world, rank, step)[:, :-1])
            tok = lm_tokens(world, rank, step)
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tok[:, 1:].reshape(-1))
            loss.backward()
            waits += events.priority_waits(log.events)
            sequence += [(e.kind, e.nbytes) for e in sorted(log.events, key=lambda e: e.start)
                         if e.category != "compute"]
            got = _replicated_grads(cm)
            want = _reference_grads(world, rank, step)
            for name in want:
                match &= bool(torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-7))
            if step == 0 and rank == 0 and os.environ.get("MOEPASS_TIMELINE"):
                events.plot_timeline(log.events, os.environ["MOEPASS_TIMELINE"] + f"_{mode}.png")
    finally:
        log.stop()
        if mode == "priority":
            wrapped.close()
        elif mode == "hook":
            state.close()
    ar_kinds = [k for k, _ in sequence if k in ("grad_allreduce", "ddp_bucket")]
    return {"max_wait": max(waits), "a2a": len(waits), "ops": n_ops, "match": match, "ar": len(ar_kinds),
            "ar_sizes": [b for k, b in sequence if k in ("grad_allreduce", "ddp_bucket")],
            "per_tensor_sizes": per_tensor_micro_ops(cm, world) * steps}


def per_tensor_micro_ops(cm, world):
    """Registry byte counts of Lina's micro-ops: every replicated gradient cut on its own."""
    from moepass.runtime.grad_sync import replicated_parameters

    sizes = []
    for _, p in replicated_parameters(cm):
        per = MICRO_OP_BYTES // p.element_size()
        sizes += [2 * (world - 1) * min(per, p.numel() - start) * p.element_size() // world
                  for start in range(0, p.numel(), per)]
    return sizes


# ----------------------------------------------------------------------------------------------
# Tests.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [2, 4])
def test_chunked_equals_unchunked_bitwise(chunks):
    for r in pool(2).run(case_chunk_parity, chunks):
        assert r["min_rows"] >= 4, r  # the premise of bit-exactness on MKL (see moepass/schedule.py)
        assert r["a2a_nodes"] == (2, 2 * chunks)
        assert r["out_equal"] and r["xgrad_equal"], r
        assert r["param_rel"] <= 1e-6, r


def test_packing_equal_and_bytes_fall_by_analytic_amount():
    world, L = 2, E // 2
    results = pool(world).run(case_packing)
    for rank, r in enumerate(results):
        assert r["ep"] == (2, 1)
        # analytic: rows routed to the other rank's experts under plain EP (each D fp32 values)
        remote = sum(1 for pair in fixed_routing(rank, 8) for e in pair if e // L != rank) * D * 4
        received = sum(1 for src in range(world) if src != rank
                       for pair in fixed_routing(src, 8) for e in pair if e // L == rank) * D * 4
        assert r["linked"][1] == {"dispatch": remote, "combine": received}
        assert r["linked"][2] == {"dispatch": 0, "combine": 0}  # packing 2 at W=2: every expert local
        assert r["self"][1] - r["self"][0] == remote  # the rows that moved onto the sender


def test_priority_at_most_one_micro_op_and_ddp_control_violates():
    prio = pool(2).run(case_priority, "priority")
    assert prio[0]["ops"] >= 8
    for r in prio:
        assert r["match"] and r["a2a"] > 0
        assert r["max_wait"] <= 1, r
    ddp = pool(2).run(case_priority, "ddp")
    assert max(r["max_wait"] for r in ddp) > 1, ddp  # plain DDP buckets: an all-to-all waits behind several


def test_priority_random_sleeps_no_hang_same_sequence():
    results = pool(2).run(case_priority, "priority", steps=3, sleeps=True, timeout=120)
    assert all(r["match"] for r in results)
    assert results[0]["ar_sizes"] == results[1]["ar_sizes"]  # same collectives, same order, every rank
    assert all(r["max_wait"] <= 1 for r in results)


def test_ddp_comm_hook_priority():
    results = pool(2).run(case_priority, "hook")
    for r in results:
        assert r["match"], r
        assert r["max_wait"] <= 1, r
        assert sorted(r["ar_sizes"]) == sorted(r["per_tensor_sizes"]), r  # no micro-op spans two tensors
