"""MoE blocks written the ways training frameworks write them, found from the model's recorded forward.

Each case is a small hand-written model (no framework imported): the block is found where its selection
drives its experts (`moepass.detect.graph_candidates`), called as the model calls it, and either reproduced
exactly under `single` (outputs, every gradient) or reported with the reason and the way out — never
silent, never raised.

Shape legend: B batch, S sequence, D model width, F expert hidden width, E experts, K top-k.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moepass
from moepass.detect import recorded_blocks
from moepass.detect.graph_candidates import graph_blocks, record_model

D, FF, E, K, V = 16, 24, 4, 2, 32


class SpreadExperts(nn.Module):
    """Experts held by two sibling modules, one [E, ...] weight each, plus a bias on the combined output."""

    def __init__(self):
        super().__init__()
        self.up = nn.Module()
        self.up.weight = nn.Parameter(torch.randn(E, 2 * FF, D) / D**0.5)
        self.down = nn.Module()
        self.down.weight = nn.Parameter(torch.randn(E, D, FF) / FF**0.5)
        self.router = nn.Linear(D, E, bias=False)
        self.bias = nn.Parameter(torch.randn(D) * 0.1)

    def forward(self, x_BSD, mask_BS=None):
        x_TD = x_BSD.reshape(-1, D)
        probs_TE = self.router(x_TD).softmax(-1)
        w_TK, e_TK = probs_TE.topk(K, dim=-1)
        w_TK = w_TK / w_TK.sum(-1, keepdim=True)
        out_TD = torch.zeros_like(x_TD)
        for e in range(E):
            rows, slot = torch.where(e_TK == e)
            if rows.numel() == 0:
                continue
            gate, up = F.linear(x_TD[rows], self.up.weight[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down.weight[e])
            out_TD.index_add_(0, rows, y * w_TK[rows, slot, None])
        return (out_TD + self.bias).view_as(x_BSD)


class FlatExperts(nn.Module):
    """Expert weights stored flattened, [E·F, D], viewed as [E, F, D] inside the forward."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E * FF, D) / D**0.5)
        self.w2 = nn.Parameter(torch.randn(E * FF, D) / FF**0.5)
        self.gate = nn.Linear(D, E, bias=False)

    def forward(self, x_BSD):
        x_TD = x_BSD.reshape(-1, D)
        w_TK, e_TK = self.gate(x_TD).softmax(-1).topk(K, dim=-1)
        w1_EFD, w2_EFD = self.w1.view(E, FF, D), self.w2.view(E, FF, D)
        h_TKF = F.gelu(torch.einsum("td,tkfd->tkf", x_TD, w1_EFD[e_TK]))
        y_TKD = torch.einsum("tkf,tkfd->tkd", h_TKF, w2_EFD[e_TK])
        return (y_TKD * w_TK[..., None]).sum(1).view_as(x_BSD)


class ReturnsMore(SpreadExperts):
    """A block returning (out, extra) as frameworks do: None (a bias slot), its per-expert load, an aux loss."""

    extra = "none"

    def forward(self, x_BSD, mask_BS=None):
        out = super().forward(x_BSD, mask_BS)
        if self.extra == "none":
            return out, None
        e_TK = self.router(x_BSD.reshape(-1, D)).softmax(-1).topk(K, dim=-1).indices
        load_E = torch.bincount(e_TK.reshape(-1), minlength=E)
        if self.extra == "load":
            return out, load_E
        probs_E = self.router(x_BSD.reshape(-1, D)).softmax(-1).mean(0)
        return out, E * (load_E.float() / e_TK.numel() * probs_E).sum()  # a switch-style aux loss


class PostNorm(SpreadExperts):
    """A block that normalises what it returns (its last call: a norm on the combined output)."""

    def __init__(self):
        super().__init__()
        self.post_norm = nn.LayerNorm(D)
        with torch.no_grad():
            self.post_norm.weight.uniform_(0.5, 1.5)

    def forward(self, x_BSD, mask_BS=None):
        return self.post_norm(super().forward(x_BSD, mask_BS))


