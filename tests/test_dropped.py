"""Capacity-dropped assignments skip the experts under form="single" (`moepass.rewrite.dropped`, issue 29 item 8):
the experts compute the kept rows only, and the block's outputs and gradients are the graph's without the pass."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import fx

import moepass
from moepass import canonical, dialect
from moepass.rewrite.dropped import skip_dropped
from moepass.row_ops import ffn_rows, padded_rows
from moepass.spec import CapacitySpec
from samples.models import GShardMoE, LoopMoE


class Recorder(fx.Interpreter):
    """Runs a graph node by node; records the capacity mask and, per expert FFN call, (rows, rows computed)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.ffn: list[tuple[int, int]] = []
        self.keep: torch.Tensor | None = None

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n.op == "call_function" and n.target is dialect.EXPERT_FFN:
            self.ffn.append((self.env[n.args[0]].shape[0], int(self.env[n.args[1]].sum())))
        if n.op == "call_function" and n.target is dialect.CAPACITY_KEEP:
            self.keep = out
        return out


def record(gm: fx.GraphModule, x: torch.Tensor) -> Recorder:
    recorder = Recorder(gm)
    with torch.no_grad():
        recorder.run(x)
    return recorder


def forward_backward(block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_()
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    y = block(x)
    (y * probe).sum().backward()
    return y.detach(), [x.grad, *[p.grad for p in block.parameters()]]


def rewritten(compiled: torch.nn.Module) -> canonical.MoEGraphModule:
    return compiled if isinstance(compiled, canonical.MoEGraphModule) else compiled.moepass_info.rewritten[""]


@pytest.mark.parametrize("lowering", ["torch", "triton"])
def test_gshard_computes_only_the_kept_rows_with_the_originals_values(lowering):
    """With the Triton kernels too (interpreted here: TRITON_INTERPRET=1, conftest): they get the kept rows only."""
    torch.manual_seed(0)
    block = GShardMoE(dim=16, ffn_dim=32, num_experts=4, top_k=2, capacity_factor=0.5)
    x = torch.randn(2, 16, 16)
    compiled = moepass.compile(copy.deepcopy(block), moepass.Plan(form="single", lowering=lowering))
    gm = rewritten(compiled)
    history = {h["pass"]: h["stats"] for h in gm.history}
    assert history["skip_dropped"] == {"capacity_masks": 1}
    targets = [n.target for n in gm.graph.nodes]
    assert ffn_rows in targets and padded_rows in targets
    if lowering == "triton":
        assert history["lower"]["lowered"] == {"gating": 1, "permute": 1, "grouped_gemm": 1, "combine": 1}
    else:
        recorded = record(gm, x)
        kept = int(recorded.keep.sum())
        assert kept == 4 * 8  # capacity ceil(0.5 * 32 tokens * 2 / 4) = 8 per expert, every expert full here
        assert recorded.ffn == [(kept, kept)]  # of 64 assignments: the 32 dropped ones reach no expert

    y_ref, grads_ref = forward_backward(block, x)
    y, grads = forward_backward(compiled, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_not_on_a_graph_for_torch_compiles_inner_compiler():
    """`compile_block(traced=True)` (the backend): no host read in the graph, every assignment computed."""
    from moepass.pipeline import compile_block

    block = GShardMoE(dim=16, ffn_dim=32, num_experts=4, top_k=2, capacity_factor=0.5)
    (spec,) = moepass.detect(block).blocks
    gm = compile_block(spec, block, moepass.Plan(form="single"), traced=True)
    assert "skip_dropped" not in [h["pass"] for h in gm.history]
    assert ffn_rows not in [n.target for n in gm.graph.nodes]


def with_capacity(block: torch.nn.Module, factor: float) -> canonical.MoEGraphModule:
    (spec,) = moepass.detect(block).blocks
    return canonical.build(spec.replace(capacity=CapacitySpec(capacity_factor=factor)), block)


@pytest.mark.parametrize("factor", [0.4, 1.0, 4.0])
def test_the_pass_keeps_the_graphs_values(factor):
    """Against the same canonical graph without the pass, at capacity factors that drop most, some and none: the
    same values up to the GEMMs' rounding (an expert's GEMM over fewer rows may block its sums differently)."""
    torch.manual_seed(0)
    block = LoopMoE(dim=16, ffn_dim=24, num_experts=6, top_k=2)
    before, after = with_capacity(block, factor), with_capacity(block, factor)
    assert skip_dropped(after) == 1
    after.graph.lint()
    x = torch.randn(2, 12, 16)
    y_ref, grads_ref = forward_backward(before, x)
    y, grads = forward_backward(after, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-7)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    full, skipped = record(before, x), record(after, x)
    kept = int(skipped.keep.sum())
    assert full.ffn == [(48, 48)] and skipped.ffn == [(kept, kept)]
    assert (kept < 48) == (factor < 4.0)


def test_a_capacity_with_zero_compute_experts_is_refused_before_any_graph():
    """The pass needs no zero-compute case: the spec refuses capacity beside identity / zero experts."""
    (spec,) = moepass.detect(LoopMoE(dim=16, ffn_dim=24, num_experts=6, top_k=2)).blocks
    experts = dataclasses.replace(spec.experts, num_experts=4, identity_experts=(4, 5))
    with pytest.raises(moepass.PlanError, match="capacity is not supported together with identity / zero experts"):
        spec.replace(experts=experts, capacity=CapacitySpec(capacity_factor=1.0))


def test_a_block_without_capacity_is_left_as_it_is():
    block = GShardMoE(dim=16, ffn_dim=32, num_experts=4, top_k=2)
    (spec,) = moepass.detect(block).blocks
    gm = canonical.build(spec.replace(capacity=None), block)
    code = gm.code
    assert skip_dropped(gm) == 0 and gm.code == code
