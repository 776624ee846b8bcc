"""Detection reuses the verdict of a structurally identical block (`moepass.detect.structure`)."""

from __future__ import annotations

import torch
from torch import nn

import moepass
from moepass.detect.structure import structural_key
from samples.models import LoopMoE, tiny_mixtral


def test_identical_layers_are_checked_once_and_compile_exactly():
    torch.manual_seed(0)
    model = tiny_mixtral(style="loop", vocab_size=64, dim=32, ffn_dim=64, num_experts=8, top_k=2, layers=4)
    report = moepass.detect(model)
    paths = [f"layers.{i}.mlp" for i in range(4)]
    assert [d.path for d in report.details] == paths and all(d.accepted for d in report.details)
    assert [d.same_as for d in report.details] == [None, "layers.0.mlp", "layers.0.mlp", "layers.0.mlp"]
    assert len(report.details[0].tried) >= 1 and [len(d.tried) for d in report.details[1:]] == [0, 0, 0]
    assert [s.path for s in report.blocks] == paths  # each spec rooted at its own block
    assert "structure identical to layers.0.mlp: its check" in report.summary()
    tokens = torch.randint(0, 64, (2, 9))
    compiled = moepass.compile(model, moepass.Plan(form="single"), report=report)
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens), model(tokens), rtol=1e-5, atol=1e-6)


class Two(nn.Module):
    def __init__(self, a: nn.Module, b: nn.Module):
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x):
        return self.b(self.a(x))


def test_what_changes_the_computation_changes_the_key():
    torch.manual_seed(0)
    base = LoopMoE(16, 32, 4, 2)
    assert structural_key(base) == structural_key(LoopMoE(16, 32, 4, 2))  # other weights, same structure
    assert structural_key(base) != structural_key(LoopMoE(16, 32, 4, 1))  # top_k: a plain attribute
    assert structural_key(base) != structural_key(LoopMoE(16, 32, 4, 2, renormalize=False))
    assert structural_key(base) != structural_key(LoopMoE(16, 48, 4, 2))  # a parameter's shape
    assert structural_key(base) != structural_key(LoopMoE(16, 32, 4, 2, act="gelu"))  # a child's attribute
    hooked = LoopMoE(16, 32, 4, 2)
    hooked.register_forward_hook(lambda module, args, out: out * 2)
    assert structural_key(hooked) is None  # a hook can change anything: checked on its own
    weird = LoopMoE(16, 32, 4, 2)
    weird.router_fn = object()  # an attribute whose effect the key cannot see
    assert structural_key(weird) is None


def test_a_different_block_is_checked_on_its_own():
    torch.manual_seed(0)
    model = Two(LoopMoE(16, 32, 4, 2), LoopMoE(16, 32, 4, 1))
    report = moepass.detect(model)
    assert [d.same_as for d in report.details] == [None, None]
    assert [s.router.top_k for s in report.blocks] == [2, 1]
    hooked = Two(LoopMoE(16, 32, 4, 2), LoopMoE(16, 32, 4, 2))
    hooked.b.register_forward_hook(lambda module, args, out: out)
    report = moepass.detect(hooked)
    assert [d.same_as for d in report.details] == [None, None] and all(d.accepted for d in report.details)