class InputWeighted(nn.Module):
    """Weights on the experts' input (Llama-4 style): every expert runs on every token times its score (sigmoid of
    the top-k logits, zero for the experts not chosen), the outputs summed; it returns [T, D] tokens."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, D, 2 * FF) / D**0.5)
        self.down = nn.Parameter(torch.randn(E, FF, D) / FF**0.5)

    def forward(self, x_BSD):
        x_TD = x_BSD.reshape(-1, D)
        logits_TE = self.router(x_TD)
        top_TK, e_TK = logits_TE.topk(K, dim=-1)
        scores_TE = torch.full_like(logits_TE, float("-inf")).scatter(1, e_TK, top_TK).sigmoid()
        x_ETD = x_TD.unsqueeze(0) * scores_TE.t().unsqueeze(-1)
        gate_ETF, up_ETF = torch.bmm(x_ETD, self.gate_up).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate_ETF) * up_ETF, self.down).sum(0)


class SoftcappedExperts(nn.Module):
    """Fused [E, 2F, D] / [E, D, F] experts whose activation is a softcapped SwiGLU, `cap_g(g) * sigmoid(g) *
    cap_u(u)` with `cap_c(v) = c * tanh(v / c)`, run in a loop over the experts that were hit."""

    GATE_CAP, UP_CAP = 0.5, 2.0

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, 2 * FF, D) / D**0.5)
        self.down = nn.Parameter(torch.randn(E, D, FF) / FF**0.5)

    def forward(self, x_BSD):
        x_TD = x_BSD.reshape(-1, D)
        w_TK, e_TK = self.router(x_TD).softmax(-1).topk(K, dim=-1)
        out_TD = torch.zeros_like(x_TD)
        for e in e_TK.unique().tolist():
            rows, slot = torch.where(e_TK == e)
            g, u = F.linear(x_TD[rows], self.gate_up[e]).chunk(2, dim=-1)
            a = torch.tanh(g / self.GATE_CAP) * self.GATE_CAP * torch.sigmoid(g) * (torch.tanh(u / self.UP_CAP)
                                                                                   * self.UP_CAP)
            out_TD.index_add_(0, rows, F.linear(a, self.down[e]) * w_TK[rows, slot, None])
        return out_TD.view_as(x_BSD)


class Layer(nn.Module):
    def __init__(self, moe: nn.Module, pass_mask: bool, kw_only: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.moe = moe
        self.pass_mask, self.kw_only = pass_mask, kw_only

    def forward(self, h, mask):
        if self.kw_only:
            out = self.moe(self.norm(h), mask_BS=mask)
        else:
            out = self.moe(self.norm(h), mask) if self.pass_mask else self.moe(self.norm(h))
        if isinstance(out, tuple):  # (out, extra): the extra is the model's business (summed into a loss, say)
            out, extra = out
            self.extra = extra
        return h + out.view_as(h)  # a block may return [T, D] tokens


class LM(nn.Module):
    def __init__(self, make, layers=2, pass_mask=False, kw_only=False):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Layer(make(), pass_mask, kw_only) for _ in range(layers))
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids_BS, mask_BS=None):
        h = self.embed(ids_BS)
        mask = torch.ones_like(ids_BS, dtype=torch.bool) if mask_BS is None else mask_BS
        for layer in self.layers:
            h = layer(h, mask)
        return self.head(h)


def _ids(seed=0):
    return torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(seed))


def _assert_exact(model, cm, ids):
    target = torch.randn(2, 6, V, generator=torch.Generator().manual_seed(9))
    outs = []
    for m in (model, cm):
        m.zero_grad()
        out = m(ids)
        (out * target).sum().backward()
        outs.append(out.detach())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for n, p in cm.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_graph_blocks_anchor_where_selection_meets_experts():
    torch.manual_seed(0)
    model = LM(SpreadExperts)
    cap = record_model(model, (_ids(),))
    assert not isinstance(cap, str), cap
    blocks = graph_blocks(cap, model)
    assert [b.path for b in blocks] == ["layers.0.moe", "layers.1.moe"]
    assert blocks[0].num_experts == E and blocks[0].router_params == ("layers.0.moe.router.weight",)
    assert set(blocks[0].expert_params) >= {"layers.0.moe.up.weight", "layers.0.moe.down.weight"}
    assert blocks[0].call is not None and blocks[0].call.args[0].shape == (2, 6, D)  # as the model called it


def test_experts_over_sibling_modules_with_an_output_bias_are_exact():
    torch.manual_seed(0)
    model = LM(SpreadExperts)
    report = moepass.detect(model)
    assert [s.path for s in report.blocks] == ["layers.0.moe", "layers.1.moe"], report.summary()
    assert report.blocks[0].output_bias is not None and report.blocks[0].output_bias.paths == ("bias",)
    assert "synthesized input" in report.summary()
    cm = moepass.compile(copy.deepcopy(model), moepass.Plan(form="single"))
    assert sorted(cm.moepass_info.rewritten) == ["layers.0.moe", "layers.1.moe"]
    _assert_exact(model, cm, _ids(1))


def test_block_called_with_an_unread_mask_is_called_as_the_model_calls_it():
    torch.manual_seed(0)
    model = LM(SpreadExperts, pass_mask=True)
    report = moepass.detect(model, example_inputs=(_ids(),))
    assert len(report.blocks) == 2, report.summary()
    spec = report.blocks[0]
    assert spec.input_names == ("hidden_states", "mask_BS") and spec.unused_inputs == ("mask_BS",)
    assert "example input" in report.summary()
    cm = moepass.compile(copy.deepcopy(model), moepass.Plan(form="single"))
    assert len(cm.moepass_info.rewritten) == 2
    _assert_exact(model, cm, _ids(2))


class TransposedRouter(SpreadExperts):
    """The router's weight stored [D, E] (scores = x @ w), not as an nn.Linear."""

    def __init__(self):
        super().__init__()
        del self.router  # the method below takes its place
        self.w_router = nn.Parameter(torch.randn(D, E) / D**0.5)

    def router(self, x):
        return x @ self.w_router


