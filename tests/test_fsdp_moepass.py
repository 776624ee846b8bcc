"""`moepass.fully_shard` (issue 29 item 3): FSDP2 over a model moepass compiled, as users call it.

torch's `fully_shard(cm)` takes moepass's expert DTensors for tensor-parallel ones and fails
(`TypeError: Invariant encountered: value was None when it should not be`); `moepass.fully_shard` passes
them as `ignored_params`. Here every decoder layer and the root go through it, FSDP's collectives through
the priority scheduler (`schedule_fsdp`), and 3 AdamW steps (the recipe's `build_optimizer`, foreach=True)
are compared with the untouched model trained on the global batch in one process: every step's mean loss
and every parameter after the steps (`moepass.logical_state_dict`, gathered), fp32 tolerance.
W=2 (EP, FSEP) and W=4 as a 2x2 mesh (ep_size=2: data parallel x expert parallel) for EP and FSEP.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402

pytestmark = pytest.mark.distributed

LM = dict(vocab_size=64, dim=32, ffn_dim=32, num_experts=4, top_k=2, layers=2, heads=4)
BATCH_PER_RANK, SEQ, STEPS = 2, 8, 3
RTOL, ATOL = 1e-5, 1e-6


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def case_fsdp(rank, world, form, ep_size):
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    import moepass
    from moepass.runtime.grad_sync import schedule_fsdp
    from moepass.train.optim import build_optimizer
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    model = tiny_mixtral(style="loop", **LM)
    reference = copy.deepcopy(model)
    cm = moepass.compile(model, moepass.Plan(form=form, ep_size=ep_size, topology=moepass.Topology(1, world)))
    experts = moepass.fsdp.moepass_parameters(cm)
    meshes = {id(p.device_mesh) for p in experts}
    for layer in cm.layers:
        moepass.fully_shard(layer)
    moepass.fully_shard(cm)
    schedule_fsdp(cm)
    assert isinstance(cm, FSDPModule) and all(isinstance(layer, FSDPModule) for layer in cm.layers)
    assert experts and {id(p.device_mesh) for p in experts} == meshes  # FSDP left the experts on their mesh
    dense = [p for p in cm.parameters() if all(p is not q for q in experts)]
    assert dense and all(isinstance(p, DTensor) and id(p.device_mesh) not in meshes for p in dense)  # FSDP's

    opt = build_optimizer(cm, 1e-2, foreach=True)
    ref_opt = build_optimizer(reference, 1e-2, foreach=True)
    worst = 0.0
    for step in range(STEPS):
        tokens = torch.randint(0, LM["vocab_size"], (world * BATCH_PER_RANK, SEQ + 1),
                               generator=torch.Generator().manual_seed(step))
        loss = cm.loss(tokens[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK])
        loss.backward()
        moepass.clip_grad_norm_(list(cm.parameters()), 1.0)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        ref_loss = reference.loss(tokens)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(mean / world, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        worst = max(worst, abs(float(mean / world - ref_loss)))
    want = reference.state_dict()
    # parameters: Adam turns a gradient element near 0 (summed in another order) into an update of up to lr's
    # size in either direction, so an element may differ by a few 1e-5 after 3 steps at lr 1e-2
    for name, value in moepass.logical_state_dict(cm).items():
        torch.testing.assert_close(full(value), want[name], rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
    return worst


@pytest.mark.parametrize("form", ["ep", "fsep"])
def test_fully_shard_over_a_compiled_model_w2(form):
    worst = pool(2).run(case_fsdp, form, None)
    assert max(worst) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("form", ["ep", "fsep"])
def test_fully_shard_on_a_2x2_mesh_w4(form):
    worst = pool(4).run(case_fsdp, form, 2)
    assert max(worst) <= 1e-5
