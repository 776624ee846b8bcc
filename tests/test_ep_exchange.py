"""Expert parallel, what the all-to-all exchange moves (issue 4's must-shows):

- W=64 on the fake process group with asymmetric counts injected: the fake group does not check
  that what one rank sends is what its peer expects, so this test does, for all 64 ranks;
- 3 steps under torch.compile(aot_eager) record exactly 3x the bytes of one eager step (gloo pool of
  tests/_dist.py, W=2).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402
from test_ep import BATCH_PER_RANK, CFG, SEQ  # noqa: E402

pytestmark = pytest.mark.distributed

# ----------------------------------------------------------------------------------------------
# Tests: 3 compiled steps = 3x the bytes of one eager step.
# ----------------------------------------------------------------------------------------------


def case_compiled_bytes(rank, world, steps):
    import torch._dynamo

    import moepass
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    cm = moepass.compile(tiny_mixtral(style="loop", **CFG), moepass.Plan(form="ep", topology=moepass.Topology(1, world)))
    tokens = torch.randint(0, CFG["vocab_size"], (world * BATCH_PER_RANK, SEQ + 1),
                           generator=torch.Generator().manual_seed(3))
    mine = tokens[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]

    def step(forward):  # no optimizer step: every step routes the same way
        cm.zero_grad()
        logits = forward(mine[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())
        loss.backward()
        return loss.detach()

    moepass.reset_comm_stats()
    eager_loss = step(cm)
    eager = moepass.comm_stats()
    torch._dynamo.reset()
    compiled = torch.compile(cm, backend="aot_eager")
    moepass.reset_comm_stats()  # the first compiled step (tracing + compiling) is counted too
    losses = [step(compiled) for _ in range(steps)]
    got = moepass.comm_stats()
    torch._dynamo.reset()
    return {"eager": eager, "compiled": got, "loss_err": max((l - eager_loss).abs().item() for l in losses)}


def test_compiled_steps_record_exactly_n_times_eager_bytes():
    steps = 3
    for rank, r in enumerate(pool(2).run(case_compiled_bytes, steps, timeout=180)):
        eager, compiled = r["eager"], r["compiled"]
        assert set(eager) == set(compiled) >= {"counts", "dispatch", "combine", "dispatch_bwd", "combine_bwd"}, \
            (sorted(eager), sorted(compiled))
        for kind, entry in eager.items():
            for field, value in entry.items():
                assert compiled[kind][field] == steps * value, (rank, kind, field, compiled[kind], entry)
        assert eager["total"]["intra"] > 0 and eager["dispatch"]["calls"] == 2  # two MoE layers
        assert r["loss_err"] <= 1e-6, r["loss_err"]
        print(f"\nrank {rank}: eager step {eager['total']} -> {steps} compiled steps {compiled['total']}")


# ----------------------------------------------------------------------------------------------
# Tests: W=64 on the fake process group, asymmetric (and ragged, and empty) counts injected.
# ----------------------------------------------------------------------------------------------


def _rows_matrix(counts_PE, L):
    """M[r, p] = rows rank r sends to rank p, from every rank's per-expert counts (blocked by peer)."""
    P = counts_PE.shape[0]
    return counts_PE.view(P, P, L).sum(-1)


def _recv_counts(counts_PE, rank, L):
    """What exchange_counts delivers to `rank`: entry p*L + l = rows peer p sends to local expert l."""
    return counts_PE[:, rank * L:(rank + 1) * L].reshape(-1).clone()


def pair_mismatches(splits):
    """Every (sender, receiver, sent, expected) where the rows rank r hands all_to_all_single for peer p
    differ from the rows p expects from r; `splits[r]` = (out_splits, in_splits) of rank r's call. The
    check the fake process group does not make."""
    P = len(splits)
    return [(r, p, splits[r][1][p], splits[p][0][r]) for r in range(P) for p in range(P)
            if splits[r][1][p] != splits[p][0][r]]