class KeywordOnly(SpreadExperts):
    def forward(self, x_BSD, *, mask_BS=None):
        return super().forward(x_BSD, mask_BS)


def test_transposed_router_weight_is_read_as_its_transpose():
    torch.manual_seed(0)
    model = LM(TransposedRouter)
    report = moepass.detect(model)
    assert len(report.blocks) == 2, report.summary()
    weight = report.blocks[0].router.weight
    assert weight.paths == ("w_router",) and weight.transpose
    cm = moepass.compile(copy.deepcopy(model), moepass.Plan(form="single"))
    _assert_exact(model, cm, _ids(5))


def test_mask_passed_by_keyword_is_taken_by_name():
    torch.manual_seed(0)
    model = LM(SpreadExperts, kw_only=True)
    report = moepass.detect(model)
    assert len(report.blocks) == 2 and report.blocks[0].unused_inputs == ("mask_BS",), report.summary()
    cm = moepass.compile(copy.deepcopy(model), moepass.Plan(form="single"))
    assert len(cm.moepass_info.rewritten) == 2
    _assert_exact(model, cm, _ids(3))


def test_keyword_only_argument_is_rejected_with_the_way_out():
    torch.manual_seed(0)
    model = LM(KeywordOnly, kw_only=True)
    report = moepass.detect(model)
    assert not report.blocks
    assert [p for p, _ in report.rejected] == ["layers.0.moe", "layers.1.moe"], report.summary()
    reason = report.rejected[0][1]
    assert "['mask_BS'] (keyword-only" in reason and "Plan(blocks={'layers.0.moe': None})" in reason


