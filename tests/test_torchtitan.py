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
from moepass import canonical

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


def test_its_own_bf16_experts_are_detected_computing_in_bf16():
    """torchtitan's GroupedExperts as shipped casts x and its fp32 weights to bf16 around torch._grouped_mm and
    the result back: detected so (`compute_dtype`), checked at bf16's tolerance, and the canonical graph
    reproduces the block far closer than the same spec computing in fp32 does."""
    from dataclasses import replace

    v = TT.VARIANTS[VARIANTS[0]]
    block = TT.moe_block(v, bf16_experts=True)
    report = moepass.detect(block, example_inputs=(torch.randn(B, L, v.dim),))
    assert len(report.blocks) == 1 and not report.rejected, report.summary()
    spec = report.blocks[0]
    assert spec.experts.compute_dtype == "bfloat16" and "experts compute in bfloat16" in spec.summary()
    x = torch.randn(B, L, v.dim)
    want = block(x)
    ours = canonical.build(spec, block)(x)
    in_fp32 = canonical.build(spec.replace(experts=replace(spec.experts, compute_dtype=None)), block)(x)
    assert (ours - want).abs().max() <= 0.05 * (in_fp32 - want).abs().max(), "the casts are not reproduced"


def test_casts_it_does_not_reproduce_are_named():
    """A cast no spec reproduces (here only the gate projection's weight to bf16) is named in the reason."""
    v = TT.VARIANTS["softmax"]
    block = TT.moe_block(v)

    class GateInBF16(TT.FP32GroupedExperts):
        def forward(self, x_ND, num_tokens_per_expert_E):
            offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            h = torch._grouped_mm(x_ND.bfloat16(), self.w1_EFD.bfloat16().transpose(-2, -1), offs=offs).float()
            h = torch.nn.functional.silu(h) * torch._grouped_mm(x_ND, self.w3_EFD.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(h, self.w2_EDF.transpose(-2, -1), offs=offs)

    block.routed_experts.inner_experts.__class__ = GateInBF16
    report = moepass.detect(block, example_inputs=(torch.randn(B, L, v.dim),))
    assert report.blocks == []
    (_, reason), = report.rejected
    assert reason.startswith("it casts routed_experts.inner_experts.w1_EFD to bfloat16 itself. moepass reproduces "
                             "experts that cast their input and weights to bfloat16 and the result back, not these "
                             "casts"), reason
    assert "Plan(blocks={'': None})" in reason


def _tolerance(experts):
    """fp32's, or bf16's where both compute their experts in bf16 (the same casts and GEMMs; the input
    gradient's two bf16 GEMMs summed in bf16 by moepass's backward, in fp32 by autograd's: one unit apart)."""
    eps = torch.finfo(torch.bfloat16).eps
    return {"rtol": RTOL, "atol": ATOL} if experts == "fp32" else {"rtol": 2 * eps, "atol": 2 * eps}


@pytest.mark.parametrize("experts", ["fp32", "bf16"])
@pytest.mark.parametrize("name", VARIANTS)
def test_single_exact_with_three_training_steps(name, experts):
    v = TT.VARIANTS[name]
    ref = TT.moe_block(v, bf16_experts=experts == "bf16")
    tol = _tolerance(experts)
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
        torch.testing.assert_close(outs[1], outs[0], **tol)
        torch.testing.assert_close(xs[1].grad, xs[0].grad, **tol)
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        grads = {n: p.grad for n, p in cm.named_parameters()}
        assert set(grads) == set(ref_grads)
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], **tol, msg=lambda m, n=n: f"{n}: {m}")
        for n, t in _counters(ref).items():
            torch.testing.assert_close(_counters(cm)[n], t, msg=lambda m, n=n: f"buffer {n}: {m}")
        ref_opt.step()
        opt.step()
    assert cm.state_dict().keys() == ref.state_dict().keys()
    for n, t in ref.state_dict().items():
        torch.testing.assert_close(cm.state_dict()[n], t, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def case_distributed(rank, world, name, form, experts="fp32"):
    """The form at W ranks vs torchtitan's block on the whole batch: outputs, the input gradient, every
    parameter gradient (expert shards by their rows), the token counters summed over the ranks."""
    import torch.distributed as dist

    from moepass.runtime.grads import all_reduce_replicated_grads

    v = TT.VARIANTS[name]
    ref = TT.moe_block(v, bf16_experts=experts == "bf16")
    tol = _tolerance(experts)
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
    torch.testing.assert_close(out, ref_out[mine].detach(), **tol)
    torch.testing.assert_close(my_x.grad / world, ref_x.grad[mine], **tol)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    grads = moepass.logical_grads(cm)
    worst = 0.0
    for n, (g, rows) in grads.items():
        want = ref_grads[n] if rows is None else ref_grads[n][rows]
        torch.testing.assert_close(g, want, **tol, msg=lambda m, n=n: f"{n}: {m}")
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


@pytest.mark.distributed
@pytest.mark.parametrize("form", ["ep", "fsep"])
@pytest.mark.parametrize("name", ["expert_bias", "shared_experts"])
def test_distributed_w2_bf16_experts(name, form):
    """torchtitan's own bf16 experts under EP / FSEP at W=2 against the block itself, at bf16's tolerance."""
    reports = pool(2).run(case_distributed, name, form, "bf16")
    assert all(r["forms"] == [form] for r in reports), reports


def test_meta_compile_then_torchtitans_init_with_the_documented_buffer_step(monkeypatch):
    """Built on meta (as torchtitan builds), compiled, `to_empty`, then initialised: torchtitan's walk by class
    reaches the compiled block's children, not the block's own buffers, which need its class's method (USER_GUIDE
    §3); that works on the compiled block because the block's plain attributes (`load_balance_coeff`) are kept.
    The verifier is off: its shape propagation would run torchtitan's router on meta, whose
    `torch.autocast(device_type=x.device.type)` refuses the meta device (the router's own limit)."""
    from torchtitan.models.common.moe import MoE

    monkeypatch.setenv("MOEPASS_VERIFY", "0")
    v = TT.VARIANTS["expert_bias"]
    with torch.device("meta"):
        model = torch.nn.ModuleDict({"moe": TT.config(v).build()})
    model.moe.routed_experts.inner_experts.__class__ = TT.FP32GroupedExperts
    cm = moepass.compile(model, moepass.Plan(form="single"))
    block = cm.moe
    assert isinstance(block, moepass.MoEGraphModule) and block.load_balance_coeff == v.load_balance_coeff
    cm.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*cm.parameters(), *cm.buffers()]:
            t.fill_(float("nan"))
        for t in cm.parameters():  # the parameters' own init (torchtitan's walk reaches the children)
            t.normal_(0, 0.1)
        MoE._init_self_buffers(block)
    assert all(torch.isfinite(t).all() for t in [*cm.parameters(), *cm.buffers()])
    assert not block.tokens_per_expert_E.any() and not block.expert_bias_E.any()
    x = torch.randn(B, L, v.dim)
    assert torch.isfinite(cm.moe(x)).all()
