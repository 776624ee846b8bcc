"""Checkpoints of EP models: original names and full shapes; DCP save at EP=4 loads at EP=2 and into
the original model; optimizer state dicts round-trip. Nothing is lost.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402

pytestmark = pytest.mark.distributed

CFG = dict(vocab_size=64, dim=32, ffn_dim=64, num_experts=8, top_k=2, layers=2, heads=4)
TOKENS_SEED = 11


def _tokens(world):
    return torch.randint(0, CFG["vocab_size"], (4, 9), generator=torch.Generator().manual_seed(TOKENS_SEED))


def _train_step(cm, opt, rank, world, seed):
    from moepass.runtime.grads import all_reduce_replicated_grads

    tokens = torch.randint(0, CFG["vocab_size"], (world * 2, 9), generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    cm.loss(tokens[rank * 2:(rank + 1) * 2]).backward()
    all_reduce_replicated_grads(cm)
    opt.step()


def _global_loss(cm, rank, world):
    tokens = _tokens(world)
    per = tokens.shape[0] // world
    with torch.no_grad():
        loss = cm.loss(tokens[rank * per:(rank + 1) * per])
    torch.distributed.all_reduce(loss)
    return (loss / world).item()


def case_save(rank, world, path, style, form="ep"):
    """Train one step under `form` (EP by default) over the world, DCP-save the logical state dict; return
    the full one and the loss."""
    import torch.distributed.checkpoint as dcp

    import moepass
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    cm = moepass.compile(tiny_mixtral(style=style, **CFG),
                         moepass.Plan(form=form, topology=moepass.Topology(2, world // 2)))
    _train_step(cm, torch.optim.SGD(cm.parameters(), lr=0.5), rank, world, seed=3)
    sd = moepass.logical_state_dict(cm)
    dcp.save(sd, checkpoint_id=path)
    full = moepass.logical_state_dict(cm, full=True)
    loss = _global_loss(cm, rank, world)
    return {"full": {k: v.clone() for k, v in full.items()}, "loss": loss} if rank == 0 else {"loss": loss}


def case_load(rank, world, path, style, ep_size, form="ep"):
    """A differently initialised model under `form` at ep_size loads the checkpoint; its full state and loss."""
    import torch.distributed.checkpoint as dcp

    import moepass
    from samples.models import tiny_mixtral

    torch.manual_seed(1234)  # different weights: everything must come from the checkpoint
    cm = moepass.compile(tiny_mixtral(style=style, **CFG), moepass.Plan(form=form, ep_size=ep_size))
    sd = moepass.logical_state_dict(cm)
    dcp.load(sd, checkpoint_id=path)
    moepass.load_logical_state_dict(cm, sd)
    full = moepass.logical_state_dict(cm, full=True)
    loss = _global_loss(cm, rank, world)
    return {"full": {k: v.clone() for k, v in full.items()}, "loss": loss} if rank == 0 else {"loss": loss}


def case_optimizer_roundtrip(rank, world, style):
    """Adam state dict of an EP model (DTensor state for experts) round-trips into a fresh model/optimizer."""
    import copy

    import moepass
    from samples.models import tiny_mixtral

    plan = moepass.Plan(form="ep")
    torch.manual_seed(0)
    model = tiny_mixtral(style=style, **CFG)
    cm = moepass.compile(model, plan)
    opt = torch.optim.Adam(cm.parameters(), lr=1e-2)
    for seed in (1, 2):
        _train_step(cm, opt, rank, world, seed)
    opt_sd = copy.deepcopy(opt.state_dict())  # load_state_dict would otherwise share the tensors
    cm2 = moepass.compile(tiny_mixtral(style=style, **CFG), plan)
    moepass.load_logical_state_dict(cm2, moepass.logical_state_dict(cm))
    opt2 = torch.optim.Adam(cm2.parameters(), lr=1e-2)
    opt2.load_state_dict(opt_sd)
    _train_step(cm, opt, rank, world, 5)
    _train_step(cm2, opt2, rank, world, 5)
    worst = 0.0
    for (n1, p1), (n2, p2) in zip(cm.named_parameters(), cm2.named_parameters()):
        assert n1 == n2
        a = p1.to_local() if hasattr(p1, "to_local") else p1
        b = p2.to_local() if hasattr(p2, "to_local") else p2
        assert torch.equal(a, b), n1
        worst = max(worst, (a - b).abs().max().item())
    state = opt.state_dict()["state"]
    kinds = {type(v["exp_avg"]).__name__ for v in state.values()}
    return {"worst": worst, "state_types": sorted(kinds)}


@pytest.mark.parametrize("style", ["loop", "fused"])
def test_dcp_ep4_to_ep2_and_original(style, tmp_path):
    import torch.distributed.checkpoint as dcp

    from samples.models import tiny_mixtral

    path = str(tmp_path / f"ckpt_{style}")
    saved = pool(4).run(case_save, path, style)
    full = saved[0]["full"]
    # names and shapes are the original model's, nothing missing, nothing extra
    original = tiny_mixtral(style=style, **CFG)
    want = original.state_dict()
    assert set(full) == set(want)
    assert all(full[k].shape == want[k].shape for k in want)
    # load at EP=2 (2 ranks): identical tensors and the same loss
    loaded = pool(2).run(case_load, path, style, 2)
    for k, v in full.items():
        assert torch.equal(loaded[0]["full"][k], v), k
    assert loaded[0]["loss"] == pytest.approx(saved[0]["loss"], rel=1e-5)
    # load into the original (un-rewritten) model in this process, no process group
    sd = original.state_dict()
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    original.load_state_dict(sd)
    for k, v in original.state_dict().items():
        assert torch.equal(v, full[k]), k
    with torch.no_grad():
        loss = original.loss(_tokens(4)).item()
    assert loss == pytest.approx(saved[0]["loss"], rel=1e-5)


def test_dcp_ep4_to_dp_x_ep(tmp_path):
    """Save at EP=4, load into ep_size=2 on the same 4 ranks (experts replicated over dp)."""
    path = str(tmp_path / "ckpt_dpxep")
    saved = pool(4).run(case_save, path, "gshard")
    loaded = pool(4).run(case_load, path, "gshard", 2)
    for k, v in saved[0]["full"].items():
        assert torch.equal(loaded[0]["full"][k], v), k


@pytest.mark.parametrize("style", ["loop", "fused"])
def test_optimizer_state_dict_roundtrip(style):
    result = pool(2).run(case_optimizer_roundtrip, style)[0]
    assert result["worst"] == 0.0
    assert "DTensor" in result["state_types"]


def case_resume_keeps_the_schedulers_learning_rates(rank, world, directory):
    """moepass.train.checkpoint saves each param group's hyper-parameters: a fresh optimizer loaded from it has
    the learning rates the scheduler had set, and the next steps are the uninterrupted run's, bit for bit."""
    import copy

    import torch.distributed as dist

    import moepass
    from moepass.runtime.grads import all_reduce_replicated_grads
    from moepass.train import checkpoint
    from samples.models import LoopMoE

    def run(model, steps):
        decay = [p for n, p in model.named_parameters() if p.dim() > 1]
        rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
        opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "lr": 3e-3, "weight_decay": 0.0}], lr=1e-2)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        return opt, sched

    def step(model, opt, sched, k):
        x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(100 * k + rank))
        opt.zero_grad()
        model(x).square().mean().backward()
        all_reduce_replicated_grads(model)  # as DDP would: the replicated parameters stay equal over the ranks
        opt.step()
        sched.step()

    torch.manual_seed(0)
    block = LoopMoE(16, 32, 4, 2)
    whole = moepass.compile(copy.deepcopy(block), moepass.Plan(form="ep"))
    opt, sched = run(whole, 4)
    for k in range(2):
        step(whole, opt, sched, k)
    checkpoint.save(directory, whole, opt, step=2)
    lrs = [g["lr"] for g in opt.param_groups]
    resumed = moepass.compile(copy.deepcopy(block), moepass.Plan(form="ep"))
    opt2, sched2 = run(resumed, 4)
    sched2.load_state_dict(sched.state_dict())
    checkpoint.load(checkpoint.latest(directory), resumed, opt2)
    assert [g["lr"] for g in opt2.param_groups] == lrs == [1e-2 / 4, 3e-3 / 4], lrs
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b)), "after load " + name
    for p, q in zip(opt.param_groups[0]["params"], opt2.param_groups[0]["params"]):
        for key, v in opt.state[p].items():
            assert torch.equal(getattr(v, "_local_tensor", v), getattr(opt2.state[q][key], "_local_tensor", opt2.state[q][key])), key
    for k in range(2, 4):
        step(whole, opt, sched, k)
        step(resumed, opt2, sched2, k)
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b)), name
    dist.barrier()
    return lrs


@pytest.mark.distributed
def test_resume_keeps_the_schedulers_learning_rates(tmp_path):
    pool(2).run(case_resume_keeps_the_schedulers_learning_rates, str(tmp_path / "ckpt"))