class FlatLinearExperts(nn.Module):
    """One flattened expert tensor, [E·D, D]: each expert a bare linear map (no FFN to read)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E * D, D) / D**0.5)
        self.gate = nn.Linear(D, E, bias=False)

    def forward(self, x_BSD):
        x_TD = x_BSD.reshape(-1, D)
        w_TK, e_TK = self.gate(x_TD).softmax(-1).topk(K, dim=-1)
        y_TKD = torch.einsum("td,tked->tke", x_TD, self.w.view(E, D, D)[e_TK])
        return (y_TKD * w_TK[..., None]).sum(1).view_as(x_BSD)


def test_flattened_expert_weights_are_read_as_e_f_d_and_exact():
    """[E·F, D] tensors viewed as [E, F, D] in the forward: read through `TensorSource.unflatten` (the in-projection
    as nn.Linear weights, the down projection as `h @ W`: opposite orientations), exact under single."""
    torch.manual_seed(0)
    model = LM(FlatExperts)
    report = moepass.detect(model)
    assert [b.path for b in report.blocks] == ["layers.0.moe", "layers.1.moe"], report.summary()
    x = report.blocks[0].experts
    assert (x.w_gate.paths, x.w_gate.unflatten, x.w_gate.transpose) == (("w1",), FF, False)
    assert (x.w_down.paths, x.w_down.unflatten, x.w_down.transpose) == (("w2",), FF, True)
    cm = moepass.compile(copy.deepcopy(model), moepass.Plan(form="single"))
    _assert_exact(model, cm, _ids(2))


def test_weights_on_the_experts_input_are_read_from_the_graph_and_exact():
    """The selected scores reach the experts' first matmul (`x * score` before `bmm`): MoESpec.weights_on='input',
    and the block's [T, D] return is kept (`flat_output`); exact under single. The distributed forms refuse it
    with the way out."""
    torch.manual_seed(0)
    model = LM(InputWeighted)
    report = moepass.detect(model)
    assert [(b.path, b.weights_on, b.flat_output) for b in report.blocks] == [
        ("layers.0.moe", "input", True), ("layers.1.moe", "input", True)], report.summary()
    assert "weights on the experts' input" in report.summary()
    cm = moepass.compile(copy.deepcopy(model), moepass.Plan(form="single"))
    _assert_exact(model, cm, _ids(2))


def test_softcapped_swiglu_caps_are_read_from_the_graph_and_exact():
    """The caps are the constants of the graph's `tanh(v / c)` calls (gate's first): the spec's activation is
    softcapped_swiglu with them, its forward and backward (`moepass.activations`) exact under single."""
    from moepass.activations import activate, activate_backward

    torch.manual_seed(0)
    model = LM(SoftcappedExperts)
    report = moepass.detect(model)
    x = report.blocks[0].experts if report.blocks else None
    assert x is not None and (x.activation, x.clamp_limit, x.swiglu_alpha) == ("softcapped_swiglu", 0.5, 2.0), \
        report.summary()
    cm = moepass.compile(copy.deepcopy(model), moepass.Plan(form="single"))
    _assert_exact(model, cm, _ids(2))
    g, u = (torch.randn(5, 7, dtype=torch.float64, requires_grad=True) * 3 for _ in range(2))
    grad_a = torch.randn(5, 7, dtype=torch.float64)
    ref = torch.autograd.grad(activate(g, u, "softcapped_swiglu", 0.5, 2.0), (g, u), grad_a)
    got = activate_backward(grad_a, g.detach(), u.detach(), "softcapped_swiglu", 0.5, 2.0)
    torch.testing.assert_close(got, ref)


def test_flattened_expert_weights_no_rule_reads_are_reported_not_silent():
    torch.manual_seed(0)
    model = LM(FlatLinearExperts)
    report = moepass.detect(model)
    assert not report.blocks
    assert [p for p, _ in report.rejected] == ["layers.0.moe", "layers.1.moe"], report.summary()
    reason = report.rejected[0][1]
    assert f"selection over E={E} scores" in reason and "flattened" in reason and "w [64, 16]" in reason
    assert "moepass_spec" in reason and "Plan(blocks={'layers.0.moe': None})" in reason


def test_detect_leaves_the_model_and_rng_alone():
    torch.manual_seed(0)
    model = LM(SpreadExperts)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    moepass.detect(model)
    assert torch.equal(torch.rand(2), expected)
    assert model.training and all(m.training for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_example_inputs_as_a_batch_mapping_are_keyword_arguments():
    """A tokenizer's batch, as users hold it: recorded as `model(**batch)`, not as one positional argument."""
    torch.manual_seed(0)
    model = LM(SpreadExperts)
    batch = {"ids_BS": _ids(4), "mask_BS": torch.ones(2, 6, dtype=torch.bool)}
    blocks, note = recorded_blocks(model, batch, None)
    assert note == "forward recorded on the example input" and [b.path for b in blocks] == ["layers.0.moe", "layers.1.moe"]
    report = moepass.detect(model, example_inputs=batch)
    assert [b.path for b in report.blocks] == ["layers.0.moe", "layers.1.moe"], report.summary()


@pytest.mark.parametrize("inputs", [None, "meta"])
def test_unrecordable_model_falls_back_to_structure(inputs):
    if inputs == "meta":
        with torch.device("meta"):
            model = LM(SpreadExperts)
        note = recorded_blocks(model, None, None)[1]
        assert "meta device" in note
    else:
        model = nn.Sequential(nn.LayerNorm(D), SpreadExperts())  # starts with neither embedding nor linear
        note = recorded_blocks(model, None, None)[1]
        assert "pass example_inputs" in note


