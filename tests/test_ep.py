"""Expert parallel under gloo: exact parity with the single-process reference, byte counters,
clip_grad_norm_, timeouts, DDP; plus the EP graph at world size 64 on the fake process group.

The parity reference: one process runs the original model on the concatenation of all ranks'
batches with the global mean loss; EP rank r takes slice r. Expert gradients follow DDP's convention
(gradient of the mean of the ranks' local losses), so they compare directly with the reference.
With capacity in effect (the GShard sample's own per-batch capacity, or `Plan(capacity_factor=…)`),
moepass's EP applies capacity per (source rank, expert): the reference then runs the model (with the
same capacity semantics) on each rank's slice and averages the W losses.

Cases run on one spawned pool per world size (`tests/_dist.py`); each case is `case_*(rank, world, …)`.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import fake_process_group, fake_values, pool  # noqa: E402

pytestmark = pytest.mark.distributed

CFG = dict(vocab_size=64, dim=32, ffn_dim=64, num_experts=8, top_k=2, layers=2, heads=4)
BATCH_PER_RANK, SEQ = 2, 8
RTOL, ATOL = 1e-5, 1e-6


# ----------------------------------------------------------------------------------------------
# Helpers that run inside the ranks.
# ----------------------------------------------------------------------------------------------


def _reference_with_capacity(model, plan):
    """A single-device copy of `model` whose blocks apply the capacity the EP plan applies per rank."""
    import copy

    import moepass
    from moepass import canonical
    from moepass.rewrite.ep import ep_capacity

    ref = copy.deepcopy(model)
    for spec in moepass.detect(model).blocks:
        spec = spec.replace(capacity=ep_capacity(spec, plan))
        ref.set_submodule(spec.path, canonical.build(spec, ref.get_submodule(spec.path)))
    return ref


def local_logical_grads(cm):
    """{original name: (this rank's gradient, rows of the original tensor it covers or None)}."""
    import moepass

    return moepass.logical_grads(cm)


def local_logical_params(cm):
    """{original name: (this rank's part of the parameter, its index in the original tensor or None)}."""
    import moepass

    grads = moepass.logical_grads(cm)
    values = moepass.logical_state_dict(cm)
    out = {}
    for name, (_, index) in grads.items():
        value = values[name]
        out[name] = (value.to_local() if hasattr(value, "to_local") else value).detach(), index
    return out


def _max_err(a, b):
    return (a - b).abs().max().item() if a.numel() else 0.0


def case_parity(rank, world, style, ep_size=None, capacity_factor=None, nodes=1, steps=1, form="ep", optimizer="sgd",
                hold_group=False, **plan_kw):
    """A distributed form (EP by default) vs the single-process reference: loss, outputs, every gradient,
    global grad norm, parameters after each optimizer step; per step. `hold_group`: the model, its layers and
    their MoE blocks hold the world's process group (an attribute), which the compiled copy shares."""
    import moepass
    from moepass.runtime.grads import all_reduce_replicated_grads, clip_grad_norm_
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    model = tiny_mixtral(style=style, **CFG)
    group = torch.distributed.group.WORLD
    if hold_group:
        model.group = group
        for layer in model.layers:
            layer.group = layer.mlp.group = group
    plan = moepass.Plan(form=form, ep_size=ep_size, capacity_factor=capacity_factor,
                        topology=moepass.Topology(nodes, world // nodes), **plan_kw)
    cm = moepass.compile(model, plan)
    if hold_group:
        assert cm.group is group and all(layer.group is group for layer in cm.layers)
        assert sorted(cm.moepass_info.rewritten) == [f"layers.{i}.mlp" for i in range(len(model.layers))]
    per_rank = capacity_factor is not None or style == "gshard"  # capacity is per (source rank, expert)
    ref = _reference_with_capacity(model, plan) if per_rank else model
    make_opt = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1), "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2)}
    opt, ref_opt = make_opt[optimizer](cm.parameters()), make_opt[optimizer](ref.parameters())
    report = {"loss": 0.0, "out": 0.0, "grad": 0.0, "norm": 0.0, "param": 0.0, "losses": []}
    for step in range(steps):
        tokens = torch.randint(0, CFG["vocab_size"], (world * BATCH_PER_RANK, SEQ + 1),
                               generator=torch.Generator().manual_seed(100 + step))
        mine = tokens[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]
        # reference
        ref.zero_grad()
        if per_rank:
            slices = tokens.split(BATCH_PER_RANK)
            ref_loss = sum(ref.loss(s) for s in slices) / world
            ref_out = ref(mine[:, :-1])
        else:
            ref_loss = ref.loss(tokens)
            ref_out = ref(tokens[:, :-1])[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]
        ref_loss.backward()
        # EP
        opt.zero_grad()
        out = cm(mine[:, :-1])
        loss = cm.loss(mine)
        loss.backward()
        all_reduce_replicated_grads(cm)
        global_loss = loss.detach().clone()
        torch.distributed.all_reduce(global_loss)
        global_loss /= world
        torch.testing.assert_close(global_loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        grads = local_logical_grads(cm)
        assert set(grads) <= set(ref_grads), set(grads) - set(ref_grads)
        covered = set(grads)
        for name, (g, rows) in grads.items():
            want = ref_grads[name] if rows is None else ref_grads[name][rows]
            torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
            report["grad"] = max(report["grad"], _max_err(g, want))
        missing = {n for n, g in ref_grads.items() if g is not None} - covered
        # stacked experts owned by other ranks are the only reference gradients this rank lacks
        assert all(".experts." in n for n in missing), sorted(missing)[:5]
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1.0)
        norm = clip_grad_norm_(cm.parameters(), max_norm=1.0)  # torch's, under implicit_replication
        torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=ATOL)
        opt.step()
        ref_opt.step()
        ref_params = dict(ref.named_parameters())
        # Adam divides by sqrt(v): summation-order noise in a near-zero gradient moves a weight by up to a
        # fraction of lr (1e-2), so its parameters compare to 1% of lr; SGD's to the gradient tolerance
        p_atol = 1e-4 if optimizer == "adam" else ATOL
        for name, (value, index) in local_logical_params(cm).items():  # the optimizer step, shard by shard
            want = ref_params[name].detach()[index or slice(None)]
            torch.testing.assert_close(value, want, rtol=RTOL, atol=p_atol, msg=lambda m, n=name: f"{n}: {m}")
            report["param"] = max(report["param"], _max_err(value, want))
        report["loss"] = max(report["loss"], abs(global_loss.item() - ref_loss.item()))
        report["out"] = max(report["out"], _max_err(out, ref_out))
        report["norm"] = max(report["norm"], abs(norm.item() - ref_norm.item()))
        report["losses"].append((global_loss.item(), ref_loss.item()))
    report["forms"] = sorted({gm.form for gm in cm.moepass_info.rewritten.values()})
    report["chunks"] = sorted({h["stats"].get("chunks") for gm in cm.moepass_info.rewritten.values()
                               for h in gm.history if h["pass"] == "schedule"})
    return report


def fixed_routing(rank, tokens, E):
    """The (first, second) expert of each token of `rank` in the byte-count test."""
    return [((3 * rank + t) % E, (3 * rank + 2 * t + 1) % E) for t in range(tokens)]


def case_bytes(rank, world, nodes, tokens, D, E):
    """One forward+backward of a block with a fixed routing; this rank's counters."""
    import moepass
    from samples.models import routed_loop_moe

    torch.manual_seed(0)
    block = routed_loop_moe(D, E)
    cm = moepass.compile(block, moepass.Plan(form="ep", topology=moepass.Topology(nodes, world // nodes)))
    x = torch.zeros(tokens, D)
    for t, (a, b) in enumerate(fixed_routing(rank, tokens, E)):
        x[t, a], x[t, b] = 1.0, 0.9
    moepass.reset_comm_stats()
    y = cm(x.requires_grad_())
    y.sum().backward()
    return moepass.comm_stats()


def case_timeout(rank, world, seconds):
    """Rank 1 never joins an all-to-all on a short-timeout group: rank 0 must get an error, not hang."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    import moepass
    from moepass.runtime import collectives as comm
    from moepass.runtime.topology import register_group

    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=seconds))
    register_group(group, moepass.Topology(1, world))
    if rank != 0:
        return None
    counts = torch.ones(world * 2, dtype=torch.int64)
    start = time.monotonic()
    try:
        comm.WAIT(comm.ALL_TO_ALL(torch.randn(world * 2, 4), counts, counts, group.group_name, "dispatch", -1))
    except Exception as err:
        return {"raised": type(err).__name__, "seconds": time.monotonic() - start, "message": str(err)[:800]}
    return {"raised": None, "seconds": time.monotonic() - start}


def case_ddp(rank, world, style):
    """DDP over the compiled model: expert parameters are excluded; gradients match the reference."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import moepass
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    model = tiny_mixtral(style=style, **CFG)
    cm = moepass.compile(model, moepass.Plan(form="ep", topology=moepass.Topology(1, world)))
    ddp = DDP(cm)
    tokens = torch.randint(0, CFG["vocab_size"], (world * BATCH_PER_RANK, SEQ + 1),
                           generator=torch.Generator().manual_seed(7))
    mine = tokens[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]
    logits = ddp(mine[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), mine[:, 1:].reshape(-1))
    loss.backward()
    model.loss(tokens).backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    worst = 0.0
    for name, (g, rows) in local_logical_grads(cm).items():
        want = ref_grads[name] if rows is None else ref_grads[name][rows]
        torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL)
        worst = max(worst, _max_err(g, want))
    ignored = sorted(getattr(cm, "_ddp_params_and_buffers_to_ignore", []))
    return {"grad": worst, "ignored": len(ignored)}


# ----------------------------------------------------------------------------------------------
# Tests.
# ----------------------------------------------------------------------------------------------

STYLES = ["loop", "fused", "gshard"]


@pytest.mark.parametrize("style", STYLES)
def test_parity_w2(style):
    reports = pool(2).run(case_parity, style)
    assert reports[0]["forms"] == ["ep"]
    assert max(r["grad"] for r in reports) < 1e-4


def test_parity_w2_with_a_process_group_in_the_model():
    """The model and its MoE blocks hold the process group: detected, compiled under EP (the copy shares the
    group), exact parity."""
    reports = pool(2).run(case_parity, "loop", hold_group=True)
    assert all(r["forms"] == ["ep"] for r in reports)


@pytest.mark.parametrize("style", STYLES)
def test_parity_w4_two_nodes(style):
    reports = pool(4).run(case_parity, style, nodes=2)
    assert max(r["loss"] for r in reports) < 1e-5


@pytest.mark.parametrize("world,style", [(2, "loop"), (4, "fused")])
def test_parity_capacity_mode(world, style):
    pool(world).run(case_parity, style, capacity_factor=1.0)


@pytest.mark.parametrize("style", ["loop", "gshard"])
def test_parity_dp_x_ep(style):
    """ep_size=2 on 4 ranks: experts replicated over the dp dim, their gradients reduced over it."""
    pool(4).run(case_parity, style, ep_size=2, nodes=2)


def test_parity_three_steps():
    reports = pool(2).run(case_parity, "loop", steps=3)
    for ep_loss, ref_loss in reports[0]["losses"]:
        assert math.isclose(ep_loss, ref_loss, rel_tol=1e-5)


def test_ddp_excludes_experts():
    reports = pool(2).run(case_ddp, "fused")
    assert reports[0]["ignored"] == 2 * 2  # w_gate_up and w_down in each of 2 blocks


def expected_bytes(world, nodes, tokens, D, E):
    """Analytic dispatch bytes per rank and link for `fixed_routing`: rows to each peer × D × 4."""
    per_node, L = world // nodes, E // world
    out = []
    for rank in range(world):
        sent = {"self": 0, "intra": 0, "inter": 0}
        for pair in fixed_routing(rank, tokens, E):
            for e in pair:
                peer = e // L
                link = "self" if peer == rank else ("intra" if peer // per_node == rank // per_node else "inter")
                sent[link] += D * 4
        received = {"self": 0, "intra": 0, "inter": 0}  # combine sends back what dispatch received
        for src in range(world):
            for pair in fixed_routing(src, tokens, E):
                for e in pair:
                    if e // L == rank:
                        link = "self" if src == rank else ("intra" if src // per_node == rank // per_node else "inter")
                        received[link] += D * 4
        out.append((sent, received))
    return out


def test_bytes_match_analytic_count():
    world, nodes, tokens, D, E = 4, 2, 6, 16, 8
    stats = pool(world).run(case_bytes, nodes, tokens, D, E)
    for rank, ((sent, received), s) in enumerate(zip(expected_bytes(world, nodes, tokens, D, E), stats)):
        for link in ("self", "intra", "inter"):
            assert s["dispatch"][link] == sent[link], (rank, link, s["dispatch"], sent)
            assert s["combine"][link] == received[link], (rank, link, s["combine"], received)
            assert s["combine_bwd"][link] == sent[link]  # the reverse of combine: same rows as dispatch
            assert s["dispatch_bwd"][link] == received[link]
        assert s["counts"]["inter"] == 2 * (E // world) * 8  # 2 peers on the other node, L int64 counts each
        assert s["dispatch"]["calls"] == 1


def test_dead_peer_times_out():
    result = pool(2).run(case_timeout, 2.0, timeout=60)[0]  # a hang fails the run after 60 s
    assert result["raised"] is not None and "Timed out" in result["message"], result
    assert "waiting 2000ms" in result["message"], result  # the group's 2 s timeout fired, not gloo's default
    assert result["message"].startswith("moepass: the 'dispatch' collective on process group "), result  # named


# ----------------------------------------------------------------------------------------------
# World size 64 on the fake process group: graph and shapes only.
# ----------------------------------------------------------------------------------------------


def test_fake_pg_world_64_graph_and_shapes():
    from torch.distributed.tensor import DTensor

    import moepass
    from moepass.runtime import collectives as comm
    from samples.models import tiny_mixtral

    world, rank, E = 64, 13, 128
    with fake_process_group(world, rank):
        torch.manual_seed(0)
        model = tiny_mixtral(style="fused", vocab_size=32, dim=16, ffn_dim=16, num_experts=E, top_k=4, layers=1)
        cm = moepass.compile(model, moepass.Plan(form="ep", topology=moepass.Topology(8, 8)))
        gm = cm.layers[0].mlp
        assert gm.form == "ep" and gm.layout.first_expert == rank * 2
        w = gm.w_gate_up
        assert isinstance(w, DTensor) and w.shape == (E, 16, 32) and w.to_local().shape == (2, 16, 32)
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert targets.count(comm.ALL_TO_ALL) == 2 and targets.count(comm.WAIT) == 3
        assert all(n.meta["moepass"]["pass"] == "ep" for n in gm.graph.nodes
                   if n.op == "call_function" and n.target in (comm.ALL_TO_ALL, comm.WAIT, comm.EXCHANGE_COUNTS))
        # shapes with unbacked row counts (a ShapeEnv lets the fakes create them)
        by_name = fake_values(gm, torch.randn(2, 5, 16))
        assert by_name["x_RD"].shape[1] == 16 and not isinstance(by_name["x_RD"].shape[0], int)
        assert by_name["y_ND_combined"].shape == (40, 16) and by_name["out"].shape == (2, 5, 16)
        # splits: per-peer sums of E counts blocked by peer
        send = torch.arange(E, dtype=torch.int64)
        recv = torch.ones(E, dtype=torch.int64)
        s, r = comm.split_sizes(send, recv, world)
        assert s == [4 * p + 1 for p in range(world)] and r == [2] * world
        assert all(type(v) is int for v in s + r)


def case_fsdp(rank, world, style):
    """FSDP2 over the compiled model with the experts ignored: gradients and global norm match."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import moepass
    from moepass.runtime.grads import clip_grad_norm_
    from moepass.runtime.layout import expert_parameter_names
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    model = tiny_mixtral(style=style, **CFG)
    cm = moepass.compile(model, moepass.Plan(form="ep", topology=moepass.Topology(1, world)))
    experts = {cm.get_parameter(n) for n in expert_parameter_names(cm)}
    plain_names = {n for n, p in cm.named_parameters() if p not in experts}
    fully_shard(cm, ignored_params=experts)
    tokens = torch.randint(0, CFG["vocab_size"], (world * BATCH_PER_RANK, SEQ + 1),
                           generator=torch.Generator().manual_seed(9))
    cm.loss(tokens[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]).backward()
    model.loss(tokens).backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    worst = 0.0
    for name, (g, rows) in local_logical_grads(cm).items():
        if name in plain_names:  # FSDP-sharded: gather to compare
            g = cm.get_parameter(name).grad.full_tensor()
        want = ref_grads[name] if rows is None else ref_grads[name][rows]
        torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL)
        worst = max(worst, _max_err(g, want))
    norm = clip_grad_norm_(cm.parameters(), max_norm=1.0)
    ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=ATOL)
    assert all(isinstance(cm.get_parameter(n), DTensor) for n in plain_names)  # FSDP did shard them
    return {"grad": worst}


def test_fsdp2_with_experts_ignored():
    pool(2).run(case_fsdp, "fused")
