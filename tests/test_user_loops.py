"""Training code as users write it, under EP and FSEP at W=2 (gloo pool of tests/_dist.py), against the original:

- a layer that adds its residual into the MoE block's output in place (`h = mlp(x); h += x`);
- gradient accumulation over micro-batches with `Plan(grad_sync="scheduler")` and replicated experts
  (`ep_size=1`: every rank holds every expert, their gradients summed over the replicas);
- one expert frozen before compile: the stacking forms refuse it, naming the block and the fix.

Reference convention as in tests/test_ep.py: the original on the global batch, each rank its slice, the
loss of each micro-batch the global mean (rank r's share scaled by W), fp32.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402

pytestmark = pytest.mark.distributed

CFG = dict(dim=32, ffn_dim=64, num_experts=4, top_k=2, layers=2, heads=4, vocab_size=64)
RTOL, ATOL = 1e-5, 1e-6


def _tokens(step: int, batch: int = 4, seq: int = 9) -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(100 + step))


def case_inplace_residual(rank, world, form):
    """Every MoE block's output modified in place by its caller: forward and gradients as the original's."""
    import moepass
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    model = tiny_mixtral(**CFG)
    for layer in model.layers:  # the caller adds into the block's output in place
        block = layer.mlp
        layer.mlp = InplaceAdd(block)
    cm = moepass.compile(model, moepass.Plan(form=form))
    tokens = _tokens(0)
    mine = tokens.chunk(world)[rank]
    cm.loss(mine).backward()
    model.loss(tokens).backward()
    worst = 0.0
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, (g, rows) in moepass.logical_grads(cm).items():
        want = grads[name] if rows is None else grads[name][rows]
        if ".experts." not in name:  # replicated: averaged over the ranks, as DDP does
            torch.distributed.all_reduce(g)
            g = g / world
        torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
        worst = max(worst, float((g - want).abs().max()))
    return {"rewritten": len(cm.moepass_info.rewritten), "grad": worst}


class InplaceAdd(torch.nn.Module):
    """`y = block(x); y += x` (a residual written into the block's output)."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        y = self.block(x)
        y += x
        return y


def case_accumulation(rank, world, form):
    """Two micro-batches accumulated before a step, experts replicated (ep_size=1), the scheduler's gradient
    sync: every accumulated gradient equals the original's."""
    import moepass
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    model = tiny_mixtral(**CFG)
    cm = moepass.compile(model, moepass.Plan(form=form, ep_size=1, grad_sync="scheduler"))
    micro = [_tokens(0), _tokens(1)]
    for tokens in micro:
        (model.loss(tokens) / len(micro)).backward()
        (cm.loss(tokens.chunk(world)[rank]) / len(micro)).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    worst = 0.0
    for name, (g, rows) in moepass.logical_grads(cm).items():
        want = grads[name] if rows is None else grads[name][rows]
        torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
        worst = max(worst, float((g - want).abs().max()))
    return {"grad": worst, "experts": sum(".experts." in n for n in grads)}


def case_frozen_expert(rank, world, form):
    import moepass
    from samples.models import tiny_mixtral

    model = tiny_mixtral(style="loop", **CFG)
    for p in model.layers[0].mlp.experts[2].parameters():
        p.requires_grad_(False)
    try:
        moepass.compile(model, moepass.Plan(form=form))
    except moepass.PlanError as err:
        return str(err)
    return None


@pytest.mark.parametrize("form", ["ep", "fsep"])
def test_an_inplace_residual_into_the_block_output_trains_as_the_original(form):
    reports = pool(2).run(case_inplace_residual, form, timeout=120)
    assert [r["rewritten"] for r in reports] == [2, 2]


@pytest.mark.parametrize("form", ["ep", "fsep"])
def test_accumulated_gradients_of_replicated_experts_under_the_scheduler_sync(form):
    reports = pool(2).run(case_accumulation, form, timeout=120)
    assert all(r["experts"] > 0 for r in reports)


@pytest.mark.parametrize("form", ["ep", "fsep"])
def test_one_frozen_expert_is_refused_with_the_way_out(form):
    messages = pool(2).run(case_frozen_expert, form, timeout=120)
    for message in messages:
        assert message is not None
        assert "layers.0.mlp has frozen experts beside trainable ones" in message, message
        assert "experts.2." in message and "form='single'" in message