def run_as_rank(gm, x, r, counts_PE, monkeypatch):
    """Simulated rank r's forward through moepass on the fake group: the count exchange delivers what an
    all_to_all_single of every rank's counts_E does (chunk p of rank r's receive is chunk r of what rank
    p sends); dispatch and combine move no data (the fake group cannot) and their (out_splits,
    in_splits), as moepass computed them, are returned in call order."""
    import torch.distributed as dist

    original = dist.all_to_all_single
    P, E = counts_PE.shape
    recorded = []

    def simulated(out, inp, out_splits=None, in_splits=None, **kw):
        out_splits, in_splits = list(out_splits), list(in_splits)
        if inp.dtype == torch.int64:  # the count exchange: E // P counts to and from every peer
            assert out_splits == in_splits == [E // P] * P, (out_splits, in_splits)
            out.copy_(counts_PE.view(P, P, E // P)[:, r].reshape(-1))
        else:
            recorded.append((out_splits, in_splits))
            out.zero_()
        return original(inp.new_empty(0), inp.new_empty(0), [0] * P, [0] * P, **kw)  # a fake Work, no data

    with monkeypatch.context() as m:
        m.setattr(dist, "all_to_all_single", simulated)
        gm(x)
    return recorded


def test_fake_pg_world_64_asymmetric_counts(monkeypatch):
    import torch.distributed as dist
    from torch.fx import Interpreter
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import moepass
    from moepass.runtime import collectives as comm
    from moepass.runtime.topology import reset_groups
    from samples.models import tiny_mixtral

    world, rank, E, D, K = 64, 13, 128, 16, 4
    L = E // world
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        torch.manual_seed(0)
        model = tiny_mixtral(style="fused", vocab_size=32, dim=D, ffn_dim=16, num_experts=E, top_k=K, layers=1)
        cm = moepass.compile(model, moepass.Plan(form="ep", topology=moepass.Topology(8, 8)))
        gm = cm.layers[0].mlp

        class _Counts(Exception):  # the Interpreter rewrites args of escaping exceptions: use an attribute
            def __init__(self, counts):
                super().__init__("counts")
                self.counts = counts

        class RouteOnly(Interpreter):  # a rank's local routing: stop at the count exchange
            def call_function(self, target, args, kwargs):
                if target is comm.EXCHANGE_COUNTS:
                    raise _Counts(args[0].clone())
                return super().call_function(target, args, kwargs)

        class Injected(Interpreter):  # this rank's step, with the counts its 63 peers would send
            def __init__(self, module, recv):
                super().__init__(module)
                self.recv = recv

            def call_function(self, target, args, kwargs):
                if target is comm.EXCHANGE_COUNTS:
                    return self.recv.clone()
                return super().call_function(target, args, kwargs)

        # every simulated rank routes its own batch: ragged sizes (some empty), skewed towards a few experts
        gen = torch.Generator().manual_seed(4)
        xs, counts = [], []
        for r in range(world):
            # (not rank 13 itself: the fake group rejects an empty input with non-zero output splits,
            # which gloo accepts — tests/test_ep_parity's rank1_no_tokens case covers it for real)
            tokens = 0 if r % 9 == 5 else 1 + (5 * r) % 11
            x = torch.randn(1, tokens, D, generator=gen) + (r % 3) * torch.randn(D, generator=gen)
            xs.append(x)
            try:
                RouteOnly(gm).run(x)
            except _Counts as c:
                counts.append(c.counts)
        counts_PE = torch.stack(counts)  # [64, E]
        M = _rows_matrix(counts_PE, L)
        assert not torch.equal(M, M.T) and (M.sum(1) == 0).any()  # asymmetric; some ranks send nothing
        assert len({tuple(row) for row in M.tolist()}) > world // 2  # and the ranks differ from each other
        assert M.sum().item() == K * sum(x.shape[1] for x in xs)
        recv_PE = torch.stack([_recv_counts(counts_PE, r, L) for r in range(world)])

        # every rank's forward through moepass (its own routing, the exchanged counts, and the split sizes
        # moepass derives from both): what each rank sends a peer is what that peer expects, for all 64
        sweep = [run_as_rank(gm, xs[r], r, counts_PE, monkeypatch) for r in range(world)]
        assert all(len(calls) == 2 for calls in sweep)  # one dispatch and one combine per rank
        dispatches, combines = [calls[0] for calls in sweep], [calls[1] for calls in sweep]
        assert pair_mismatches(dispatches) == [] and pair_mismatches(combines) == []
        assert [sends for _, sends in dispatches] == M.tolist()  # each rank sends the rows it routed per peer
        assert combines == [(sends, receives) for receives, sends in dispatches]  # and gets them back

        # rank 13's step on the fake group: the splits it hands to all_to_all_single must be row / column 13
        calls = []
        original = dist.all_to_all_single

        def spy(out, inp, out_splits=None, in_splits=None, **kw):
            calls.append((list(out_splits), list(in_splits), out.shape[0], inp.shape[0]))
            return original(out, inp, out_splits, in_splits, **kw)

        monkeypatch.setattr(dist, "all_to_all_single", spy)
        moepass.reset_comm_stats()
        out = Injected(gm, recv_PE[rank]).run(xs[rank])
        assert out.shape == xs[rank].shape
        dispatch, combine = calls[-2], calls[-1]
        sends, receives = M[rank].tolist(), M[:, rank].tolist()
        assert dispatch == (receives, sends, sum(receives), sum(sends)), dispatch
        assert combine == (sends, receives, K * xs[rank].shape[1], sum(receives)), combine
        assert sweep[rank] == [dispatch[:2], combine[:2]]  # the simulated step splits as the fake group's did
        stats = moepass.comm_stats()
        node = rank // 8
        for kind, rows in (("dispatch", sends), ("combine", receives)):
            want = {"self": rows[rank] * D * 4,
                    "intra": sum(n for p, n in enumerate(rows) if p // 8 == node and p != rank) * D * 4,
                    "inter": sum(n for p, n in enumerate(rows) if p // 8 != node) * D * 4}
            assert {k: stats[kind][k] for k in want} == want, (kind, stats[kind], want)

        # a mismatch the fake group lets through: rank 5 claims to send one more row to rank 13 than it
        # does. The step still "runs"; against the other ranks' splits, the pairwise check names the pair.
        bad = recv_PE.clone()
        bad[rank, 5 * L] += 1
        calls.clear()
        Injected(gm, bad[rank]).run(xs[rank])  # no error from the fake group
        assert calls[0][0][5] == receives[5] + 1
        bad_dispatches = [*dispatches[:rank], calls[0][:2], *dispatches[rank + 1:]]
        assert pair_mismatches(bad_dispatches) == [(5, rank, receives[5], receives[5] + 1)]
        # ... and what moepass itself refuses: counts that send more rows than x has, or a short output
        group = gm.layout.groups.ep_group.group_name
        send = torch.zeros(E, dtype=torch.int64)
        send[0] = 4
        with pytest.raises(ValueError, match="counts send 4 rows, x has 3"):
            comm.ALL_TO_ALL(torch.randn(3, D), send, send, group, "dispatch", -1)
        with pytest.raises(ValueError, match="out_rows=2 < 4 rows received"):
            comm.ALL_TO_ALL(torch.randn(4, D), send, send, group, "combine", 2)
        with pytest.raises(ValueError, match="do not split over 64 ranks"):
            comm.EXCHANGE_COUNTS(torch.zeros(E + 1, dtype=torch.int64), group)
    finally:
        dist.destroy_process_group()
        reset_groups()

