"""The chunked schedule's count exchange, host syncs and pipelined backward, under gloo (tests/_dist.py pool).

- host syncs per layer per step, counted: the one device -> host copy (`collectives.host_split_table`,
  patched to count its calls) runs once per forward and never in the backward, for n = 1, 2, 4
  chunks; no `.item()`-style scalar read (`aten._local_scalar_dense`, counted by a dispatch mode);
  every exchange reads its splits from the host table (`.tolist()` of a CPU table row: 4n per step);
  one count exchange per layer per step whatever n (`comm_stats` calls);
- the backward is pipelined, shown by the event log: every backward expert compute of a chunked block
  runs while a backward all-to-all of another chunk is in flight (issued before it started, waited
  after it ended), every forward expert compute but the last while the next chunk's dispatch is;
  unchunked (n = 1), none is (the control: the check can fail);
- chunked vs unchunked at W = 2 and W = 4: outputs and input gradients bit for bit in fp32,
  parameter gradients within rtol 1e-6 (tests/test_schedule_dist.py states the premise);
- expert-replica gradients (packing) as priority micro-ops (`GradientSync(expert_replicas=True)`):
  equal to the blocking reduction bit for bit, every micro-op (dense and expert) in the event log.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402
from test_schedule_dist import (  # noqa: E402
    LM,
    MICRO_OP_BYTES,
    D,
    E,
    F,
    K,
    block_input,
    case_chunk_parity,
    lm_tokens,
    per_tensor_micro_ops,
)

pytestmark = pytest.mark.distributed
STEPS = 2


def _compiled(world, chunks):
    import moepass
    from samples.models import LoopMoE

    torch.manual_seed(0)
    block = LoopMoE(D, F, E, top_k=K)
    return moepass.compile(block, moepass.Plan(form="ep", a2a_chunks=chunks, topology=moepass.Topology(1, world)))


def _inputs(rank, step):
    x = (block_input(rank) + step).requires_grad_()
    return x, torch.randn(x.shape, generator=torch.Generator().manual_seed(7 + rank + step))


def case_host_syncs(rank, world, chunks, lm=False):
    """Per phase: calls of the sync point, scalar reads, `.tolist()` calls; comm_stats calls per kind.
    `lm`: the 2-layer LM of tests/test_schedule_dist.py instead of one block."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import moepass
    from moepass.runtime import collectives as comm

    if lm:
        from samples.models import tiny_mixtral

        torch.manual_seed(0)
        cm = moepass.compile(tiny_mixtral(style="fused", **LM), moepass.Plan(
            form="ep", a2a_chunks=chunks, topology=moepass.Topology(1, world)))
    else:
        cm = _compiled(world, chunks)
    counted = {"forward": Counter(), "backward": Counter()}
    phase = ["forward"]

    class ScalarReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                counted[phase[0]]["scalar_reads"] += 1
            return func(*args, **(kwargs or {}))

    table, tolist = comm.host_split_table, torch.Tensor.tolist

    def counting_table(*args):
        counted[phase[0]]["host_syncs"] += 1
        return table(*args)

    def counting_tolist(self):
        counted[phase[0]]["tolist"] += 1
        return tolist(self)

    moepass.reset_comm_stats()
    comm.host_split_table, torch.Tensor.tolist = counting_table, counting_tolist
    try:
        for step in range(STEPS):
            x, grad = (lm_tokens(world, rank, step), None) if lm else _inputs(rank, step)
            with ScalarReads():
                phase[0] = "forward"
                y = cm.loss(x) if lm else cm(x)
                phase[0] = "backward"
                y.backward(grad)
    finally:
        comm.host_split_table, torch.Tensor.tolist = table, tolist
    calls = {kind: v["calls"] for kind, v in moepass.comm_stats().items() if kind != "total"}
    return {"counted": {p: dict(c) for p, c in counted.items()}, "calls": calls}


def case_overlap(rank, world, chunks):
    """The event log of a few steps: for each expert compute window, the all-to-alls in flight during it."""
    from moepass.runtime import events

    cm = _compiled(world, chunks)
    log = events.EventLog(rank).start()
    try:
        for step in range(STEPS):
            x, grad = _inputs(rank, step)
            cm(x).backward(grad)
    finally:
        log.stop()
    windows = [e for e in log.events if e.category == "compute"]
    a2a = [e for e in log.events if e.category == "all_to_all"]
    return {"windows": [(w.kind, [e.kind for e in events.in_flight_during(a2a, w)]) for w in windows],
            "kinds": Counter(e.kind for e in a2a), "unwaited": [e.kind for e in a2a if e.waited == 0.0]}


# ----------------------------------------------------------------------------------------------
# Tests.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks,lm", [(1, False), (2, False), (4, False), (2, True)])
def test_host_syncs_per_layer_per_step(chunks, lm):
    layers = LM["layers"] if lm else 1
    for r in pool(2).run(case_host_syncs, chunks, lm=lm):
        fwd, bwd = r["counted"]["forward"], r["counted"]["backward"]
        assert fwd.get("host_syncs") == layers * STEPS and "host_syncs" not in bwd, r  # one per layer-step, forward
        assert "scalar_reads" not in fwd and "scalar_reads" not in bwd, r
        # each dispatch / combine reads its ints from the host table, forward and backward: 2n each
        assert fwd.get("tolist") == bwd.get("tolist") == 2 * chunks * layers * STEPS, r
        assert r["calls"]["counts"] == layers * STEPS, r  # one count exchange per layer per step, whatever n
        for kind in ("dispatch", "combine", "dispatch_bwd", "combine_bwd"):
            assert r["calls"][kind] == chunks * layers * STEPS, (kind, r)


