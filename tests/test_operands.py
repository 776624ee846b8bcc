"""`moepass.operands`: a call's operands read and written by the op's parameter names, wherever the call put them."""

import pytest
import torch
from torch import fx

from moepass import dialect
from moepass.operands import argument_names, operand, operands_from, set_operand


def permute_call(**kwargs):
    graph = fx.Graph()
    x, experts = graph.placeholder("x_TD"), graph.placeholder("experts_TK")
    args = (x, experts, 4)[: 3 - len(kwargs)]
    return graph, graph.call_function(dialect.PERMUTE, args, kwargs), x, experts


def test_names_come_from_the_schema():
    assert argument_names(dialect.PERMUTE) == ("x_TD", "experts_TK", "num_experts")
    assert argument_names(dialect.ROUTE)[:2] == ("logits_TE", "selection_bias_E")


def test_by_position_by_keyword_and_the_default():
    _, node, x, experts = permute_call()
    assert operand(node, "x_TD") is x and operand(node, "experts_TK") is experts and operand(node, "num_experts") == 4
    _, node, _, _ = permute_call(num_experts=6)
    assert operand(node, "num_experts") == 6
    graph = fx.Graph()
    logits = graph.placeholder("logits_TE")
    ffn = graph.call_function(dialect.EXPERT_FFN, (logits,) * 5)
    assert operand(ffn, "recompute") is False  # not passed: the schema's default


def test_an_unknown_name_lists_the_operands():
    _, node, _, _ = permute_call()
    with pytest.raises(KeyError, match=r"has no operand 'experts'; its operands are \['x_TD', 'experts_TK', 'num_experts'\]"):
        operand(node, "experts")


def test_set_operand_where_the_call_put_it():
    graph, node, x, _ = permute_call(num_experts=4)
    y = graph.placeholder("y_TD")
    set_operand(node, "x_TD", y)
    set_operand(node, "num_experts", 8)
    assert node.args[0] is y and node.kwargs["num_experts"] == 8 and y.users and not x.users


def test_a_plain_function_by_its_signature():
    def run(x_ND, counts_E, scale=2.0, *rest):
        return x_ND

    graph = fx.Graph()
    x = graph.placeholder("x_ND")
    node = graph.call_function(run, (x, torch.ones(1)))
    assert operand(node, "x_ND") is x and operand(node, "scale") == 2.0


def test_operands_from_a_name_on_as_passed():
    _, node, _, _ = permute_call()
    assert operands_from(node, "num_experts") == (4,)
    _, node, _, _ = permute_call(num_experts=6)  # passed by keyword: not among the positional trailing operands
    assert operands_from(node, "num_experts") == ()