@pytest.mark.parametrize("extra", ["none", "load"])
def test_returned_none_and_expert_load_are_reproduced(extra):
    torch.manual_seed(0)
    ReturnsMore.extra = extra
    model = LM(ReturnsMore)
    report = moepass.detect(model)
    assert len(report.blocks) == 2, report.summary()
    want = ("none",) if extra == "none" else ("expert_load.int64",)
    assert report.blocks[0].side_outputs == want
    cm = moepass.compile(copy.deepcopy(model), moepass.Plan(form="single"))
    assert len(cm.moepass_info.rewritten) == 2
    _assert_exact(model, cm, _ids(4))
    for a, b in zip(model.layers, cm.layers):
        assert (a.extra is None and b.extra is None) or torch.equal(a.extra, b.extra)


def test_returned_aux_loss_is_named_in_the_rejection():
    torch.manual_seed(0)
    ReturnsMore.extra = "aux"
    model = LM(ReturnsMore)
    report = moepass.detect(model)
    assert not report.blocks, report.summary()
    reason = report.rejected[0][1]
    assert "It returns output 1 ([] float32, a scalar: an aux loss?), which no rule reproduces" in reason
    assert "Plan(blocks={'layers.0.moe': None})" in reason


def case_ep(rank, world, extra):
    """EP at W ranks on the framework-style LM (mask passed through, an extra output, an output bias) vs the
    whole batch on one process: outputs, every gradient (expert shards by rows), the returned extras."""
    from moepass.runtime.grads import all_reduce_replicated_grads

    torch.manual_seed(0)
    if extra == "input_weighted":  # weights on the experts' input: single only, EP says so and what to do
        with pytest.raises(moepass.PlanError, match=r"weights_on='input'.*form='single'.*Plan\(blocks="):
            moepass.compile(LM(InputWeighted), moepass.Plan(form="ep"), example_inputs=(_ids(),))
        return True
    ReturnsMore.extra = extra
    make = dict(post_norm=PostNorm, flat=FlatExperts, softcapped=SoftcappedExperts).get(extra, ReturnsMore)
    model = LM(make, pass_mask=make is ReturnsMore or make is PostNorm)
    cm = moepass.compile(copy.deepcopy(model), moepass.Plan(form="ep"), example_inputs=(_ids(),))
    assert sorted(cm.moepass_info.rewritten) == ["layers.0.moe", "layers.1.moe"]
    ids = torch.randint(0, V, (2 * world, 6), generator=torch.Generator().manual_seed(7))
    target = torch.randn(2 * world, 6, V, generator=torch.Generator().manual_seed(8))
    mine = slice(2 * rank, 2 * rank + 2)
    ref_out = model(ids)
    ((ref_out * target).sum() / world).backward()
    out = cm(ids[mine])
    (out * target[mine]).sum().backward()
    all_reduce_replicated_grads(cm)
    torch.testing.assert_close(out, ref_out[mine].detach(), rtol=1e-5, atol=1e-5)
    ref_grads = dict((n, p.grad) for n, p in model.named_parameters())
    for n, (g, rows) in moepass.logical_grads(cm).items():
        want = ref_grads[n] if rows is None else ref_grads[n][rows]
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    if extra == "load":  # each rank returns its own tokens' load; summed, the whole batch's
        for a, b in zip(model.layers, cm.layers):
            load = b.extra.clone()
            torch.distributed.all_reduce(load)
            torch.testing.assert_close(load, a.extra)
    return True


def test_norm_on_the_returned_output_is_called_last():
    torch.manual_seed(0)
    model = LM(PostNorm)
    report = moepass.detect(model)
    assert [b.output_module for b in report.blocks] == ["post_norm", "post_norm"], report.summary()
    cm = moepass.compile(copy.deepcopy(model), moepass.Plan(form="single"))
    _assert_exact(model, cm, _ids(2))


@pytest.mark.distributed
@pytest.mark.parametrize("extra", ["none", "load", "post_norm", "flat", "softcapped", "input_weighted"])
def test_framework_style_block_exact_under_ep_w2(extra):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from _dist import pool

    assert pool(2).run(case_ep, extra) == [True, True]
