"""Head parallel (HP) under gloo: the single-device Multi-Head LatentMoE's math with heads sharded.

Parity with the single-device model on the global batch (outputs, every gradient, the aux-loss-free
selection bias after a training step, parameters after SGD steps) at W=2 and W=4; bitwise-identical
outputs across two runs; bytes per rank the same for K = 1, 2, 4, 8 with equal splits on every pair and
no count exchange in the graph; the conversion `Plan(form="hp")` of a standard block.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402
from test_ep import ATOL, BATCH_PER_RANK, RTOL, SEQ, _max_err  # noqa: E402

pytestmark = pytest.mark.distributed

CFG = dict(vocab_size=64, dim=32, layers=2)  # the LM (4 attention heads); its MoE layers are Multi-Head LatentMoE
LATENT = dict(heads=4, head_dim=8, experts=4, top_k=2, latent_ffn_dim=16)


def latent_model(**latent):
    """The test LM with Multi-Head LatentMoE layers (`LATENT` overridden by `latent`), seeded."""
    from samples.models import tiny_latent_lm

    torch.manual_seed(0)
    return tiny_latent_lm(**{**LATENT, **latent}, **CFG)


def case_parity(rank, world, steps=1, activation="gelu", nodes=1, ep_size=None):
    import moepass

    model = latent_model(activation=activation)
    cm = moepass.compile(model, moepass.Plan(form="hp", topology=moepass.Topology(nodes, world // nodes),
                                             ep_size=ep_size))
    head_rank = rank % (ep_size or world)  # heads follow the rank's place in its group; replicas hold the same
    opt, ref_opt = torch.optim.SGD(cm.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    report = {"out": 0.0, "grad": 0.0, "param": 0.0, "bias": 0.0,
              "forms": sorted({gm.form for gm in cm.moepass_info.rewritten.values()})}
    for step in range(steps):
        tokens, mine, ref_out, ref_grads = step_beside_reference(cm, model, step, rank, world)
        for name, (g, index) in moepass.logical_grads(cm).items():
            want = ref_grads[name][index or slice(None)]
            torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
            report["grad"] = max(report["grad"], _max_err(g, want))
        # the selection bias after this training forward: this rank's heads' rows equal the reference's
        state, ref_state = moepass.logical_state_dict(cm), model.state_dict()
        for name, value in state.items():
            if name.endswith("selection_bias"):
                local = value.to_local()
                rows = slice(head_rank * local.shape[0], (head_rank + 1) * local.shape[0])
                assert torch.equal(local, ref_state[name][rows]), name
                report["bias"] = max(report["bias"], _max_err(local, ref_state[name][rows]))
        check_eval_output(cm, tokens[mine, :-1], ref_out, report)
        opt.step()
        ref_opt.step()
        state = moepass.logical_state_dict(cm)
        ref_params = dict(model.named_parameters())
        for name, (_, index) in moepass.logical_grads(cm).items():
            value = state[name]
            value = value.to_local() if hasattr(value, "to_local") else value
            want = ref_params[name].detach()[index or slice(None)]
            torch.testing.assert_close(value, want, rtol=RTOL, atol=ATOL)
            report["param"] = max(report["param"], _max_err(value, want))
    return report


def step_beside_reference(cm, model, step: int, rank: int, world: int):
    """One training forward and backward of the HP model on this rank's share of the global batch, and of the
    reference model on all of it; checks the global loss. Returns (tokens, this rank's rows, the reference's
    eval output on them, the reference's gradients by name)."""
    from moepass.runtime.grads import all_reduce_replicated_grads

    tokens = torch.randint(0, CFG["vocab_size"], (world * BATCH_PER_RANK, SEQ + 1),
                           generator=torch.Generator().manual_seed(100 + step))
    mine = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    model.zero_grad()
    ref_loss = model.loss(tokens)
    ref_loss.backward()
    with torch.no_grad():
        model.eval()
        ref_out = model(tokens[mine, :-1])
        model.train()
    cm.zero_grad()
    loss = cm.loss(tokens[mine])
    loss.backward()
    all_reduce_replicated_grads(cm)
    global_loss = loss.detach().clone()
    torch.distributed.all_reduce(global_loss)
    torch.testing.assert_close(global_loss / world, ref_loss.detach(), rtol=RTOL, atol=ATOL)
    return tokens, mine, ref_out, {n: p.grad for n, p in model.named_parameters()}


def check_eval_output(cm, tokens, ref_out, report: dict) -> None:
    """The eval forward of `tokens` (the updated selection bias routes, nothing updates it) equals the
    reference's `ref_out`; the largest error goes to report["out"]."""
    with torch.no_grad():
        cm.eval()
        out = cm(tokens)
        cm.train()
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
    report["out"] = max(report["out"], _max_err(out, ref_out))


def case_bytes_and_graph(rank, world, top_k):
    """Bytes this rank sends per step for top_k; the graph's collectives."""
    import moepass
    from moepass.runtime import collectives as comm

    cm = moepass.compile(latent_model(top_k=top_k, experts=8), moepass.Plan(form="hp", topology=moepass.Topology(1, world)))
    gm = next(iter(cm.moepass_info.rewritten.values()))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    stats, bitwise = step_bytes_and_bitwise(cm, rank)
    return {"stats": {k: v for k, v in stats.items() if k.startswith("hp")},
            "count_exchanges": targets.count(comm.EXCHANGE_COUNTS), "variable_a2a": targets.count(comm.ALL_TO_ALL),
            "equal_a2a": targets.count(comm.EQUAL_ALL_TO_ALL), "bitwise": bitwise}


def step_bytes_and_bitwise(cm, rank: int) -> tuple[dict, bool]:
    """The bytes counted over one training step of this rank's batch, and whether two eval forwards of it
    agree bit for bit."""
    import moepass

    tokens = torch.randint(0, CFG["vocab_size"], (BATCH_PER_RANK, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    moepass.reset_comm_stats()
    cm.loss(tokens).backward()
    stats = moepass.comm_stats()
    with torch.no_grad():
        cm.eval()
        first, second = cm(tokens[:, :-1]), cm(tokens[:, :-1])
    return stats, torch.equal(first, second)


@pytest.mark.parametrize("world,nodes", [(2, 1), (4, 2)])
def test_parity_with_the_single_device_block(world, nodes):
    reports = pool(world).run(case_parity, steps=2, nodes=nodes)
    assert reports[0]["forms"] == ["hp"]
    assert max(r["grad"] for r in reports) < 1e-4


def test_parity_with_data_parallel_replicas_of_the_heads():
    """W=4, heads over 2 ranks, 2 replicas: router gradients and the selection bias's load are summed over the
    replicas, so both replicas keep the single-device block's values (the global batch)."""
    reports = pool(4).run(case_parity, steps=2, ep_size=2)
    assert max(r["grad"] for r in reports) < 1e-4 and max(r["param"] for r in reports) < 1e-4


def test_parity_swiglu_heads():
    reports = pool(2).run(case_parity, activation="swiglu")
    assert max(r["param"] for r in reports) < 1e-4


def test_bytes_flat_in_k_equal_splits_no_count_exchange():
    world = 2
    per_k = {}
    for top_k in (1, 2, 4, 8):  # 8 experts per head
        results = pool(world).run(case_bytes_and_graph, top_k)
        for r in results:
            assert r["count_exchanges"] == 0 and r["variable_a2a"] == 0 and r["equal_a2a"] == 2, r
            assert r["bitwise"]
        per_k[top_k] = [r["stats"] for r in results]
    assert per_k[1] == per_k[2] == per_k[4] == per_k[8], per_k
    # every pair exchanges T * Ql elements per direction per layer: fp32, T = B*S tokens, Ql = Q / W
    T, Q, layers = BATCH_PER_RANK * SEQ, LATENT["heads"] * LATENT["head_dim"], CFG["layers"]
    sent = sum(v.get("intra", 0) + v.get("inter", 0) for v in per_k[2][0].values())
    assert sent == 4 * layers * T * (Q // world) * (world - 1) * 4  # dispatch + combine, forward + backward


def case_convert(rank, world):
    import moepass
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    model = tiny_mixtral(vocab_size=64, dim=32, ffn_dim=64, num_experts=8, top_k=2, layers=2, heads=4)
    plan = moepass.Plan(form="hp", heads=4, topology=moepass.Topology(1, world))
    cm = moepass.compile(model, plan)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(rank))
    loss = cm.loss(tokens)
    loss.backward()
    gm = next(iter(cm.moepass_info.rewritten.values()))
    return {"loss": loss.item(), "history": [h["pass"] for h in gm.history],
            "convert": gm.history[0]["stats"], "form": gm.form}


def test_conversion_of_a_standard_block_is_named_and_trains():
    results = pool(2).run(case_convert)
    r = results[0]
    assert r["form"] == "hp" and r["history"][:2] == ["convert:hp", "canonical"], r
    assert "active parameters per token" in r["convert"]["latent"] and "math" in r["convert"]
    assert all(torch.isfinite(torch.tensor(x["loss"])) for x in results)


def test_latent_shape_keeps_active_parameters():
    import moepass
    from moepass.rewrite.latent import latent_shape

    spec = moepass.detect(__import__("samples.models", fromlist=["tiny_mixtral"]).tiny_mixtral(
        dim=64, ffn_dim=128, num_experts=8, top_k=2)).blocks[0]
    shape = latent_shape(spec, moepass.Plan(form="hp", heads=4), world=2)
    D, F, K, E = 64, 128, 2, 8
    assert shape.active_before == K * 3 * D * F + D * E
    H, h, m = shape.heads, shape.head_dim, shape.ffn_dim
    assert (H, h) == (4, 16)
    assert shape.active_after == 2 * D * H * h + H * E * h + H * K * 3 * h * m
    assert shape.active_after <= shape.active_before < shape.active_after + H * K * 3 * h  # rounded down by < 1 m
    with pytest.raises(moepass.PlanError, match=r"Plan.heads=3 is invalid .* multiple of 2"):
        latent_shape(spec, moepass.Plan(form="hp", heads=3), world=2)


def test_ep_on_a_latent_block_is_refused_with_the_form_to_use():
    import moepass
    from moepass.pipeline import resolve

    spec = moepass.detect(latent_model()).blocks[0]
    with pytest.raises(moepass.PlanError, match=r"Plan.form='ep' is not built for block .* form='hp'"):
        resolve(spec, moepass.Plan(form="ep"))


def case_ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import moepass

    cm = moepass.compile(latent_model(), moepass.Plan(form="hp", topology=moepass.Topology(1, world)))
    ddp = DDP(cm)  # the sharded routers, experts and selection-bias buffers are left to moepass
    tokens = torch.randint(0, CFG["vocab_size"], (BATCH_PER_RANK, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    logits = ddp(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return sorted(n for n in cm._ddp_params_and_buffers_to_ignore if n.endswith("selection_bias"))


def test_ddp_wraps_an_hp_model():
    for ignored in pool(2).run(case_ddp):
        assert ignored == ["layers.0.mlp.selection_bias", "layers.1.mlp.selection_bias"], ignored
