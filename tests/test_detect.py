"""moepass.detect: the three hand-written styles are found and described; others are rejected untouched."""

import copy

import torch
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


def test_detection_never_mutates_the_model():
    model = TinyMoELM(SampleConfig(style="mixed", layers=3))
    before = copy.deepcopy(model.state_dict())
    moepass.detect(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class TemperatureMoE(LoopMoE):
    """A router rule no hypothesis covers: softmax at temperature 0.5."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        probs = (self.gate(x) / 0.5).softmax(-1)
        w, idx = probs.topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(self.top_k):
                out[t] += w[t, k] * self.experts[int(idx[t, k])](x[t])
        return out.reshape(hidden_states.shape)


def test_unreproducible_block_is_rejected_with_reason_and_left_untouched():
    model = nn.Sequential(TemperatureMoE(16, 32, 4, 2))
    report = moepass.detect(model)
    assert report.blocks == []
    ((path, reason),) = report.rejected
    assert path == "0" and "no hypothesis reproduces the block" in reason and "outputs differ by up to" in reason
    compiled = moepass.compile(model)
    assert isinstance(compiled[0], TemperatureMoE)


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
