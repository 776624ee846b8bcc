"""Optimizer steps over a compiled model that mixes DTensor expert weights with plain tensors
(moepass/runtime/optim.py).

On CUDA torch's optimizers default to their multi-tensor (`foreach`) kernels, which refuse a list mixing
DTensors and plain tensors; here the same kernels are asked for explicitly on CPU (foreach=True), so the
failure a GPU user would meet without moepass's step hooks reproduces on gloo.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moepass
from moepass.runtime import optim
from moepass.runtime.grads import all_reduce_replicated_grads
from samples.models import tiny_mixtral

LM = dict(vocab_size=64, dim=32, ffn_dim=64, top_k=2, layers=2, heads=4, num_experts=4)
B_PER_RANK, SEQ = 2, 8


def case_foreach_step(rank: int, world: int, form: str, kind: str, hooks: bool) -> dict:
    """Two AdamW steps (`kind`: foreach or fused kernels) of the compiled model at W ranks against the untouched
    model's on the global batch, with clipping; {"loss", "param", "norm"}: the largest differences, or
    {"error"}: what the step raised."""
    torch.manual_seed(0)
    model = tiny_mixtral(style="loop", **LM)
    cm = moepass.compile(model, moepass.Plan(form=form, topology=moepass.Topology(1, world)))
    if not hooks:
        optim.disable_mixed_steps()
    options = {kind: True}
    opt = torch.optim.AdamW(cm.parameters(), lr=1e-2, **options)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    out = {"loss": 0.0, "param": 0.0, "norm": 0.0}
    try:
        for step in range(2):
            tokens = torch.randint(0, LM["vocab_size"], (world * B_PER_RANK, SEQ + 1),
                                   generator=torch.Generator().manual_seed(step))
            ref_loss = model.loss(tokens)
            ref_loss.backward()
            loss = cm.loss(tokens[rank * B_PER_RANK:(rank + 1) * B_PER_RANK])
            loss.backward()
            all_reduce_replicated_grads(cm)
            ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            norm = moepass.clip_grad_norm_(cm.parameters(), 0.05)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            out["loss"] = max(out["loss"], abs(loss.item() / world - ref_loss.item()))
            out["norm"] = max(out["norm"], abs(norm.item() - ref_norm.item()))
    except RuntimeError as err:
        return {"error": str(err).splitlines()[0]}
    finally:
        optim.enable_mixed_steps()
    ref = dict(model.named_parameters())
    state = moepass.logical_state_dict(cm)
    for name, value in state.items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        out["param"] = max(out["param"], (value - ref[name].detach()).abs().max().item())
    return out


@pytest.mark.parametrize("form,kind", [("ep", "foreach"), ("fsep", "foreach"), ("ep", "fused")])
def test_multi_tensor_adamw_with_clipping_matches_the_untouched_model(form, kind):
    from tests._dist import pool

    for result in pool(2).run(case_foreach_step, form, kind, True):
        assert "error" not in result, result
        assert result["loss"] < 1e-5 and result["norm"] < 1e-5 and result["param"] < 1e-5, result


def test_without_the_step_hooks_foreach_fails_on_the_mix():
    """What a GPU user met before: the hooks are what makes the step work."""
    from tests._dist import pool

    for result in pool(2).run(case_foreach_step, "ep", "foreach", False):
        assert "got mixed torch.Tensor and DTensor" in result.get("error", ""), result


def test_mixes_dtensors_needs_both_kinds():
    assert not optim.mixes_dtensors([torch.zeros(1), torch.zeros(2)])
    assert not optim.mixes_dtensors([])
