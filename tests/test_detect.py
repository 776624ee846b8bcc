"""moepass.detect: the three hand-written styles are found and described; others are rejected untouched."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import moepass
from moepass.detect.check import semantic_check
from samples.models import ExpertMLP, FusedMoE, GShardMoE, LoopMoE, SampleConfig, TinyMoELM


def test_each_style_gets_its_recogniser_and_spec():
    model = TinyMoELM(SampleConfig(style="mixed", layers=4, dense_layers=1))
    report = moepass.detect(model)
    by_path = {d.path: d for d in report.details}
    assert sorted(by_path) == ["layers.1.mlp", "layers.2.mlp", "layers.3.mlp"]
    assert [by_path[p].recogniser for p in sorted(by_path)] == ["fused-3d", "gshard-capacity", "modulelist-loop"]
    fused, gshard, loop = (by_path[p].spec for p in sorted(by_path))
    assert (loop.num_experts, loop.top_k, loop.experts.activation, loop.capacity) == (8, 2, "swiglu", None)
    assert fused.shared is not None and fused.shared.gate_path == "shared_expert_gate"
    assert gshard.capacity is not None and gshard.capacity.capacity_factor == 1.25
    assert gshard.capacity.priority == "k_major" and gshard.router.bias is not None
    assert gshard.experts.activation == "gelu" and gshard.experts.b_gate is not None
    assert report.dense == ["layers.0.mlp"]
    assert report.rejected == []


def test_dense_model_gives_an_empty_report():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), ExpertMLP(16, 32), nn.Linear(16, 4))
    report = moepass.detect(model)
    assert report.blocks == [] and report.rejected == [] and len(report) == 0


def test_a_dense_ffn_declaring_its_down_projection_anywhere_is_listed():
    """torchtitan and Llama-style code declare w1 (gate), w2 (down), w3 (up): the down projection is found by its
    shape (F -> D), not by its place among the children."""

    class FeedForward(nn.Module):
        def __init__(self, D=8, F=24):
            super().__init__()
            self.w1, self.w2, self.w3 = nn.Linear(D, F, bias=False), nn.Linear(F, D, bias=False), nn.Linear(D, F)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    model = nn.Sequential(FeedForward(), FusedMoE(8, 16, 4, 2), FeedForward())
    report = moepass.detect(model, example_inputs=(torch.randn(2, 5, 8),))
    assert [s.path for s in report.blocks] == ["1"] and report.dense == ["0", "2"], report.summary()


def test_the_callers_autocast_does_not_change_the_verdict():
    """detect inside the training step's bf16 autocast reads the blocks as outside it (the probes run in fp32)."""
    model = TinyMoELM(SampleConfig(style="mixed", layers=4, dense_layers=1))
    tokens = torch.randint(0, 32, (2, 9))
    outside = moepass.detect(model, example_inputs=(tokens,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = moepass.detect(model, example_inputs=(tokens,))
        assert torch.is_autocast_enabled("cpu")  # the caller's autocast is back
    assert inside.summary() == outside.summary() and len(inside.blocks) == 3 and not inside.rejected


def test_detection_never_mutates_the_model():
    model = TinyMoELM(SampleConfig(style="mixed", layers=3))
    before = copy.deepcopy(model.state_dict())
    moepass.detect(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class SquaredWeightsMoE(LoopMoE):
    """A combination no hypothesis covers: each chosen expert weighted by its probability squared."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        probs = self.gate(x).softmax(-1)
        w, idx = probs.topk(self.top_k, dim=-1)
        w = w * w
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(self.top_k):
                out[t] += w[t, k] * self.experts[int(idx[t, k])](x[t])
        return out.reshape(hidden_states.shape)


def test_unreproducible_block_is_rejected_with_reason_and_left_untouched():
    model = nn.Sequential(SquaredWeightsMoE(16, 32, 4, 2))
    report = moepass.detect(model)
    assert report.blocks == []
    ((path, reason),) = report.rejected
    assert path == "0" and "no hypothesis reproduces the block" in reason and "outputs differ by up to" in reason
    compiled = moepass.compile(model)
    assert isinstance(compiled[0], SquaredWeightsMoE)


def test_near_miss_hypothesis_is_rejected_by_the_check():
    block = LoopMoE(16, 32, 6, 2, renormalize=True)
    (spec,) = moepass.detect(block).blocks
    no_renorm = spec.replace(router=spec.router.__class__(**{**spec.router.__dict__, "renormalize": False}))
    winner, tried = semantic_check(block, [no_renorm])
    assert winner is None and "outputs differ" in tried[0].reason
    wrong_k = spec.replace(router=spec.router.__class__(**{**spec.router.__dict__, "top_k": 1}))
    winner, tried = semantic_check(block, [wrong_k])
    assert winner is None and "outputs differ" in tried[0].reason


def test_renormalize_false_attribute_is_tried_first_and_accepted():
    block = LoopMoE(16, 32, 6, 2, renormalize=False)
    (detail,) = moepass.detect(block).details
    assert detail.accepted and detail.spec.router.renormalize is False and len(detail.tried) == 1


def test_selection_is_compared_exactly():
    block = FusedMoE(16, 24, 5, 2)
    (detail,) = moepass.detect(block).details
    assert detail.check.selection_observed and detail.check.compared_tokens > 0
    assert detail.check.mismatched_tokens == 0


def test_gshard_capacity_drops_are_reproduced():
    block = GShardMoE(16, 24, 4, 2, capacity_factor=0.5)  # tight: many drops
    (detail,) = moepass.detect(block).details
    assert detail.accepted and detail.spec.capacity.capacity_factor == 0.5


def test_a_0d_parameter_beside_the_router_is_no_router_candidate():
    """A scalar parameter in the block (e.g. a learnable temperature kept for later) is not a router weight
    candidate: detection reads each parameter's shape only once it is 2-D (it used to raise IndexError)."""
    torch.manual_seed(0)
    block = LoopMoE(16, 32, 4, 2)
    block.temperature = torch.nn.Parameter(torch.tensor(1.0))
    (spec,) = moepass.detect(block).blocks
    assert spec.router.weight.paths == ("gate.weight",) and spec.num_experts == 4


class LearnedTemperatureRouter(nn.Module):
    """Routes on softmax(x W^T / t), t a learnable temperature, renormalised over the K chosen."""

    def __init__(self, dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x_TD):
        probs_TE = (self.gate(x_TD) / self.temperature).softmax(-1)
        weights_TK, experts_TK = probs_TE.topk(self.top_k, dim=-1)
        return weights_TK / weights_TK.sum(-1, keepdim=True), experts_TK


class LearnedTemperatureMoE(nn.Module):
    """A loop MoE whose routing divides the logits by a learnable temperature: inline in the block's forward
    (`style="inline"`; `"baked"`: the same, its logits viewed with the batch's token count written as a
    number), or in a router submodule returning (weights, experts) (`"module"`)."""

    def __init__(self, style: str, dim: int = 16, ffn_dim: int = 32, num_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.style = style
        self.router = LearnedTemperatureRouter(dim, num_experts, top_k)
        self.experts = nn.ModuleList(ExpertMLP(dim, ffn_dim) for _ in range(num_experts))

    def forward(self, hidden_states):
        x_TD = hidden_states.reshape(-1, hidden_states.shape[-1])
        if self.style == "module":
            weights_TK, experts_TK = self.router(x_TD)
        else:
            r = self.router
            logits_TE = F.linear(x_TD, r.gate.weight) / r.temperature
            if self.style == "baked":  # the token count as a Python number: right for this batch shape only
                logits_TE = logits_TE.view(hidden_states.shape[0] * hidden_states.shape[1], -1)
            weights_TK, experts_TK = logits_TE.softmax(-1).topk(r.top_k, dim=-1)
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        out_TD = torch.zeros_like(x_TD)
        for e, expert in enumerate(self.experts):
            token_idx, choice_idx = torch.where(experts_TK == e)
            out_TD.index_add_(0, token_idx, expert(x_TD[token_idx]) * weights_TK[token_idx, choice_idx, None])
        return out_TD.reshape(hidden_states.shape)


def assert_exact_single(block: nn.Module) -> moepass.MoEGraphModule:
    """form="single" on `block`: outputs and every gradient (input and parameters) as the block's own."""
    compiled = moepass.compile(block, moepass.Plan(form="single"))
    x = torch.randn(3, 5, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, ref = compiled(x), block(x_ref)
    torch.testing.assert_close(out, ref)
    (out * ref.detach().cos()).sum().backward()
    (ref * ref.detach().cos()).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    grads = dict(compiled.named_parameters())
    for name, p in block.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(grads[name].grad, p.grad, msg=lambda m, name=name: f"{name}: {m}")
    return compiled


def test_an_inline_router_runs_as_traced():
    """A router written inline in the block's forward whose logits pass through code no rule describes (a
    learnable temperature) runs as the block's own code up to the logits (`logits_from="traced"`), then the
    known rule; exact, the temperature's gradient included; the router submodule form is exact too."""
    torch.manual_seed(0)
    inline = LearnedTemperatureMoE("inline")
    (spec,) = moepass.detect(inline).blocks
    r = spec.router
    assert r.logits_from == "traced" and set(r.module_args) == {"router.temperature", "router.gate.weight"}
    assert (r.score_func, r.softmax_before_topk, r.renormalize) == ("softmax", True, True)
    assert "router=traced logits (reads " in spec.summary()
    text = moepass.explain(inline, moepass.Plan(form="single"))  # the router region, printed as traced
    assert "router region, traced from the block's forward up to the logits" in text
    assert "def forward(self, hidden_states, router_temperature, router_gate_weight)" in text
    assert "div = torch_Tensor_div(linear, router_temperature)" in text
    compiled = assert_exact_single(inline)
    assert compiled.moepass_router_logits.graph is not r.traced.graph  # the block's own copy, no tensor in it
    assert not list(compiled.moepass_router_logits.parameters())

    torch.manual_seed(0)
    moved = LearnedTemperatureMoE("module")
    (spec,) = moepass.detect(moved).blocks
    assert spec.router.logits_from == "selection" and spec.router.module_path == "router"
    assert_exact_single(moved)


def test_a_router_written_for_one_batch_shape_is_rejected_with_the_way_out():
    """Router code with the probe's token count in it as a number is not traced (it would be wrong for any
    other batch); no known rule reproduces it either, and the reason names the tensor and the way out."""
    torch.manual_seed(0)
    report = moepass.detect(LearnedTemperatureMoE("baked"))
    assert not report.blocks
    ((path, reason),) = report.rejected
    assert path == "" and "Its selection scores also read ['router.temperature']" in reason
    assert "move the routing into a submodule that returns (weights, experts)" in reason


class SharedBlockLM(nn.Module):
    """Two layers calling one MoE module (tied weights: layers[0].mlp is layers[1].mlp)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(32, dim)
        block = LoopMoE(dim, 32, 4, 2)
        self.layers = nn.ModuleList([nn.ModuleDict({"norm": nn.LayerNorm(dim), "mlp": block}) for _ in range(2)])

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer["mlp"](layer["norm"](h))
        return h


def test_a_block_shared_by_two_layers_is_rewritten_once_and_stays_shared():
    torch.manual_seed(0)
    model = SharedBlockLM()
    ids = torch.randint(0, 32, (2, 8))
    report = moepass.detect(model, example_inputs=(ids,))
    assert [spec.path for spec in report.blocks] == ["layers.0.mlp"] and report.rejected == [], report.summary()
    assert any("layers.0.mlp is also the module at layers.1.mlp" in note for note in report.notes)
    cm = moepass.compile(model, moepass.Plan(form="single", keep_original_if_slower=False), report=report)
    assert cm.layers[1]["mlp"] is cm.layers[0]["mlp"] is cm.moepass_info.rewritten["layers.0.mlp"]
    out, ref = cm(ids), model(ids)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    ref.square().sum().backward()
    grads = dict(model.named_parameters())
    for name, p in cm.named_parameters():  # the one block's weights get both layers' gradients, as in the model
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


class InlineGroupLimitedMoE(nn.Module):
    """DeepSeek-V3's routing written inline in the block (no router module): sigmoid scores plus a selection
    bias, the best 2 of 4 expert groups (each scored by its top-2 sum), top-2 among them, weights from the
    unbiased scores renormalised and scaled."""

    def __init__(self, dim: int = 16, experts: int = 8, groups: int = 4):
        super().__init__()
        self.groups = groups
        self.gate_weight = nn.Parameter(torch.randn(experts, dim) * 0.3)
        self.register_buffer("score_bias", torch.randn(experts) * 0.05)
        self.experts = nn.ModuleList([ExpertMLP(dim, 24) for _ in range(experts)])

    def forward(self, x):
        xf = x.reshape(-1, x.shape[-1])
        scores = F.linear(xf, self.gate_weight).sigmoid()
        biased = scores + self.score_bias
        E, G = biased.shape[-1], self.groups
        group_scores = biased.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(2, dim=-1)[1], 1)
        biased = biased.masked_fill(~keep.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E).bool(), float("-inf"))
        idx = biased.topk(2, dim=-1)[1]
        w = scores.gather(1, idx)
        w = w / w.sum(-1, keepdim=True) * 2.5
        y = torch.zeros_like(xf)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(idx == e)
            y.index_add_(0, token, expert(xf[token]) * w[token, slot, None])
        return y.view(x.shape)


def test_an_inline_group_limited_router_is_described_and_reproduced():
    torch.manual_seed(0)
    block = InlineGroupLimitedMoE()
    x = torch.randn(2, 8, 16)
    report = moepass.detect(block, example_inputs=(x,))
    (spec,) = report.blocks
    r = spec.router
    assert (r.score_func, r.n_group, r.topk_group, r.routed_scaling_factor) == ("sigmoid", 4, 2, 2.5), report.summary()
    assert report.details[0].check.group_sensitive_tokens > 0  # the probes exercised the group limit
    cm = moepass.compile(block, moepass.Plan(form="single", keep_original_if_slower=False), report=report)
    for shape in [(2, 8), (3, 5)]:
        x = torch.randn(*shape, 16)
        torch.testing.assert_close(cm(x), block(x), rtol=1e-5, atol=1e-5)


class ExpertChoiceMoE(nn.Module):
    """Expert-choice routing: each expert picks its top-C tokens (a top-k over the tokens, not the experts)."""

    def __init__(self, dim: int = 16, experts: int = 4):
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList([ExpertMLP(dim, 24) for _ in range(experts)])

    def forward(self, x):
        xf = x.reshape(-1, x.shape[-1])
        weights, tokens = self.gate(xf).softmax(-1).t().topk(max(1, xf.shape[0] // 2), dim=-1)  # [E, C]
        y = torch.zeros_like(xf)
        for e, expert in enumerate(self.experts):
            y.index_add_(0, tokens[e], expert(xf[tokens[e]]) * weights[e, :, None])
        return y.view(x.shape)


def test_expert_choice_routing_is_left_alone_saying_what_it_is():
    block = ExpertChoiceMoE()
    report = moepass.detect(block, example_inputs=(torch.randn(2, 8, 16),))
    (detail,) = report.details
    assert not detail.accepted and detail.left_alone
    assert detail.reason.startswith("expert-choice routing: each of its E=4 experts picks its top-"), detail.reason
    assert "outlined" not in detail.reason


def test_experts_of_different_widths_are_rejected_saying_so():
    block = LoopMoE(16, 32, 4, 2)
    block.experts[1] = ExpertMLP(16, 48)  # one expert wider than the others
    report = moepass.detect(block, example_inputs=(torch.randn(2, 8, 16),))
    (path, reason), = report.rejected
    assert "its experts differ in shape (expert 0 and expert 1: " in reason and "(32, 16) vs (48, 16)" in reason, reason
