"""torchtitan's MoE layer (`torchtitan.models.common.moe.MoE`, 0.3.0) as a first-class source.

Tiny random variants (samples/torchtitan_models.py: softmax / sigmoid scores, with and without route_norm,
with the expert-bias buffer of aux-loss-free balancing, shared experts, group-limited selection with a
route scale). Each is detected as one MoE block with nothing keyed on torchtitan's names: the router module
is called as the block calls it (`router(x, expert_bias_E)`, `None` when the block has no bias), its own
selection kept; the experts' 3-D weights are read from the graph; the block's per-expert token counter
(`tokens_per_expert_E`, a buffer every train-mode forward adds the load to) is kept by `moe.count_load`.

Then, against torchtitan's own module (its experts computing the same math in fp32, see the sample):
- `single`: outputs, the input gradient, every parameter gradient, the counter buffer; 3 AdamW steps;
- EP and FSEP at W=2 (gloo): outputs, the input gradient, every parameter gradient (expert shards by their
  rows), the token counters summed over the ranks.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

import moepass

pytest.importorskip("torchtitan")
from samples import torchtitan_models as TT  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _dist import pool  # noqa: E402

VARIANTS = sorted(TT.VARIANTS)
B, L = 2, 6  # per rank
RTOL, ATOL = 1e-5, 1e-5


def _batch(v, step, batches):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(batches * B, L, v.dim, generator=gen), torch.randn(batches * B, L, v.dim, generator=gen)


def _counters(block):
    return {n: t.clone() for n, t in block.named_buffers()}


@pytest.mark.parametrize("name", VARIANTS)
def test_detected_by_structure_and_data_flow(name):
    v = TT.VARIANTS[name]
    report = moepass.detect(TT.moe_block(v))
    assert len(report.blocks) == 1 and not report.rejected, report.summary()
    spec = report.blocks[0]
    assert (spec.num_experts, spec.top_k, spec.experts.hidden_dim) == (v.num_experts, v.top_k, v.dim)
    assert spec.router.logits_from == "selection" and spec.router.module_path == "router"
    assert spec.load_counter is not None and spec.load_counter.paths == ("tokens_per_expert_E",)
    assert (spec.shared is not None) == v.shared_experts
    bias = "expert_bias_E" if v.load_balance_coeff is not None else moepass.spec.Constant(None)
    assert spec.router.module_args == (bias,)


def test_its_own_bf16_experts_are_rejected_naming_the_casts():
    """torchtitan's GroupedExperts as shipped casts x and its weights to bf16 around torch._grouped_mm: no spec
    reproduces that (moepass computes experts in the model's dtype), and the reason says so and what to do."""
    v = TT.VARIANTS[VARIANTS[0]]
    block = TT.config(v).build()  # torchtitan's own classes, the experts' bf16 cast kept
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
    report = moepass.detect(block, example_inputs=(torch.randn(B, L, v.dim),))
    assert report.blocks == []
    (_, reason), = report.rejected
    assert reason.startswith("its experts compute in bfloat16: the block casts its weights "
                             "routed_experts.inner_experts.w1_EFD"), reason
    assert "torch.autocast" in reason and "Plan(blocks={'': None})" in reason


@pytest.mark.parametrize("name", VARIANTS)
def test_single_exact_with_three_training_steps(name):
    v = TT.VARIANTS[name]
    ref = TT.moe_block(v)
    cm = moepass.compile(copy.deepcopy(ref), moepass.Plan(form="single"))
    assert list(cm.moepass_info.rewritten) == [""]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(cm.parameters(), lr=1e-2)
    for step in range(3):
        x, target = _batch(v, step, 1)
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        outs = []
        for model, xi, o in ((ref, xs[0], ref_opt), (cm, xs[1], opt)):
            o.zero_grad()
            out = model(xi)
            (out * target).sum().backward()
            outs.append(out.detach())
        torch.testing.assert_close(outs[1], outs[0], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=RTOL, atol=ATOL)
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        grads = {n: p.grad for n, p in cm.named_parameters()}
        assert set(grads) == set(ref_grads)
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")
        for n, t in _counters(ref).items():
            torch.testing.assert_close(_counters(cm)[n], t, msg=lambda m, n=n: f"buffer {n}: {m}")
        ref_opt.step()
        opt.step()
    assert cm.state_dict().keys() == ref.state_dict().keys()
    for n, t in ref.state_dict().items():
        torch.testing.assert_close(cm.state_dict()[n], t, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def case_distributed(rank, world, name, form):
    """The form at W ranks vs torchtitan's block on the whole batch: outputs, the input gradient, every
    parameter gradient (expert shards by their rows), the token counters summed over the ranks."""
    import torch.distributed as dist

    from moepass.runtime.grads import all_reduce_replicated_grads

    v = TT.VARIANTS[name]
    ref = TT.moe_block(v)
    plan = moepass.Plan(form=form, **({"slots_per_device": v.num_experts // world + 1} if form == "fsep" else {}))
    cm = moepass.compile(copy.deepcopy(ref), plan)
    assert list(cm.moepass_info.rewritten) == [""], cm.moepass_info
    ref.train()
    cm.train()
    x, target = _batch(v, 0, world)
    mine = slice(rank * B, (rank + 1) * B)
    ref_x = x.clone().requires_grad_()
    ref_out = ref(ref_x)
    ((ref_out * target).sum() / world).backward()
    # each rank's loss is its own batch's; the gradients are averaged over the ranks (as under DDP: dense ones by
    # all_reduce_replicated_grads, the experts' by the form itself), so the reference loss is the ranks' mean
    my_x = x[mine].clone().requires_grad_()
    out = cm(my_x)
    (out * target[mine]).sum().backward()
    all_reduce_replicated_grads(cm)
    torch.testing.assert_close(out, ref_out[mine].detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(my_x.grad / world, ref_x.grad[mine], rtol=RTOL, atol=ATOL)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    grads = moepass.logical_grads(cm)
    worst = 0.0
    for n, (g, rows) in grads.items():
        want = ref_grads[n] if rows is None else ref_grads[n][rows]
        torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")
        worst = max(worst, (g - want).abs().max().item())
    counted = {n for n, g in ref_grads.items() if g is not None}
    missing = counted - set(grads)
    assert all("experts" in n for n in missing), sorted(missing)
    counter = dict(cm.named_buffers())["tokens_per_expert_E"].clone()
    dist.all_reduce(counter)
    torch.testing.assert_close(counter, ref.tokens_per_expert_E)
    return {"grad": worst, "forms": sorted({gm.form for gm in cm.moepass_info.rewritten.values()})}


@pytest.mark.distributed
@pytest.mark.parametrize("form", ["ep", "fsep"])
@pytest.mark.parametrize("name", VARIANTS)
def test_distributed_w2_exact(name, form):
    reports = pool(2).run(case_distributed, name, form)
    assert all(r["forms"] == [form] for r in reports), reports
