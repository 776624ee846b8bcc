"""One declaration per op (`moepass.operands.OpSchema`): the torch.library ops made from it carry its signature,
its fake and its autograd; the lowerings' ops take the same arguments as the dialect ops they replace."""

from __future__ import annotations

import pytest
import torch

import lowering
from moepass import dialect, eager
from moepass.operands import OpSchema, argument_names, parse_operands


def test_every_dialect_op_has_its_declared_signature():
    for name, schema in dialect.SCHEMAS.items():
        op = getattr(torch.ops.moe, name).default
        assert str(op._schema) == f"moe::{name}{schema.signature()}", name
        assert argument_names(op) == schema.names


def test_lowered_ops_take_the_dialect_ops_arguments():
    fused = 0
    for rec in lowering.registry():
        names = argument_names(rec.lowered_op)
        if rec.fuses:  # a chain: the first op's operands, then each later op's after its chained first one
            expected = argument_names(rec.fuses[0])
            for op in (*rec.fuses[1:], rec.dialect_op):
                expected += argument_names(op)[1:]
            fused += 1
        else:
            expected = argument_names(rec.dialect_op)
        assert names == expected, (rec.family, names, expected)
    assert fused == 1  # combine: unpermute -> combine


def test_operands_carry_their_shape_letters():
    ops = parse_operands("Tensor x_TD, Tensor(a0!) counter_O, Tensor? bias_E, SymInt top_k, bool recompute=False")
    assert [(o.name, o.letters, o.mutated, o.default) for o in ops] == [
        ("x_TD", "TD", False, None), ("counter_O", "O", True, None), ("bias_E", "E", False, None),
        ("top_k", "", False, None), ("recompute", "", False, "False")]
    assert [o.letters for o in dialect.ROUTE_SCHEMA.operands][:2] == ["TE", "E"]


def test_define_makes_the_op_its_fake_and_its_autograd():
    def fake(x_TD, scale):
        return torch.empty_like(x_TD)

    def backward(ctx, grad_TD):
        return grad_TD * ctx.scale, None

    def setup(ctx, inputs, output):
        ctx.scale = inputs[1]

    schema = OpSchema("scale_test", "Tensor x_TD, float scale", "Tensor", fake=fake, autograd=(backward, setup))
    op_def = schema.define("moepass_opschema_test", lambda x_TD, scale: x_TD * scale)
    op = torch.ops.moepass_opschema_test.scale_test.default
    assert str(op._schema) == "moepass_opschema_test::scale_test(Tensor x_TD, float scale) -> Tensor"
    x = torch.randn(3, 2, requires_grad=True)
    op(x, 2.0).sum().backward()
    assert torch.equal(x.grad, torch.full((3, 2), 2.0))
    with torch._subclasses.FakeTensorMode():
        assert op(torch.empty(5, 4), 1.0).shape == (5, 4)
    x.grad = None
    eager.EAGER[op](x, 3.0).sum().backward()  # the eager path runs the same autograd
    assert torch.equal(x.grad, torch.full((3, 2), 3.0))
    assert op_def is not None


def test_a_malformed_declaration_is_refused():
    with pytest.raises(ValueError, match="Type name"):
        parse_operands("Tensor bogus_declaration with three words")
