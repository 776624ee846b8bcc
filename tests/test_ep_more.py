"""Expert parallel, the remaining must-shows of issue 4 (gloo pools of tests/_dist.py, W=2 and W=4):

- parity of Hugging Face Mixtral, Qwen2-MoE (shared expert) and DeepSeek-V3 (group-limited routing,
  first layer dense) with the single-process reference, at W=2, W=4 on 2 nodes and W=4 with ep_size=2;
- routing edge cases at W=2: every token to one expert, zero rows arriving at a rank, ragged token
  counts per rank (including a rank with no tokens at all);
- capacity: EP applies it per (source rank, expert) — equal to the per-rank-batch reference and
  provably different from a global-batch capacity on a routing where the two disagree;
- W=64 on the fake process group with asymmetric counts injected: the fake group does not check
  that what one rank sends is what its peer expects, so this test does, for all 64 ranks;
- 3 steps under torch.compile(aot_eager) record exactly 3x the bytes of one eager step;
- bad input: E not divisible by ep_size, plan / world mismatches, a rank killed mid-step (the
  survivor raises within the topology's timeout; that pool is discarded, the shared one unaffected).

The reference convention is tests/test_ep.py's (its helpers are imported, not copied): one process
runs the original module on the concatenation of all ranks' batches with the global mean loss; EP
rank r takes slice r; expert gradients follow DDP's convention (gradient of the mean of the ranks'
local losses). fp32, rtol 1e-5.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import Pool, pool  # noqa: E402
from test_ep import ATOL, BATCH_PER_RANK, CFG, RTOL, SEQ, _max_err, _reference_with_capacity, local_logical_grads  # noqa: E402

pytestmark = pytest.mark.distributed

HF_BATCH_PER_RANK = 2


# ----------------------------------------------------------------------------------------------
# Helpers that run inside the ranks.
# ----------------------------------------------------------------------------------------------


def _compare_grads(cm, ref, report):
    """Every gradient this rank holds (logical names) against the reference's; unused experts: zero."""
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    ref_params = dict(ref.named_parameters())
    grads = local_logical_grads(cm)
    assert set(grads) <= set(ref_grads), set(grads) - set(ref_grads)
    for name, (g, rows) in grads.items():
        want = ref_grads[name]
        want = torch.zeros_like(ref_params[name]) if want is None else want
        want = want if rows is None else want[rows]
        torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
        report["grad"] = max(report["grad"], _max_err(g, want))
    missing = {n for n, g in ref_grads.items() if g is not None} - set(grads)
    assert all(".experts." in n for n in missing), sorted(missing)[:5]  # other ranks' stacked experts
    report["grads"] = len(grads)


