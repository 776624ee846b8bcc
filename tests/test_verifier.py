"""The verifier catches broken graphs, each with a precise message (rule, node, what is wrong)."""

import operator

import pytest
import torch

import moepass
from moepass import canonical, dialect
from moepass.verify import VerificationError, verify, violations
from samples.models import GShardMoE, LoopMoE


@pytest.fixture
def gm():
    block = LoopMoE(dim=16, ffn_dim=32, num_experts=4, top_k=2)
    (spec,) = moepass.detect(block).blocks
    return canonical.build(spec, block)


def node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def rules(gm):
    return [(v.rule, v.node) for v in violations(gm)]


def test_canonical_graphs_are_valid(gm):
    verify(gm)
    block = GShardMoE(dim=16, ffn_dim=32, num_experts=4)
    verify(canonical.build(moepass.detect(block).blocks[0], block))


def test_missing_provenance(gm):
    del node(gm, "y_ND").meta["moepass"]
    assert rules(gm) == [("V1 provenance", "y_ND")]


def reshape_x_TD_to_width_8(gm):
    x_TD = node(gm, "x_TD")
    x_TD.args = (x_TD.args[0], -1, 8)  # D=16 reshaped as 8


def expert_ffn_w_down_from_w_gate(gm):
    ffn = node(gm, "y_ND")
    args = list(ffn.args)
    args[4] = args[2]  # w_down_EDF <- w_gate_EFD: [E, F, D] where [E, D, F] is needed
    ffn.args = tuple(args)


@pytest.mark.parametrize("corrupt, caught_at, message", [
    (reshape_x_TD_to_width_8, "logits_TE", "same reduction dim"),  # by fake propagation
    (expert_ffn_w_down_from_w_gate, "y_ND", "w_down_EDF has shape (4, 32, 16), expected (E=4, D=16, F=32)"),  # the op's fake
], ids=["wrong_shape", "wrong_expert_weight_layout"])
def test_wrong_shapes_are_caught(gm, corrupt, caught_at, message):
    corrupt(gm)
    gm.recompile()
    found = violations(gm)
    assert [(v.rule, v.node) for v in found] == [("V2 shapes", caught_at)]
    assert message in found[0].message


def test_permute_without_its_inverse(gm):
    unpermute = node(gm, "y_TKD")
    y_ND = node(gm, "y_ND")
    with gm.graph.inserting_after(unpermute):
        fake = gm.graph.call_function(torch.Tensor.view, (y_ND, -1, 2, 16))
        fake.meta["moepass"] = {"pass": "corrupt"}
    unpermute.replace_all_uses_with(fake)
    gm.graph.erase_node(unpermute)
    gm.recompile()
    found = violations(gm)
    assert ("V3 pairing", "permute") in [(v.rule, v.node) for v in found]
    assert "feeds 0 inverse ops" in str(found)


def test_unpermute_fed_by_the_wrong_order(gm):
    unpermute = node(gm, "y_TKD")
    experts = node(gm, "experts_TK")
    with gm.graph.inserting_before(unpermute):
        bogus = gm.graph.call_function(torch.Tensor.flatten, (experts,))
        bogus.meta["moepass"] = {"pass": "corrupt"}
    unpermute.args = (unpermute.args[0], bogus, unpermute.args[2])
    gm.recompile()
    found = [(v.rule, v.node) for v in violations(gm)]
    assert ("V3 pairing", "y_TKD") in found and ("V3 pairing", "permute") in found


def test_split_sizes_that_do_not_add_up(gm):
    x_TD = node(gm, "x_TD")
    with gm.graph.inserting_after(x_TD):
        split = gm.graph.call_function(torch.split, (x_TD, [3, 4], 0))
        split.meta["moepass"] = {"pass": "corrupt"}
    gm.recompile()
    found = violations(gm, [torch.randn(2, 4, 16)])
    assert ("V4 split sums", "split", "split sizes [3, 4] sum to 7, but the tensor has 8 rows") in [
        (v.rule, v.node, v.message) for v in found]


def test_dialect_op_outside_a_dialect_graph(gm):
    gm.meta["moepass_dialect"] = False
    found = violations(gm)
    assert {v.rule for v in found} == {"V5 placement"}
    assert any(v.node == "route" and "not marked as an MoE dialect graph" in v.message for v in found)


def test_communication_in_a_single_device_graph(gm):
    x_TD = node(gm, "x_TD")
    with gm.graph.inserting_after(x_TD):
        a2a = gm.graph.call_function(torch.ops._c10d_functional.all_to_all_single.default,
                                     (x_TD, [8], [8], "0"))
        a2a.meta["moepass"] = {"pass": "corrupt"}
    found = [v for v in violations(gm) if v.rule == "V5 placement"]
    assert found and "communication op" in found[0].message and found[0].node == a2a.name


def test_side_outputs_must_match_the_spec(gm):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = ((out.args[0], node(gm, "logits_TE")),)
    gm.recompile()
    found = violations(gm)
    assert [(v.rule, v.message) for v in found] == [
        ("V6 outputs", "returns 2 values; the spec needs 1 (hidden states + side outputs [])")]


def test_verify_raises_with_all_messages(gm):
    del node(gm, "y_ND").meta["moepass"]
    gm.meta["moepass_dialect"] = False
    with pytest.raises(VerificationError, match=r"(?s)after pass .test.*V1 provenance.*V5 placement"):
        verify(gm, after="test")


def test_getitem_and_dialect_helpers():
    assert dialect.is_dialect_op(dialect.ROUTE) and not dialect.is_dialect_op(operator.getitem)
