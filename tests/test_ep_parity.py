"""Expert parallel parity, must-shows of issue 4 (gloo pools of tests/_dist.py, W=2 and W=4):

- parity of Hugging Face Mixtral, Qwen2-MoE (shared expert) and DeepSeek-V3 (group-limited routing,
  first layer dense) with the single-process reference, at W=2, W=4 on 2 nodes and W=4 with ep_size=2;
- routing edge cases at W=2: every token to one expert, zero rows arriving at a rank, ragged token
  counts per rank (including a rank with no tokens at all);
- capacity: EP applies it per (source rank, expert) — equal to the per-rank-batch reference and
  provably different from a global-batch capacity on a routing where the two disagree.

The exchange itself (W=64 on the fake group, compiled-step bytes) is tests/test_ep_exchange.py; bad
plans and lost peers are tests/test_ep_failures.py. The reference convention is tests/test_ep.py's (its
helpers are imported, not copied): one process runs the original module on the concatenation of all
ranks' batches with the global mean loss; EP rank r takes slice r; expert gradients follow DDP's
convention (gradient of the mean of the ranks' local losses). fp32, rtol 1e-5.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402
from test_ep import ATOL, RTOL, _max_err, _reference_with_capacity, local_logical_grads  # noqa: E402

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

