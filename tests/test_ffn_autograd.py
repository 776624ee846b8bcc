"""Separate expert tensors run eagerly by autograd itself (`moepass.ffn_autograd`): the same values and gradients
bit for bit as `moe.expert_ffn`'s own autograd, each gradient through its parameter's AccumulateGrad, and the op's
path wherever the autograd one does not apply.

Legend: N rows sorted by expert, D width, F expert width, E experts, B batch, S sequence.
"""

import copy

import pytest
import torch

import moepass
from moepass import eager, ffn_autograd, grouped_ffn
from moepass.activations import GATED_ACTIVATIONS
from samples.models import ExpertMLP, LoopMoE

D, F = 8, 12
COUNTS = torch.tensor([3, 0, 5, 1])  # an empty expert; 9 counted rows of N = 11: two rows past the counts
N = 11


@pytest.fixture(autouse=True)
def per_expert(monkeypatch):
    monkeypatch.setattr(grouped_ffn, "PER_EXPERT_ELEMENTS", 0)  # every layer runs expert by expert


def operands(activation: str, bias: bool, fused: bool):
    """(x_ND, counts, per-expert leaves of each weight/bias role or None)."""
    gen = torch.Generator().manual_seed(0)
    E, gated = COUNTS.shape[0], activation in GATED_ACTIVATIONS

    def leaves(*shape):
        return [(torch.randn(*shape, generator=gen) * 0.3).requires_grad_() for _ in range(E)]

    rows_gate = 2 * F if fused else F
    roles = [leaves(rows_gate, D), leaves(F, D) if gated and not fused else None, leaves(D, F),
             leaves(rows_gate) if bias else None, leaves(F) if bias and gated and not fused else None,
             leaves(D) if bias else None]
    return torch.randn(N, D, generator=gen).requires_grad_(), COUNTS, roles


def call(x_ND, counts, roles, activation, marked: bool):
    stacked = [None if r is None else torch.stack(r) for r in roles]
    if marked:
        stacked = [None if s is None else ffn_autograd.mark_experts(s, r) for s, r in zip(stacked, roles)]
    op = eager.EAGER[torch.ops.moe.expert_ffn.default]
    return op(x_ND, counts, *stacked, activation, 1.5, 1.702, False)


def gradients(y, x_ND, roles, probe):
    leaves = [x_ND] + [t for r in roles if r is not None for t in r]
    return torch.autograd.grad((y * probe).sum(), leaves, allow_unused=True)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation,fused", [(a, False) for a in ffn_autograd.BY_AUTOGRAD] + [("swiglu", True)])
def test_equals_the_ops_autograd_bit_for_bit(activation, fused, bias):
    if fused and activation not in GATED_ACTIVATIONS:
        pytest.skip("fused gate/up is a gated layout")
    x_ND, counts, roles = operands(activation, bias, fused)
    probe = torch.randn(N, D)
    y_op = call(x_ND, counts, roles, activation, marked=False)
    y = call(x_ND, counts, roles, activation, marked=True)
    assert "ExpertFFN" in type(y_op.grad_fn).__name__ and "ExpertFFN" not in type(y.grad_fn).__name__
    assert torch.equal(y, y_op)
    assert torch.count_nonzero(y[int(COUNTS.sum()):]) == 0  # rows past the counts are zeros, as the op's
    for got, want in zip(gradients(y, x_ND, roles, probe), gradients(y_op, x_ND, roles, probe), strict=True):
        assert got is not None and torch.equal(got, want)  # the empty expert's too: zeros, as the op's


@pytest.mark.parametrize("activation", ["relu2", "clamped_swiglu"])
def test_activations_whose_autograd_differs_keep_the_op(activation):
    x_ND, counts, roles = operands(activation, bias=False, fused=False)
    stacked = [None if r is None else ffn_autograd.mark_experts(torch.stack(r), r) for r in roles]
    assert ffn_autograd.expert_ffn(x_ND, counts, *stacked, activation, 1.5, 1.702, False) is None


def test_recompute_unmarked_or_no_grad_keep_the_op():
    x_ND, counts, roles = operands("swiglu", bias=False, fused=False)
    marked = [None if r is None else ffn_autograd.mark_experts(torch.stack(r), r) for r in roles]
    options = ("swiglu", 1.5, 1.702)
    assert ffn_autograd.expert_ffn(x_ND, counts, *marked, *options, True) is None  # Plan(expert_recompute=True)
    unmarked = [None if r is None else torch.stack(r) for r in roles]
    assert ffn_autograd.expert_ffn(x_ND, counts, *unmarked, *options, False) is None
    with torch.no_grad():
        assert ffn_autograd.expert_ffn(x_ND, counts, *marked, *options, False) is None
    assert ffn_autograd.expert_ffn(x_ND, counts, *marked, *options, False) is not None


def backward_nodes(t: torch.Tensor) -> set[str]:
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def loop_block(bias: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    block = LoopMoE(D, F, num_experts=4, top_k=2)
    if bias:
        block.experts = torch.nn.ModuleList(ExpertMLP(D, F, bias=True) for _ in range(4))
    return block


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_a_compiled_loop_block_trains_as_its_original(bias):
    """`compile(form="single")` on ModuleList experts: the gradients reach each expert's own parameters, equal to
    the original's to fp32 rounding; a tensor hook on an expert weight runs once with its gradient."""
    original = loop_block(bias)
    compiled = moepass.compile(copy.deepcopy(original), moepass.Plan(form="single"))
    x_BSD = torch.randn(2, 5, D)
    seen = []
    compiled.get_submodule("experts.0.w1").weight.register_hook(lambda g: seen.append(g.clone()))
    results = []
    for block in (original, compiled):
        x = x_BSD.clone().requires_grad_()
        y = block(x)
        (y * torch.arange(y.numel(), dtype=y.dtype).view(y.shape)).sum().backward()
        results.append((y, x.grad, dict(block.named_parameters())))
        nodes = backward_nodes(y)
    assert not any("ExpertFFN" in name for name in nodes) and "MmBackward0" in nodes  # autograd's own nodes
    (y0, gx0, params0), (y1, gx1, params1) = results
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-5)
    assert params0.keys() == params1.keys()
    for name, p in params0.items():
        torch.testing.assert_close(params1[name].grad, p.grad, rtol=1e-5, atol=1e-5)
    assert len(seen) == 1 and torch.equal(seen[0], params1["experts.0.w1.weight"].grad)


def test_more_rows_than_the_weight_gradients_pay_for_keep_the_op():
    """`pays`: autograd's way keeps two [N, F] intermediates more; past the weight gradients' size the op runs."""
    _, counts, roles = operands("swiglu", bias=False, fused=False)
    marked = [None if r is None else ffn_autograd.mark_experts(torch.stack(r), r) for r in roles]
    weight_elements = sum(s.numel() for s in marked[:3] if s is not None)  # 3 x E x F x D
    most = (weight_elements - 1) // (2 * F)  # the most rows for which 2 x N x F < the weight elements
    for rows, expected in ((most, True), (most + 1, False)):
        x_ND = torch.randn(rows, D, requires_grad=True)
        tail_counts = counts.clone()
        tail_counts[0] += rows - int(counts.sum())
        y = ffn_autograd.expert_ffn(x_ND, tail_counts, *marked, "swiglu", 1.5, 1.702, False)
        assert (y is not None) == expected, rows