@pytest.mark.parametrize("chunks", [2, 4])
def test_backward_transfers_overlap_expert_backward(chunks):
    for r in pool(2).run(case_overlap, chunks):
        assert not r["unwaited"], r  # every all-to-all reports when it was waited
        assert r["kinds"]["combine_bwd"] == r["kinds"]["dispatch_bwd"] == chunks * STEPS, r
        bwd = [inflight for kind, inflight in r["windows"] if kind == "expert_bwd"]
        fwd = [inflight for kind, inflight in r["windows"] if kind == "expert_fwd"]
        assert len(bwd) == len(fwd) == chunks * STEPS, r
        # backward: chunk n-1's expert backward runs while the other chunks' combine-backward is in
        # flight; chunk j < n-1's while chunk j+1's dispatch-backward is
        for step in range(STEPS):
            windows = bwd[step * chunks:(step + 1) * chunks]
            assert set(windows[0]) == {"combine_bwd"} and len(windows[0]) == chunks - 1, r
            for inflight in windows[1:]:
                assert "dispatch_bwd" in inflight, r
            for j, inflight in enumerate(fwd[step * chunks:(step + 1) * chunks]):
                assert ("dispatch" in inflight) == (j < chunks - 1), r  # chunk j+1's dispatch


def test_unchunked_backward_has_nothing_to_overlap():
    for r in pool(2).run(case_overlap, 1):
        assert not r["unwaited"], r
        # only the deferred weight GEMMs (Lancet, tests/test_lancet.py) overlap: the dispatch-backward
        assert all(not inflight for kind, inflight in r["windows"] if kind != "expert_wgrad"), r
        assert [inflight for kind, inflight in r["windows"] if kind == "expert_wgrad"] == [["dispatch_bwd"]] * STEPS, r


@pytest.mark.parametrize("world,chunks", [(2, 2), (4, 2), (4, 4)])
def test_chunked_backward_bitwise(world, chunks):
    for r in pool(world).run(case_chunk_parity, chunks):
        assert r["min_rows"] >= 4, r  # the premise of bit-exactness on MKL (see moepass/schedule.py)
        assert r["out_equal"] and r["xgrad_equal"], r
        assert r["param_rel"] <= 1e-6, r


def case_expert_replicas(rank, world):
    """packing=2 at W=2 (every expert on both ranks): Plan(grad_sync="scheduler") (compile installs
    GradientSync(expert_replicas=True): dense gradients averaged, expert gradients summed by the priority
    scheduler) vs Plan(grad_sync="none") (the block's blocking gradient hook; dense: a plain all-reduce)."""
    import moepass
    from moepass.runtime import events, grad_sync
    from moepass.runtime.grads import all_reduce_replicated_grads
    from samples.models import tiny_mixtral

    def compiled(grad_sync):
        torch.manual_seed(0)
        return moepass.compile(tiny_mixtral(style="fused", **LM), moepass.Plan(
            form="ep", packing=2, a2a_chunks=2, topology=moepass.Topology(1, world), micro_op_bytes=MICRO_OP_BYTES,
            grad_sync=grad_sync))

    def grads(cm):
        return {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
                for n, p in cm.named_parameters()}

    tok = lm_tokens(world, rank, 0)
    ref = compiled("none")
    ref.loss(tok).backward()  # expert replicas: the blocking hook; dense: a plain all-reduce
    all_reduce_replicated_grads(ref)
    cm = compiled("scheduler")  # compile installs GradientSync on cm's parameters and leaves the hook out
    experts = grad_sync.expert_replica_parameters(cm)
    for name in experts:  # not the blocking hook: only GradientSync's own (its share of an accumulated gradient)
        hooks = list(cm.get_parameter(name)._backward_hooks.values())
        assert [getattr(h, "func", h) for h in hooks] == [grad_sync.share_before_accumulating], hooks
    sync = cm.moepass_grad_sync
    log = events.EventLog(rank).start()
    try:
        cm.loss(tok).backward()
    finally:
        log.stop()
        sync.close()
    want, got = grads(ref), grads(cm)
    expert_sizes = []
    for name in experts:
        local = cm.get_parameter(name).to_local()
        per = MICRO_OP_BYTES // local.element_size()
        expert_sizes += [min(per, local.numel() - s) * local.element_size() for s in range(0, local.numel(), per)]
    reduces = [e for e in log.events if e.category == "all_reduce"]
    return {"experts": sorted(experts), "dp_size": cm.layers[0].mlp.layout.groups.dp_size,
            "expert_equal": all(torch.equal(got[n], want[n]) for n in experts),
            "dense_close": all(torch.allclose(got[n], want[n], rtol=1e-6, atol=1e-8) for n in want if n not in experts),
            "reduce_sizes": sorted(e.nbytes for e in reduces), "expert_sizes": expert_sizes,
            "dense_sizes": per_tensor_micro_ops(cm, world), "max_wait": max(events.priority_waits(log.events))}


def test_expert_replica_gradients_through_the_scheduler():
    for r in pool(2).run(case_expert_replicas):
        assert r["dp_size"] == 2 and r["experts"], r
        assert r["expert_equal"] and r["dense_close"], r
        # every micro-op, dense (averaged) and expert (summed over the replicas), went through the queue
        assert r["reduce_sizes"] == sorted(r["dense_sizes"] + r["expert_sizes"]), r
        assert r["max_wait"] <= 1, r


def case_backward_twice(rank, world, chunks):
    """retain_graph: the second backward (no early transfer left to use) gives the first one's gradients."""
    cm = _compiled(world, chunks)
    x, grad = _inputs(rank, 0)
    y = cm(x)
    y.backward(grad, retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    y.backward(grad)
    return torch.equal(first, x.grad)


def test_backward_twice_with_retained_graph():
    assert all(pool(2).run(case_backward_twice, 2))
