"""FSEP under gloo: the unsharded model's math with every expert sharded over the ranks.

Parity with the single-process reference (outputs, every gradient, parameters after SGD and Adam
steps) with the static placement, with one that changes every step and with the load-adaptive planner;
the restore's bytes are the same every step whatever the placement, and a re-layout moves no
parameter or optimizer byte; checkpoints cross FSEP -> EP -> the original model; lite routing checked
against a plain-Python statement of the rule.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402
from test_ep import CFG, case_parity  # noqa: E402
from test_ep_checkpoint import case_load, case_save  # noqa: E402
from test_ep_parity import case_hf_parity  # noqa: E402

pytestmark = pytest.mark.distributed


def rotating_planner(counts_PE, table):
    """A planner whose placement changes every step: the table shifted by one slot, then by expert."""
    shifted = table[1:] + table[:1]
    E = counts_PE.shape[1]
    return [(e + 1) % E for e in shifted]


# ----------------------------------------------------------------------------------------------
# Lite routing: the op against the rule written out in Python.
# ----------------------------------------------------------------------------------------------


def lite_route_reference(experts, table, rank, ranks_per_node, slots, E):
    """The j-th of rank i's n assignments to expert e goes to preferred replica floor(j*m/n) (module doc)."""
    node = lambda g: (g // slots) // ranks_per_node  # noqa: E731
    flat = [int(e) for e in experts.reshape(-1)]
    n = {e: flat.count(e) for e in set(flat)}
    seen: dict[int, int] = {}
    out = []
    for e in flat:
        if e == E:
            out.append(len(table))
            continue
        hosts = [g for g, x in enumerate(table) if x == e]
        local = [g for g in hosts if node(g) == rank // ranks_per_node]
        pref = local or hosts
        j = seen.get(e, 0)
        seen[e] = j + 1
        out.append(pref[j * len(pref) // n[e]])
    return torch.tensor(out).view_as(experts)


@pytest.mark.parametrize("seed", range(6))
def test_route_to_slots_matches_the_rule(seed):
    from moepass.runtime.fsep_ops import route_to_slots

    gen = torch.Generator().manual_seed(seed)
    E, P, C, rpn = 6, 4, 3, 2
    table = torch.randperm(P * C, generator=gen) % E  # every expert twice, scattered over nodes
    table[0] = 0
    experts = torch.randint(0, E + 1, (37, 2), generator=gen)  # E: dropped
    for rank in range(P):
        got = route_to_slots(experts, table, rank, rpn, C, E)
        want = lite_route_reference(experts, table.tolist(), rank, rpn, C, E)
        assert torch.equal(got, want), (rank, got, want)


def test_route_to_slots_splits_evenly_over_replicas():
    from moepass.runtime.fsep_ops import route_to_slots

    table = torch.tensor([0, 1, 0, 2])  # expert 0 in slots 0 (device 0) and 2 (device 1); one node
    experts = torch.zeros(10, 1, dtype=torch.int64)
    slots = route_to_slots(experts, table, 0, 2, 2, 3).flatten().tolist()
    assert slots == [0] * 5 + [2] * 5
    two_nodes = route_to_slots(experts, table, 1, 1, 2, 3).flatten().tolist()  # rank 1's node hosts slot 2
    assert two_nodes == [2] * 10


# ----------------------------------------------------------------------------------------------
# Parity with the unsharded model.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["loop", "fused", "gshard"])
def test_parity_w2_static(style):
    reports = pool(2).run(case_parity, style, form="fsep", planner="static", slots_per_device=5)
    assert reports[0]["forms"] == ["fsep"]
    assert max(r["grad"] for r in reports) < 1e-4


@pytest.mark.parametrize("style", ["loop", "fused"])
def test_parity_w2_placement_changes_every_step(style):
    reports = pool(2).run(case_parity, style, form="fsep", planner=rotating_planner, slots_per_device=5, steps=3)
    assert max(r["param"] for r in reports) < 1e-4


def test_parity_w4_two_nodes_changing_placement():
    reports = pool(4).run(case_parity, "fused", form="fsep", planner=rotating_planner, slots_per_device=3, nodes=2,
                          steps=2)
    assert max(r["loss"] for r in reports) < 1e-5


def test_adam_five_steps_equal_the_original():
    reports = pool(2).run(case_parity, "loop", form="fsep", planner=rotating_planner, slots_per_device=5, steps=5,
                          optimizer="adam")
    assert len(reports[0]["losses"]) == 5
    assert max(r["param"] for r in reports) < 1e-4


def test_parity_w2_chunked_schedule():
    """The schedule pass pipelines FSEP's token exchange too (2 chunks); the restore stays whole."""
    reports = pool(2).run(case_parity, "fused", form="fsep", planner=rotating_planner, slots_per_device=5, steps=2,
                          a2a_chunks=2)
    assert reports[0]["chunks"] == [2]
    assert max(r["param"] for r in reports) < 1e-4


def test_fsep_plan_errors():
    from moepass import Plan, PlanError

    with pytest.raises(PlanError, match=r"Plan.packing=2 has no effect with form='fsep'"):
        Plan(form="fsep", packing=2)


def test_parity_w2_adaptive_planner():
    reports = pool(2).run(case_parity, "fused", form="fsep", planner="auto", slots_per_device=5, steps=3)
    assert max(r["param"] for r in reports) < 1e-4


@pytest.mark.parametrize("world,nodes", [(2, 1), (4, 2)])
def test_hf_mixtral_parity(world, nodes):
    pytest.importorskip("transformers")
    reports = pool(world).run(case_hf_parity, "mixtral", nodes=nodes, form="fsep", planner=rotating_planner,
                              timeout=180)
    for r in reports:
        assert set(r["forms"].values()) == {"fsep"}, r["forms"]


# ----------------------------------------------------------------------------------------------
# Bytes and memory: the restore is the same every step; a re-layout moves nothing else.
# ----------------------------------------------------------------------------------------------


def case_restore_bytes(rank, world, steps, C, keep_restored=False):
    """Per step: restore bytes by kind; the parameter and optimizer-state storages, before and after."""
    import moepass
    from moepass.rewrite.fsep import controllers
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    cm = moepass.compile(tiny_mixtral(style="fused", **CFG),
                         moepass.Plan(form="fsep", planner=rotating_planner, slots_per_device=C,
                                      keep_restored=keep_restored))
    opt = torch.optim.Adam(cm.parameters(), lr=1e-3)
    storages = lambda: {n: p.to_local().data_ptr() if hasattr(p, "to_local") else p.data_ptr()  # noqa: E731
                        for n, p in cm.named_parameters()}
    tables, per_step, before = [], [], None
    for step in range(steps):
        tokens = torch.randint(0, CFG["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(step + 10 * rank))
        moepass.reset_comm_stats()
        opt.zero_grad()
        cm.loss(tokens).backward()
        opt.step()
        stats = moepass.comm_stats()
        per_step.append({k: v for k, v in stats.items() if k.startswith("restore")})
        tables.append([c.slot_expert.tolist() for c in controllers(cm).values()])
        if before is None:
            before = (storages(), {id(p): {k: s.data_ptr() for k, s in st.items() if torch.is_tensor(s)}
                                   for p, st in opt.state.items()})
    after = (storages(), {id(p): {k: s.data_ptr() for k, s in st.items() if torch.is_tensor(s)}
                          for p, st in opt.state.items()})
    local_expert_elems = sum(p.to_local().numel() for p in cm.parameters() if hasattr(p, "to_local"))
    saved = []  # every tensor autograd keeps for the backward of one step
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        cm.loss(torch.randint(0, CFG["vocab_size"], (2, 9))).backward()
    return {"per_step": per_step, "tables": tables, "same_storage": before == after,
            "local_expert_elems": local_expert_elems, "saved_shapes": saved}


def test_restore_bytes_fixed_and_relayout_moves_nothing():
    C, world = 5, 2
    results = pool(world).run(case_restore_bytes, 3, C)
    D, F, E, layers = CFG["dim"], CFG["ffn_dim"], CFG["num_experts"], CFG["layers"]
    S = 3 * D * F  # elements of one expert (gate, up, down)
    for r in results:
        assert r["same_storage"]  # no parameter or optimizer tensor was reallocated or moved
        tables = r["tables"]
        assert tables[0] != tables[1] != tables[2]  # the placement changed every step
        for step in r["per_step"]:
            # per layer, C*S/W fp32 elements to each peer, three times: the forward restore, the backward's
            # restore again (the expert FFN keeps a handle, not the C whole experts), the gradient slices back
            assert set(step) == {"restore", "restore_again", "restore_bwd"}, step
            for kind in step.values():
                assert kind.get("intra", 0) + kind.get("inter", 0) == layers * (world - 1) * C * S // world * 4, step
        assert r["local_expert_elems"] == layers * E * S // world  # parameter memory: E*S/W per layer
        restored = [(C, D, 2 * F), (C, 2 * F, D), (C, F, D), (C, D, F)]  # whole experts, any layout
        assert not [s for s in r["saved_shapes"] if s in restored]  # ... and C*S only while a layer runs


def test_keep_restored_trades_the_backward_restore_for_memory():
    """Plan.keep_restored: exact as the default, one restore fewer per layer-step, the C whole experts kept."""
    C, world = 5, 2
    reports = pool(world).run(case_parity, "fused", form="fsep", planner=rotating_planner, slots_per_device=C,
                              steps=3, keep_restored=True)
    assert max(r["grad"] for r in reports) < 1e-4 and max(r["param"] for r in reports) < 1e-4
    D, F, layers = CFG["dim"], CFG["ffn_dim"], CFG["layers"]
    S = 3 * D * F
    for r in pool(world).run(case_restore_bytes, 2, C, True):
        for step in r["per_step"]:
            assert set(step) == {"restore", "restore_bwd"}, step
            assert all(k["intra"] == layers * (world - 1) * C * S // world * 4 for k in step.values()), step
        kept = [s for s in r["saved_shapes"] if s in [(C, 2 * F, D), (C, D, F)]]  # fused gate_up, down
        assert len(kept) == 2 * layers, r["saved_shapes"]
    from moepass import Plan, PlanError

    with pytest.raises(PlanError, match=r"Plan.keep_restored=True has no effect with form='ep': it keeps FSEP's "
                                        r"restored experts for the backward. Use form='fsep', or leave it False."):
        Plan(form="ep", keep_restored=True)


class Reversed(torch.nn.Module):
    """Two MoE blocks registered as a, b whose forward runs b first: the prefetch chain's order is wrong."""

    def __init__(self):
        super().__init__()
        from samples.models import LoopMoE

        self.a, self.b = (LoopMoE(CFG["dim"], CFG["ffn_dim"], CFG["num_experts"], CFG["top_k"]) for _ in range(2))

    def forward(self, x):
        return self.a(torch.tanh(self.b(x)))


def case_prefetch(rank, world, steps):
    """Per block: restores prefetched by the block before it, over `steps` training steps with a placement
    that changes every step; a model whose blocks run in the other order trained with SGD next to the same
    model under EP (which has no prefetch): outputs per step."""
    import copy

    import moepass
    from moepass.rewrite.fsep import controllers
    from moepass.runtime.grads import all_reduce_replicated_grads
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    cm = moepass.compile(tiny_mixtral(style="fused", **{**CFG, "layers": 3}),
                         moepass.Plan(form="fsep", planner=rotating_planner, slots_per_device=5))
    for step in range(steps):
        tokens = torch.randint(0, CFG["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(step + 10 * rank))
        cm.loss(tokens).backward()
    hits = {path: c.prefetched_restores for path, c in controllers(cm).items()}
    torch.manual_seed(1)
    model = Reversed()
    em = moepass.compile(copy.deepcopy(model), moepass.Plan(form="ep"))
    rm = moepass.compile(model, moepass.Plan(form="fsep", planner=rotating_planner, slots_per_device=5))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (rm, em)]
    errors = []
    for step in range(steps):
        x = torch.randn(3, 4, CFG["dim"], generator=torch.Generator().manual_seed(step + 10 * rank))
        outs = [m(x) for m in (rm, em)]
        errors.append(float((outs[0] - outs[1]).detach().abs().max()))
        for m, out, opt in zip((rm, em), outs, opts):
            (out * out).sum().backward()
            all_reduce_replicated_grads(m)
            opt.step()
            opt.zero_grad()
    chain = next(iter(controllers(rm).values())).chain
    return {"hits": hits, "errors": errors, "enabled": chain.enabled,
            "reversed_hits": [c.prefetched_restores for c in controllers(rm).values()]}


def test_prefetch_issues_later_blocks_restores_and_falls_back_when_the_order_is_wrong():
    """Plan.prefetch_depth=2 (the default): block i issues blocks i+1 and i+2's restores behind its expert
    compute; every block after the first uses them, every step, with the table that changes every step
    (parity with it on is in every other test here). Blocks that run in another order than registered
    stay exact: the unused prefetch is dropped and the chain stops prefetching."""
    for r in pool(2).run(case_prefetch, 3):
        assert r["hits"] == {"layers.0.mlp": 0, "layers.1.mlp": 3, "layers.2.mlp": 3}, r["hits"]
        assert max(r["errors"]) < 1e-5 and not r["enabled"] and r["reversed_hits"] == [0, 0], r
    from moepass import Plan, PlanError

    with pytest.raises(PlanError, match=r"Plan.prefetch_depth=-1 is invalid: use an int >= 0"):
        Plan(form="fsep", prefetch_depth=-1)
    with pytest.raises(PlanError, match=r"Plan.prefetch_depth=1 has no effect with form='ep'"):
        Plan(form="ep", prefetch_depth=1)


# ----------------------------------------------------------------------------------------------
# Checkpoints: FSEP at W=4 -> EP at W=2 -> the original model.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["loop", "fused"])
def test_dcp_fsep4_to_ep2_and_original(style, tmp_path):
    import torch.distributed.checkpoint as dcp

    from samples.models import tiny_mixtral

    path = str(tmp_path / f"fsep_{style}")
    saved = pool(4).run(case_save, path, style, form="fsep")
    full = saved[0]["full"]
    original = tiny_mixtral(style=style, **CFG)
    want = original.state_dict()
    assert set(full) == set(want) and all(full[k].shape == want[k].shape for k in want)
    loaded = pool(2).run(case_load, path, style, 2, form="ep")
    for k, v in full.items():
        assert torch.equal(loaded[0]["full"][k], v), k
    assert loaded[0]["loss"] == pytest.approx(saved[0]["loss"], rel=1e-5)
    back = pool(2).run(case_load, path, style, 2, form="fsep")
    for k, v in full.items():
        assert torch.equal(back[0]["full"][k], v), k
    sd = original.state_dict()
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    original.load_state_dict(sd)
    for k, v in original.state_dict().items():
        assert torch.equal(v, full[k]), k


# ----------------------------------------------------------------------------------------------
# W=64 on the fake process group: graph, table, shapes and the restore's bytes per pair.
# ----------------------------------------------------------------------------------------------


def test_fake_pg_world_64_graph_table_and_bytes():
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import moepass
    from moepass.rewrite.fsep import controllers
    from moepass.runtime import collectives as comm
    from moepass.runtime.fsep import restore_issue, restore_prefetch
    from samples.models import tiny_mixtral

    world, rank, E, C, D, F = 64, 13, 32, 2, 64, 64
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        torch.manual_seed(0)
        model = tiny_mixtral(style="fused", vocab_size=32, dim=D, ffn_dim=F, num_experts=E, top_k=4, layers=1)
        cm = moepass.compile(model, moepass.Plan(form="fsep", slots_per_device=C, topology=moepass.Topology(8, 8)))
        gm = cm.layers[0].mlp
        assert gm.form == "fsep" and gm.layout.slots == C
        w = gm.w_gate_up
        assert isinstance(w, DTensor) and w.shape == (E, D, 2 * F) and w.to_local().shape == (E, 1, 2 * F)
        table = controllers(cm)["layers.0.mlp"].slot_expert.tolist()
        assert len(table) == world * C and sorted(set(table)) == list(range(E))
        assert [table.count(e) for e in range(E)] == [world * C // E] * E  # even: 4 replicas each ...
        nodes_of = [{(g // C) // 8 for g, x in enumerate(table) if x == e} for e in range(E)]
        assert all(len(n) == 4 for n in nodes_of)  # ... on 4 different nodes (node-spreading)
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        # the restore (an equal all_to_all, or the one an earlier block prefetched), then the next blocks'
        assert targets.count(restore_issue) == 1 and targets.count(restore_prefetch) == 1
        assert targets.count(comm.EQUAL_ALL_TO_ALL) == 0 and targets.count(comm.ALL_TO_ALL) == 2
        assert "restore: issues the next 2 FSEP blocks' restores behind its expert compute; 0 of its own restores " \
               "were prefetched" in gm.layout.describe(gm)
        assert targets.count(comm.GATHER_COUNTS) == 1  # the planner's counts ("auto")
        mode = FakeTensorMode(shape_env=ShapeEnv(allow_dynamic_output_shape_ops=True), allow_non_fake_inputs=True)
        FakeTensorProp(gm, mode).propagate(mode.from_tensor(torch.randn(2, 5, D)))
        by_name = {n.name: n.meta["val"] for n in gm.graph.nodes if "val" in n.meta}
        S = 3 * D * F  # one expert: gate and up [F, D] + down [D, F]
        assert by_name["restore"].shape == (world * C, S // world)  # C*S/W elements to every peer
        assert by_name["w_gate_up_slots"].shape == (C, D, 2 * F)
        assert by_name["out"].shape == (2, 5, D)
        assert by_name["slots_TK"].shape == (10, 4)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# torch.compile over an FSEP model: the placement logic runs eagerly, the numbers are eager FSEP's.
# ----------------------------------------------------------------------------------------------


def case_torch_compile(rank, world, steps):
    import torch._dynamo

    import moepass
    from moepass.rewrite.fsep import controllers
    from samples.models import tiny_mixtral

    def run(compiled):
        torch.manual_seed(0)
        cm = moepass.compile(tiny_mixtral(style="fused", **CFG),
                             moepass.Plan(form="fsep", slots_per_device=5, planner=rotating_planner))
        forward = torch.compile(cm, backend="aot_eager") if compiled else cm
        losses, tables = [], []
        for step in range(steps):
            tokens = torch.randint(0, CFG["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(step + rank))
            cm.zero_grad()
            logits = forward(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            losses.append(loss.item())
            tables.append([c.slot_expert.tolist() for c in controllers(cm).values()])
        grads = {n: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for n, p in cm.named_parameters()}
        return losses, tables, grads

    torch._dynamo.reset()
    eager, compiled = run(False), run(True)
    grad_err = max((compiled[2][n] - g).abs().max().item() for n, g in eager[2].items())
    return {"loss_err": max(abs(a - b) for a, b in zip(eager[0], compiled[0])), "grad_err": grad_err,
            "same_tables": eager[1] == compiled[1], "tables_change": eager[1][0] != eager[1][-1]}


def test_torch_compile_keeps_the_planner_running():
    for r in pool(2).run(case_torch_compile, 3):
        assert r["same_tables"] and r["tables_change"], r
        assert r["loss_err"] <= 1e-6 and r["grad_err"] <= 1e-6, r


# ----------------------------------------------------------------------------------------------
# Activation checkpointing: the recomputed forward routes with its forward's table, records nothing.
# ----------------------------------------------------------------------------------------------


def case_checkpointed(rank, world, reentrant):
    from torch.utils.checkpoint import checkpoint

    import moepass
    from moepass.rewrite.fsep import controllers
    from samples.models import LoopMoE

    def run(use_checkpoint):
        torch.manual_seed(0)
        cm = moepass.compile(LoopMoE(32, 64, 8, 2), moepass.Plan(form="fsep", slots_per_device=5,
                                                                  planner=rotating_planner))
        controller = next(iter(controllers(cm).values()))
        out = []
        for step in range(3):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * step + rank)).requires_grad_(True)
            y = checkpoint(cm, x, use_reentrant=reentrant) if use_checkpoint else cm(x)
            y.pow(2).sum().backward()
            grads = [p.grad.to_local().clone() if hasattr(p.grad, "to_local") else p.grad.clone()
                     for p in cm.parameters()]
            cm.zero_grad()
            out.append((controller.step, controller.slot_expert.tolist(), x.grad, grads))
        return out

    plain, checkpointed = run(False), run(True)
    return {"steps": [(a[0], b[0]) for a, b in zip(plain, checkpointed)],
            "tables": all(a[1] == b[1] for a, b in zip(plain, checkpointed)),
            "grad_err": max(max((a[2] - b[2]).abs().max().item(),
                                max((g - h).abs().max().item() for g, h in zip(a[3], b[3])))
                            for a, b in zip(plain, checkpointed))}


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_replays_the_step_table(reentrant):
    for r in pool(2).run(case_checkpointed, reentrant):
        assert r["steps"] == [(1, 1), (2, 2), (3, 3)] and r["tables"], r  # the recompute is not a step
        assert r["grad_err"] <= 1e-6, r