def case_hf_parity(rank, world, family, ep_size=None, nodes=1, form="ep", **plan_kw):
    """An HF causal LM under a distributed form (EP by default) vs the original on the global batch: loss,
    logits, every gradient."""
    import moepass
    from moepass.runtime.grads import all_reduce_replicated_grads
    from samples import hf_models as H

    model, _ = H.build(family)
    plan = moepass.Plan(form=form, ep_size=ep_size, topology=moepass.Topology(nodes, world // nodes), **plan_kw)
    cm = moepass.compile(model, plan)
    forms = {p: gm.form for p, gm in cm.moepass_info.rewritten.items()}
    gen = torch.Generator().manual_seed(21)
    ids = torch.randint(1, H.VOCAB, (world * HF_BATCH_PER_RANK, H.SEQ), generator=gen)
    labels = torch.randint(1, H.VOCAB, ids.shape, generator=gen)  # no ignored labels: equal token counts
    mine = slice(rank * HF_BATCH_PER_RANK, (rank + 1) * HF_BATCH_PER_RANK)

    ref = model(input_ids=ids, labels=labels)
    ref.loss.backward()
    out = cm(input_ids=ids[mine], labels=labels[mine])
    out.loss.backward()
    all_reduce_replicated_grads(cm)
    global_loss = out.loss.detach().clone()
    torch.distributed.all_reduce(global_loss)
    global_loss /= world
    torch.testing.assert_close(global_loss, ref.loss.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out.logits, ref.logits[mine], rtol=RTOL, atol=ATOL)
    report = {"loss": abs(global_loss.item() - ref.loss.item()), "out": _max_err(out.logits, ref.logits[mine]),
              "grad": 0.0, "forms": forms}
    _compare_grads(cm, model, report)
    return report


class Wrap(torch.nn.Module):
    """A one-block model (the block at path "moe", so capacity references can be rebuilt by path)."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return self.moe(x)


def _routed(D, E, top_k, favourite=None, second=None):
    """A LoopMoE (random router); with `favourite`, inputs with x[:, 0] = 2 pick it first everywhere
    (and `second` second): logits 10 / 8 against O(0.1) for the others."""
    from samples.models import LoopMoE

    block = LoopMoE(D, 2 * D, E, top_k=top_k)
    with torch.no_grad():
        block.gate.weight.mul_(0.1)
        if favourite is not None:
            block.gate.weight[:, 0] = 0.0
            block.gate.weight[favourite, 0] = 5.0
            if second is not None:
                block.gate.weight[second, 0] = 4.0
    return Wrap(block)


SCENARIOS = {
    # name: (E, top_k, favourite, second, tokens per rank)
    "one_expert": (4, 1, 0, None, [6, 6]),  # every token of every rank to expert 0: rank 1 receives 0 rows
    "zero_rows_at_rank1": (4, 2, 1, 0, [6, 6]),  # top-2 = {1, 0}, both on rank 0; rank 1 only sends
    "ragged": (4, 2, None, None, [3, 13]),  # ranks with different token counts, random routing
    "rank1_no_tokens": (4, 2, None, None, [7, 0]),  # rank 1 has an empty batch this step
    "one_expert_on_last_rank": (4, 1, 3, None, [5, 9]),  # ragged + everything to rank 1's expert 3
}


def _block_inputs(world, D, tokens, favourite):
    gen = torch.Generator().manual_seed(5)
    xs, gs = [], []
    for r in range(world):
        x = torch.randn(tokens[r], D, generator=gen)
        if favourite is not None:
            x[:, 0] = 2.0
        xs.append(x)
        gs.append(torch.randn(tokens[r], D, generator=gen))  # loss_r = sum(y_r * g_r)
    return xs, gs


def case_block_parity(rank, world, scenario, capacity_factor=None, D=16):
    """One EP block on a scripted routing vs the original on the concatenated batch (or, with a
    capacity, vs the per-rank reference), plus how far the global-batch capacity reference is."""
    import moepass
    from moepass.runtime.grads import all_reduce_replicated_grads

    E, top_k, favourite, second, tokens = SCENARIOS[scenario]
    torch.manual_seed(0)
    model = _routed(D, E, top_k, favourite, second)
    plan = moepass.Plan(form="ep", capacity_factor=capacity_factor, topology=moepass.Topology(1, world))
    cm = moepass.compile(model, plan)
    xs, gs = _block_inputs(world, D, tokens, favourite)
    lo = sum(tokens[:rank])
    mine = slice(lo, lo + tokens[rank])

    x = xs[rank].clone().requires_grad_()
    moepass.reset_comm_stats()
    y = cm(x)
    (y * gs[rank]).sum().backward()
    stats = moepass.comm_stats()
    all_reduce_replicated_grads(cm)

    def reference(ref, batches):
        """The reference on `batches` (lists of per-rank slices run separately), loss = mean of ranks'."""
        ref.zero_grad()
        x_all = torch.cat(xs).requires_grad_()
        ys, start = [], 0
        for b in batches:
            n = sum(tokens[r] for r in b)
            ys.append(ref(x_all[start:start + n]))
            start += n
        y_all = torch.cat(ys)
        (y_all * torch.cat(gs)).sum().div(world).backward()
        return y_all, x_all.grad

    report = {"grad": 0.0, "tokens": tokens[rank]}
    if capacity_factor is None:
        y_ref, gx_ref = reference(model, [list(range(world))])
    else:
        per_rank = _reference_with_capacity(model, plan)
        y_ref, gx_ref = reference(per_rank, [[r] for r in range(world)])
        global_ref = _reference_with_capacity(model, plan)
        y_glob, _ = reference(global_ref, [list(range(world))])
        report["global_diff"] = _max_err(y, y_glob[mine].detach())
        model = per_rank
    torch.testing.assert_close(y, y_ref[mine], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(x.grad / world, gx_ref[mine], rtol=RTOL, atol=ATOL)
    report["out"] = _max_err(y, y_ref[mine])
    report["x_grad"] = _max_err(x.grad / world, gx_ref[mine])
    _compare_grads(cm, model, report)
    report["dispatch_rows_sent"] = sum(stats.get("dispatch", {}).get(k, 0) for k in ("self", "intra")) // (D * 4)
    # rows this rank received in the dispatch = rows it sends back in the combine
    report["dispatch_rows_received"] = sum(stats.get("combine", {}).get(k, 0) for k in ("self", "intra")) // (D * 4)
    return report


# ----------------------------------------------------------------------------------------------
# Tests: Hugging Face families.
# ----------------------------------------------------------------------------------------------

HF_CASES = [  # (family, world, nodes, ep_size)
    ("mixtral", 2, 1, None),
    ("qwen2_moe", 2, 1, None),
    ("deepseek_v3", 2, 1, None),
    ("deepseek_v3", 4, 2, None),  # 2 nodes x 2 ranks, L = 2
    ("qwen2_moe", 4, 2, 2),  # DP x EP: E = 6 does not split over 4, it does over ep_size 2
]


@pytest.mark.parametrize("family,world,nodes,ep_size", HF_CASES,
                         ids=[f"{f}-W{w}" + (f"-ep{e}" if e else "") for f, w, _, e in HF_CASES])
def test_hf_family_parity(family, world, nodes, ep_size):
    pytest.importorskip("transformers")
    reports = pool(world).run(case_hf_parity, family, ep_size=ep_size, nodes=nodes, timeout=180)
    for r in reports:
        assert set(r["forms"].values()) == {"ep"} and len(r["forms"]) == 2, r["forms"]
    worst = {k: max(r[k] for r in reports) for k in ("loss", "out", "grad")}
    print(f"\n{family} W={world} ep_size={ep_size}: max errors {worst}")


# ----------------------------------------------------------------------------------------------
# Tests: routing edge cases at W=2 (E=4, L=2: experts 0-1 on rank 0, 2-3 on rank 1).
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_routing_edge_case_parity(scenario):
    reports = pool(2).run(case_block_parity, scenario, timeout=60)
    E, top_k, favourite, _, tokens = SCENARIOS[scenario]
    for rank, r in enumerate(reports):
        assert r["tokens"] == tokens[rank]
        assert r["out"] <= 1e-5 and r["grad"] <= 1e-5, (rank, r)
    sent = [r["dispatch_rows_sent"] for r in reports]
    received = [r["dispatch_rows_received"] for r in reports]
    assert sum(sent) == sum(received) == top_k * sum(tokens), (sent, received)
    if favourite is not None:  # all rows land on the favourite's rank, none on the other
        owner = favourite // 2
        assert received[owner] == top_k * sum(tokens) and received[1 - owner] == 0, received
    print(f"\n{scenario} tokens={tokens}: max errors out {max(r['out'] for r in reports):.2e} "
          f"x_grad {max(r['x_grad'] for r in reports):.2e} grad {max(r['grad'] for r in reports):.2e}; "
          f"rows sent {sent} received {received}")


# ----------------------------------------------------------------------------------------------
# Tests: capacity is per (source rank, expert), not global.
# ----------------------------------------------------------------------------------------------


def test_capacity_is_per_rank_not_global():
    """Every token of both ranks picks expert 0 (top-1, E=4, 6 tokens per rank, capacity_factor 1):
    per rank C = ceil(6/4) = 2, so each rank keeps its first 2 tokens; a global capacity over the
    12 concatenated tokens (C = 3) would keep rank 0's first 3 and none of rank 1's. EP equals the
    per-rank-batch reference (outputs, input and parameter gradients) and differs from the global one."""
    reports = pool(2).run(case_block_parity, "one_expert", capacity_factor=1.0, timeout=60)
    for rank, r in enumerate(reports):
        assert r["out"] <= 1e-5 and r["grad"] <= 1e-5, (rank, r)
        assert r["global_diff"] > 1e-2, (rank, r)  # rank 0: its 3rd token; rank 1: all its kept tokens
    # only kept assignments travel: 2 per rank, all to rank 0
    assert [r["dispatch_rows_sent"] for r in reports] == [2, 2]
    assert [r["dispatch_rows_received"] for r in reports] == [4, 0]
    print(f"\nper-rank capacity: max error {max(r['out'] for r in reports):.2e}; distance to a global capacity "
          f"{[round(r['global_diff'], 3) for r in reports]}")


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
            # which gloo accepts — tests/test_ep_more's rank1_no_tokens case covers it for real)
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


# ----------------------------------------------------------------------------------------------
# Tests: bad input.
# ----------------------------------------------------------------------------------------------


def case_bad_plans(rank, world):
    """The PlanError message of each bad plan (every rank raises the same one, nobody hangs)."""
    import moepass
    from moepass.errors import PlanError

    messages = {}
    attempts = {
        "experts_not_divisible": (3, moepass.Plan(form="ep", topology=moepass.Topology(1, world))),
        "ep_size_not_dividing_world": (4, moepass.Plan(form="ep", ep_size=3, topology=moepass.Topology(1, world))),
        "topology_world_mismatch": (4, moepass.Plan(form="ep", topology=moepass.Topology(2, 2))),
    }
    for name, (E, plan) in attempts.items():
        torch.manual_seed(0)
        try:
            moepass.compile(_routed(8, E, 1), plan)
        except PlanError as err:
            messages[name] = str(err)
        else:
            messages[name] = None
    return messages


def test_bad_plans_raise_clear_errors():
    messages = pool(2).run(case_bad_plans, timeout=60)
    assert messages[0] == messages[1]
    m = messages[0]
    assert m["experts_not_divisible"] is not None and all(
        s in m["experts_not_divisible"] for s in ("Plan.ep_size=None (the world size, 2)", "block moe", "3 experts",
                                                 "dividing both 3 and the world size 2", "valid: [1]",
                                                 "Plan(blocks={'moe': None})")), m["experts_not_divisible"]
    assert m["ep_size_not_dividing_world"] == "Plan.ep_size=3 is invalid: it must divide the world size 2."
    assert m["topology_world_mismatch"] is not None and all(
        s in m["topology_world_mismatch"] for s in ("Plan.topology=Topology(nodes=2, ranks_per_node=2",
                                                   "4 ranks but the world has 2", "nodes*ranks_per_node=2"))


def case_peer_lost_before_combine(rank, world, how, timeout_s, path=None):
    """Rank 1 runs the dispatch, then either dies (`os._exit`) or never issues the combine (returns);
    rank 0 runs a normal step and must raise within the topology's timeout."""
    import json
    import time

    from torch.fx import Interpreter

    import moepass
    from moepass.runtime import collectives as comm

    case_start = time.monotonic()
    torch.manual_seed(0)
    cm = moepass.compile(_routed(8, 4, 2), moepass.Plan(form="ep", topology=moepass.Topology(1, world,
                                                                                               timeout=timeout_s)))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    if rank == 1:
        class StopBeforeCombine(Interpreter):
            def call_function(self, target, args, kwargs):
                if target is comm.ALL_TO_ALL and args[4] == "combine":
                    if how == "killed":
                        os._exit(3)
                    raise StopIteration
                return super().call_function(target, args, kwargs)

        try:
            StopBeforeCombine(cm.moe).run(x)
        except StopIteration:
            return None
    start = time.monotonic()
    result = {"raised": None}
    try:
        cm(x).sum().backward()
    except Exception as err:
        result = {"raised": type(err).__name__, "message": str(err)[:800]}
    result["seconds"] = time.monotonic() - start
    result["case_seconds"] = time.monotonic() - case_start
    if path:
        with open(path, "w") as f:
            json.dump(result, f)
    return result


def test_peer_stops_before_combine_raises_within_timeout():
    """Rank 1 stops before the combine (alive, never joins): rank 0 gets a timeout error; the pool is fine."""
    timeout_s = 2.5  # a timeout no other test uses: the abandoned EP group is never reused
    result = pool(2).run(case_peer_lost_before_combine, "stalled", timeout_s, timeout=60)[0]  # a hang: fails at 60 s
    assert result["raised"] is not None and "Timed out" in result["message"], result
    assert "waiting 2500ms" in result["message"], result  # the topology's timeout fired, not gloo's 60 s default


def _ping(rank, world):
    import torch.distributed as dist

    import moepass  # noqa: F401  (a fresh pool's first case pays the import)

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def test_rank_killed_mid_step_raises_within_timeout(tmp_path):
    """Rank 1 `os._exit`s between dispatch and combine. On a dedicated pool (a killed rank breaks its
    pool): rank 0 raises within the timeout, the pool is discarded (no process left), and the shared
    W=2 pool still works."""
    timeout_s, path = 5.0, str(tmp_path / "rank0.json")
    victim = Pool(2)
    try:
        assert victim.run(_ping, timeout=120) == [3.0, 3.0]  # workers up, moepass imported
        with pytest.raises(TimeoutError, match=r"ranks \[1\]"):  # rank 1 never reports: the pool gives up
            victim.run(case_peer_lost_before_combine, "killed", timeout_s, path=path, timeout=10)
        assert victim.broken
    finally:
        victim.kill()
    assert not any(p.is_alive() for p in victim.procs)
    for q in (victim.results, *victim.tasks):
        q.close()
    import json

    assert os.path.exists(path), "rank 0 did not return before the pool killed it (10 s): it hung"
    with open(path) as f:
        result = json.load(f)
    # rank 0 wrote its result, so it returned before the pool gave up on rank 1 (10 s) and killed it: it
    # raised and did not hang (gloo words the lost peer differently from run to run: closed, reset, timed out)
    assert result["raised"] is not None, result
    print(f"\nrank 0 raised {result['raised']} after {result['seconds']:.2f} s (case {result['case_seconds']:.1f} s): "
          f"{result['message'][:120]}")
    assert pool(2).run(_ping) == [3.0, 3.0]  # the session's pool was never involved
