"""Golden-graph tests of the canonical dialect graph generated from an MoESpec.

`EXPECTED_*` declare the graph structurally (op kind and target, in order, TVM-Relax style); a
readable snapshot of the generated code is kept under tests/golden/ (regenerate with
MOEPASS_UPDATE_GOLDEN=1 after an intended change, and review the diff).
"""

import operator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _golden import check_golden

import moepass
from moepass import canonical
from moepass.spec import ExpertsSpec, MoESpec, RouterSpec, SharedExpertSpec, TensorSource
from samples.models import GShardMoE, LoopMoE

GOLDEN = Path(__file__).parent / "golden"
moe = torch.ops.moe

EXPECTED_LOOP = [
    ("placeholder", "hidden_states"),
    ("call_method", "reshape"),
    ("get_attr", "gate.weight"),
    ("call_method", "float"), ("call_method", "float"),
    ("call_function", F.linear),
    ("call_method", "float"),
    ("call_function", moe.route.default),
    ("call_function", operator.getitem), ("call_function", operator.getitem),
    ("call_function", moe.permute.default),
    ("call_function", operator.getitem), ("call_function", operator.getitem), ("call_function", operator.getitem),
    *[("get_attr", f"experts.{e}.w1.weight") for e in range(4)], ("call_function", canonical.stack_experts),
    *[("get_attr", f"experts.{e}.w3.weight") for e in range(4)], ("call_function", canonical.stack_experts),
    *[("get_attr", f"experts.{e}.w2.weight") for e in range(4)], ("call_function", canonical.stack_experts),
    ("call_function", moe.expert_ffn.default),
    ("call_function", moe.unpermute.default),
    ("call_function", moe.combine.default),
    ("call_method", "view_as"),
    ("output", "output"),
]


def structure(gm):
    return [(n.op, n.target) for n in gm.graph.nodes]


def check_snapshot(build, name):
    """`build()` -> a freshly built graph, whose readable code must equal tests/golden/<name>.txt."""
    check_golden(GOLDEN / f"{name}.txt",
                 lambda: build().print_readable(print_output=False, include_stride=False, include_device=False))


def _build(block):
    (spec,) = moepass.detect(block).blocks
    return canonical.build(spec, block)


def _loop_gm():
    return _build(LoopMoE(dim=16, ffn_dim=32, num_experts=4, top_k=2))


def _gshard_gm():
    return _build(GShardMoE(dim=16, ffn_dim=32, num_experts=4, capacity_factor=1.5))


@pytest.fixture
def loop_gm():
    return _loop_gm()


def test_loop_block_structure(loop_gm):
    assert structure(loop_gm) == EXPECTED_LOOP
    route = next(n for n in loop_gm.graph.nodes if n.target is moe.route.default)
    assert route.args[2:] == ("softmax", True, 2, True, 1, 1, "top2_sum", 1.0)
    check_snapshot(_loop_gm, "canonical_loop")


def test_every_node_records_its_pass(loop_gm):
    assert {n.meta["moepass"]["pass"] for n in loop_gm.graph.nodes} == {"canonical"}


def test_gshard_block_has_capacity_nodes():
    gm = _gshard_gm()
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(moe.capacity_keep.default) == 1
    keep = next(n for n in gm.graph.nodes if n.target is moe.capacity_keep.default)
    assert keep.args[1] == 4 and keep.args[4] is True  # E, k-major priority
    check_snapshot(_gshard_gm, "canonical_gshard")


def test_spec_features_appear_in_the_graph():
    """A DeepSeek-like spec: sigmoid, selection bias, groups, scaling, gated shared expert, side output."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(8, 4, bias=False)
            self.register_buffer("bias", torch.zeros(4))
            self.w_up = torch.nn.Parameter(torch.randn(4, 32, 8))
            self.w_down = torch.nn.Parameter(torch.randn(4, 8, 16))
            self.shared = torch.nn.Linear(8, 8)
            self.shared_gate = torch.nn.Linear(8, 1)

    spec = MoESpec(
        path="", recogniser="test",
        router=RouterSpec(num_experts=4, top_k=2, score_func="sigmoid", n_group=2, topk_group=1,
                          routed_scaling_factor=2.5, weight=TensorSource.param("router.weight"),
                          selection_bias=TensorSource.param("bias")),
        experts=ExpertsSpec(num_experts=4, hidden_dim=8, ffn_dim=16,
                            w_gate=TensorSource.param("w_up", chunk=(0, 2), chunk_dim=1),
                            w_up=TensorSource.param("w_up", chunk=(1, 2), chunk_dim=1),
                            w_down=TensorSource.param("w_down")),
        shared=SharedExpertSpec("shared", "shared_gate"), side_outputs=("router_logits",),
    )
    gm = canonical.build(spec, Block())
    moepass.verify(gm)
    route = next(n for n in gm.graph.nodes if n.target is moe.route.default)
    assert route.args[1].target == "bias" and route.args[2:] == ("sigmoid", True, 2, True, 2, 1, "top2_sum", 2.5)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["shared", "shared_gate"]
    out, logits = gm(torch.randn(2, 3, 8))
    assert out.shape == (2, 3, 8) and logits.shape == (6, 4)
