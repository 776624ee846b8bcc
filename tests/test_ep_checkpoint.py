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
