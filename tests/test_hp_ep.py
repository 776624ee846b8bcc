"""Head parallel with expert parallel inside (`Plan(form="hp", head_ep_size=P)`): HP across head groups,
EP inside each group, on the mesh ("dp", "hp", "ep").

- fake process group at W=16 (4 x 4, 2 x 8) and W=8 (4 x 2): the graph holds exactly the two equal-split
  HP exchanges (over the HP group) and the expert dispatch / combine + one count exchange (over the EP
  group); the shapes under FakeTensorProp give the bytes of `cost_model.hp`'s formulas: HP flat in K,
  the expert exchange T*H*K*h;
- gloo at W=4 as 2 x 2: outputs, every gradient, the selection bias and the parameters after SGD steps
  equal the single-device Multi-Head LatentMoE on the global batch; the logical state dict round-trips
  (into a fresh HP+EP model and into the original model); counted bytes as the formulas say;
- `explain` shows the mesh; PlanErrors name the field, the value and the fix.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402
from test_ep import ATOL, BATCH_PER_RANK, RTOL, SEQ, _max_err  # noqa: E402
from test_hp import CFG, LATENT, check_eval_output, latent_model, step_beside_reference, step_bytes_and_bitwise  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Fake process group: graph, groups, shapes and bytes.
# ----------------------------------------------------------------------------------------------


def _fake_compile(world, rank, plan, **latent):
    import moepass
    from samples.models import tiny_latent_lm

    torch.manual_seed(0)
    model = tiny_latent_lm(**{**dict(heads=8, head_dim=8, experts=8, top_k=2, latent_ffn_dim=16), **latent},
                           vocab_size=32, dim=64, layers=1)
    return moepass.compile(model, plan).layers[0].mlp


@pytest.mark.parametrize("world,rank,G,P,nodes", [(16, 6, 4, 4, 4), (16, 11, 2, 8, 2), (8, 5, 4, 2, 4)])
def test_fake_pg_graph_groups_and_bytes(world, rank, G, P, nodes):
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import moepass
    from cost_model import hp as formulas
    from moepass import dialect
    from moepass.runtime import collectives as comm
    from moepass.runtime.hp import UPDATE_SELECTION_BIAS_OVER_GROUP
    from moepass.runtime.topology import group_info

    H, h, E, D, B, S = 8, 8, 8, 64, 2, 5
    T = B * S
    g, p = rank // P, rank % P
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        hp_bytes = {}
        for K in (1, 2, 4, 8):
            plan = moepass.Plan(form="hp", head_ep_size=P, topology=moepass.Topology(nodes, world // nodes))
            gm = _fake_compile(world, rank, plan, top_k=K)
            assert gm.form == "hp" and gm.layout.groups.head_groups == G and gm.layout.groups.head_ep == P
            calls = [n for n in gm.graph.nodes if n.op == "call_function"]
            targets = [n.target for n in calls]
            # exactly two equal-split HP exchanges, one expert dispatch + combine and their count exchange
            assert targets.count(comm.EQUAL_ALL_TO_ALL) == 2 and targets.count(comm.ALL_TO_ALL) == 2
            assert targets.count(comm.EXCHANGE_COUNTS) == 1 and targets.count(comm.GATHER_COUNTS) == 0
            assert targets.count(UPDATE_SELECTION_BIAS_OVER_GROUP) == 1
            assert targets.count(dialect.UPDATE_SELECTION_BIAS) == 0
            by_kind = {n.args[2] if n.target is comm.EQUAL_ALL_TO_ALL else n.args[4]: n for n in calls
                       if n.target in (comm.EQUAL_ALL_TO_ALL, comm.ALL_TO_ALL)}
            assert sorted(by_kind) == ["combine", "dispatch", "hp_combine", "hp_dispatch"]
            hp_ranks = [g2 * P + p for g2 in range(G)]  # the ranks sharing this rank's ep index
            ep_ranks = [g * P + p2 for p2 in range(P)]  # this rank's head group
            for kind, n in by_kind.items():
                name = n.args[1] if kind.startswith("hp") else n.args[3]
                assert group_info(name)[1] == (hp_ranks if kind.startswith("hp") else ep_ranks), kind
            counts = next(n for n in calls if n.target is comm.EXCHANGE_COUNTS)
            assert group_info(counts.args[1])[1] == ep_ranks
            bias_update = next(n for n in calls if n.target is UPDATE_SELECTION_BIAS_OVER_GROUP)
            assert group_info(bias_update.args[4])[1] == ep_ranks  # dp = 1: the head's replicas are its group
            # parameters: experts over 'hp' then 'ep' (flat shard g*P+p), routers over 'hp' only
            w = gm.w_up
            X = H * E // (G * P)
            assert isinstance(w, DTensor) and w.device_mesh.mesh_dim_names == ("dp", "hp", "ep")
            assert w.shape == (H * E, 16, h) and w.to_local().shape == (X, 16, h)
            assert gm.layout.first_expert == rank * X and gm.router.to_local().shape == (H // G, E, h)
            # shapes -> bytes per rank and direction
            mode = FakeTensorMode(shape_env=ShapeEnv(allow_dynamic_output_shape_ops=True), allow_non_fake_inputs=True)
            FakeTensorProp(gm, mode).propagate(mode.from_tensor(torch.randn(B, S, D)))
            send = by_kind["hp_dispatch"].args[0].meta["val"]
            assert tuple(send.shape) == (G * T, H * h // G)  # block q: this rank's T tokens for group q's heads
            per_peer = send.numel() // G  # equal splits: every peer the same
            hp_sent = int(per_peer) * (G - 1) * send.element_size()
            assert hp_sent == formulas.hp_ep_hp_elements(T, H, h, G) * 4
            back = by_kind["hp_combine"].args[0].meta["val"]
            assert back.numel() == send.numel()
            hp_bytes[K] = hp_sent
            routed = by_kind["dispatch"].args[0].meta["val"]  # the rows the dispatch splits over the group
            assert tuple(routed.shape) == (T * H * K, h)
            assert routed.numel() == formulas.hp_ep_routed_elements(T, H, h, K)
            assert by_kind["combine"].meta["val"].shape == routed.shape
            assert gm.graph.find_nodes(op="output")[0].args[0].meta["val"].shape == (B, S, D)
        assert len(set(hp_bytes.values())) == 1, hp_bytes  # HP bytes flat in K
        assert formulas.hp_ep_expert_elements(T, H, h, 8, P) == 8 * formulas.hp_ep_expert_elements(T, H, h, 1, P)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# gloo, W=4 as 2 head groups x 2 EP ranks: parity with the single-device block, checkpoints, bytes.
# ----------------------------------------------------------------------------------------------


def case_parity(rank, world, head_ep, steps=2, activation="gelu", nodes=2):
    import moepass

    model = latent_model(activation=activation)
    plan = moepass.Plan(form="hp", head_ep_size=head_ep, topology=moepass.Topology(nodes, world // nodes))
    cm = moepass.compile(model, plan)
    opt, ref_opt = torch.optim.SGD(cm.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    report = {"out": 0.0, "grad": 0.0, "param": 0.0, "grads_checked": 0,
              "forms": sorted({gm.form for gm in cm.moepass_info.rewritten.values()})}
    for step in range(steps):
        tokens, mine, ref_out, ref_grads = step_beside_reference(cm, model, step, rank, world)
        grads = moepass.logical_grads(cm)
        assert sorted(grads) == sorted(ref_grads), (sorted(grads), sorted(ref_grads))
        for name, (g, index) in grads.items():
            want = ref_grads[name][index or slice(None)]
            assert g.shape == want.shape, (name, g.shape, want.shape)
            torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
            report["grad"] = max(report["grad"], _max_err(g, want))
            report["grads_checked"] += 1
        # the selection bias after this training forward: the global-batch update of every head, on every rank
        full, ref_state = moepass.logical_state_dict(cm, full=True), model.state_dict()
        for name, value in full.items():
            if name.endswith("selection_bias"):
                assert torch.equal(value, ref_state[name]), name
        check_eval_output(cm, tokens[mine, :-1], ref_out, report)
        opt.step()
        ref_opt.step()
        full = moepass.logical_state_dict(cm, full=True)
        for name, want in model.state_dict().items():
            torch.testing.assert_close(full[name], want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
            report["param"] = max(report["param"], _max_err(full[name], want))
    return report


def case_checkpoint(rank, world, head_ep):
    """logical_state_dict round trip: into a fresh HP+EP model (other init) and, full, into the original."""
    import moepass

    plan = moepass.Plan(form="hp", head_ep_size=head_ep, topology=moepass.Topology(2, world // 2))
    trained = moepass.compile(latent_model(), plan)
    tokens = torch.randint(0, CFG["vocab_size"], (BATCH_PER_RANK, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    opt = torch.optim.SGD(trained.parameters(), lr=0.5)
    trained.loss(tokens).backward()
    opt.step()  # no longer the init: a round trip of the init alone proves nothing
    state = moepass.logical_state_dict(trained)
    torch.manual_seed(1)
    from samples.models import tiny_latent_lm

    fresh = moepass.compile(tiny_latent_lm(**LATENT, **CFG), plan)
    before = moepass.logical_state_dict(fresh, full=True)
    moepass.load_logical_state_dict(fresh, state)
    after, want = moepass.logical_state_dict(fresh, full=True), moepass.logical_state_dict(trained, full=True)
    changed = sorted(n for n in want if not torch.equal(before[n], want[n]))
    for name in want:
        assert torch.equal(after[name], want[name]), name
    original = latent_model()
    original.load_state_dict(want)
    with torch.no_grad():
        trained.eval()
        original.eval()
        torch.testing.assert_close(trained(tokens[:, :-1]), original(tokens[:, :-1]), rtol=RTOL, atol=ATOL)
    return {"changed": changed, "keys": sorted(want)}


def case_bytes(rank, world, head_ep, top_k):
    import moepass

    plan = moepass.Plan(form="hp", head_ep_size=head_ep, topology=moepass.Topology(2, world // 2))
    cm = moepass.compile(latent_model(top_k=top_k, experts=8), plan)
    stats, bitwise = step_bytes_and_bitwise(cm, rank)
    return {"stats": stats, "bitwise": bitwise}


def test_parity_with_the_single_device_block_2x2():
    reports = pool(4).run(case_parity, 2)
    assert reports[0]["forms"] == ["hp"]
    # per layer: w_in, router, w_up, w_down, w_out; plus attention, embeddings, norms
    assert all(r["grads_checked"] == reports[0]["grads_checked"] > 10 for r in reports)
    assert max(r["grad"] for r in reports) < 1e-4 and max(r["param"] for r in reports) < 1e-4


def test_parity_swiglu_4_ep_ranks_in_one_head_group():
    reports = pool(4).run(case_parity, 4, steps=1, activation="swiglu", nodes=1)  # G=1: all heads, EP over 4
    assert max(r["param"] for r in reports) < 1e-4


def test_logical_state_dict_round_trip():
    results = pool(4).run(case_checkpoint, 2)
    for r in results:
        assert "layers.0.mlp.w_up" in r["changed"] and "layers.1.mlp.router" in r["changed"], r["changed"]
        assert "layers.0.mlp.selection_bias" in r["keys"]


def test_counted_bytes_hp_flat_in_k_expert_exchange_as_the_formula():
    from cost_model import hp as formulas

    world, P = 4, 2
    G = world // P
    T, H, h, layers = BATCH_PER_RANK * SEQ, LATENT["heads"], LATENT["head_dim"], CFG["layers"]
    hp_sent = {}
    for top_k in (1, 2, 4, 8):  # 8 experts per head
        results = pool(world).run(case_bytes, P, top_k)
        for rank, r in enumerate(results):
            s = r["stats"]
            assert r["bitwise"]
            for kind in ("hp_dispatch", "hp_combine", "hp_dispatch_bwd", "hp_combine_bwd"):
                # HP pairs are (g, p) <-> (g', p): across the two simulated nodes, T*Q/G elements each
                assert s[kind]["inter"] == layers * formulas.hp_ep_hp_elements(T, H, h, G) * 4, (kind, s[kind])
                assert s[kind]["intra"] == 0 and s[kind]["self"] == layers * T * H * h // G * 4
            # the dispatch splits the T*H*K routed rows of this rank over its EP group (self included),
            # inside the node; the backward of the combine sends the same rows
            routed = layers * formulas.hp_ep_routed_elements(T, H, h, top_k) * 4
            for kind in ("dispatch", "combine_bwd"):
                assert s[kind]["inter"] == 0 and s[kind]["intra"] + s[kind]["self"] == routed, (kind, s[kind])
            assert s["counts"]["calls"] == layers  # one count exchange per layer; nothing else counts
            assert s["bias_load"]["calls"] == layers  # the selection bias's load sum (train mode)
            hp_sent[top_k, rank] = sum(s[k]["inter"] for k in s if k.startswith("hp"))
        # what the dispatches sent the group received: the combines send it back
        assert sum(r["stats"]["combine"]["intra"] + r["stats"]["combine"]["self"] for r in results) == \
            sum(r["stats"]["dispatch"]["intra"] + r["stats"]["dispatch"]["self"] for r in results)
    assert len(set(hp_sent.values())) == 1, hp_sent  # HP bytes flat in K, the same on every rank


# ----------------------------------------------------------------------------------------------
# explain, plan errors.
# ----------------------------------------------------------------------------------------------


def test_explain_shows_the_two_mesh_dims():
    import moepass

    text = moepass.explain(latent_model(heads=8), moepass.Plan(form="hp", head_ep_size=4, topology=moepass.Topology(4, 4)),
                           graphs=False)
    assert "mesh ('dp', 'hp', 'ep') of shape (1, 4, 4): 4 head groups" in text, text
    assert "HP exchange (equal splits) over ranks [0, 4, 8, 12]" in text, text
    assert "expert exchange (variable splits, count exchange) over ranks [0, 1, 2, 3]" in text, text
    assert "'mesh': 'dp x hp x ep = 1 x 4 x 4'" in text, text


def test_plan_errors_name_field_value_and_fix():
    import moepass

    with pytest.raises(moepass.PlanError, match=r"Plan.head_ep_size=2 has no effect with form='ep'.*leave it 1"):
        moepass.Plan(form="ep", head_ep_size=2)
    with pytest.raises(moepass.PlanError, match=r"Plan.head_ep_size=0 is invalid: use a positive int"):
        moepass.Plan(form="hp", head_ep_size=0)
    with pytest.raises(moepass.PlanError, match=r"Plan.head_ep_size=4 is invalid with Plan.ep_size=6.*dividing 6"):
        moepass.Plan(form="hp", ep_size=6, head_ep_size=4)


@pytest.mark.parametrize("latent,head_ep,message", [
    (dict(), 3, r"Plan.head_ep_size=3 is invalid: it must divide the 16 ranks .* use a divisor of 16"),
    (dict(heads=4), 2, r"Plan.head_ep_size=2 is invalid for block layers.0.mlp: its 4 heads do not split over the 8 "
                       r"head groups .* a multiple of 8"),
    (dict(heads=4, experts=2, top_k=1), 8, r"Plan.head_ep_size=8 is invalid for block layers.0.mlp: a head group's "
                                           r"2 heads x 2 experts = 4 experts do not split over its 8 ranks"),
])
def test_plan_errors_on_the_mesh(latent, head_ep, message):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import moepass

    dist.init_process_group("fake", rank=0, world_size=16, store=FakeStore())
    try:
        with pytest.raises(moepass.PlanError, match=message):
            _fake_compile(16, 0, moepass.Plan(form="hp", head_ep_size=head_ep, topology=moepass.Topology(1, 16)),
                          **latent)
    finally:
        dist.destroy_process_group()


def test_fake_pg_data_parallel_replicas_groups_and_placements():
    """W=16 with ep_size=8 and head_ep_size=4: 2 replicas x 2 head groups x 4 EP ranks. The router's gradient
    and the selection bias's load are summed over the 8 ranks holding a head (both replicas' EP groups);
    the experts' gradients over the 2 replicas of each shard."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import moepass
    from moepass.runtime import collectives as comm
    from moepass.runtime.hp import UPDATE_SELECTION_BIAS_OVER_GROUP
    from moepass.runtime.topology import group_info

    rank = 13  # (dp 1, hp 1, ep 1)
    dist.init_process_group("fake", rank=rank, world_size=16, store=FakeStore())
    try:
        plan = moepass.Plan(form="hp", ep_size=8, head_ep_size=4, topology=moepass.Topology(4, 4))
        gm = _fake_compile(16, rank, plan)
        g = gm.layout.groups
        assert (g.dp_size, g.head_groups, g.head_ep, g.dp_rank, g.hp_rank, g.expert_rank) == (2, 2, 4, 1, 1, 1)
        assert g.hp_ranks == [9, 13] and g.expert_ranks == [12, 13, 14, 15] and g.dp_ranks == [5, 13]
        assert g.head_replica_ranks == [4, 5, 6, 7, 12, 13, 14, 15]
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        equal = [n for n in calls if n.target is comm.EQUAL_ALL_TO_ALL]
        assert [group_info(n.args[1])[1] for n in equal] == [[9, 13], [9, 13]]
        bias_update = next(n for n in calls if n.target is UPDATE_SELECTION_BIAS_OVER_GROUP)
        assert group_info(bias_update.args[4])[1] == g.head_replica_ranks
        assert gm.w_up.placements == (Replicate(), Shard(0), Shard(0))
        assert gm.router.placements == (Replicate(), Shard(0), Replicate())
        assert gm.selection_bias.placements == (Replicate(), Shard(0), Replicate())
        assert gm.layout.first_head == 4 and gm.layout.first_expert == 5 * 8  # flat shard 1*4+1 of 8, 8 experts each
        # one gradient hook each: the experts' over dp_group, the router's over the head's replicas
        assert [len(gm.get_parameter(n)._backward_hooks or {}) for n in ("w_up", "w_down", "router")] == [1, 1, 1]
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# The conversion's expert width m: a multiple of 4 when that keeps 98% of the active parameters.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("D,F,exact,want", [(128, 256, 213, 212), (64, 128, 106, 106)])
def test_latent_ffn_dim_aligned_to_4_within_tolerance(D, F, exact, want):
    import moepass
    from moepass.rewrite.latent import ALIGN_TOLERANCE, latent_shape
    from samples.models import tiny_mixtral

    spec = moepass.detect(tiny_mixtral(dim=D, ffn_dim=F, num_experts=8, top_k=2)).blocks[0]
    shape = latent_shape(spec, moepass.Plan(form="hp", heads=4), world=2)
    H, h, K, E, n = 4, D // 4, 2, 8, 3
    before, fixed = K * n * D * F + D * E, 2 * D * H * h + H * E * h
    assert (before - fixed) // (H * K * n * h) == exact  # the equal-active-parameter width, rounded down
    assert shape.ffn_dim == want and shape.active_after == fixed + H * K * n * h * want <= shape.active_before
    aligned_loss = (before - fixed - H * K * n * h * (exact - exact % 4)) / before
    # 213 -> 212 loses 0.52% (aligned); 106 -> 104 would lose 2.06% > 2% (kept)
    assert (aligned_loss <= ALIGN_TOLERANCE) == (want % 4 == 0), aligned_loss


def test_conversion_shards_heads_over_head_groups_on_the_fake_pg():
    """A standard block under Plan(form="hp", head_ep_size=4) at W=16: heads default to the 4 head groups
    (not the 16 ranks); the conversion is named in the history."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import moepass
    from samples.models import tiny_mixtral

    dist.init_process_group("fake", rank=5, world_size=16, store=FakeStore())
    try:
        torch.manual_seed(0)
        model = tiny_mixtral(vocab_size=32, dim=64, ffn_dim=128, num_experts=8, top_k=2, layers=1)
        gm = moepass.compile(model, moepass.Plan(form="hp", head_ep_size=4, topology=moepass.Topology(4, 4))).layers[0].mlp
        assert [r["pass"] for r in gm.history[:3]] == ["convert:hp", "canonical", "rewrite:hp"]
        assert gm.spec.heads.num_heads == 4 and gm.layout.local_heads == 1  # 4 heads over G = 16/4 head groups
        assert (gm.layout.groups.head_groups, gm.layout.groups.head_ep, gm.layout.local_experts) == (4, 4, 2)
    finally:
        dist.destroy_process_group()
