"""Generated gating kernel (`moe_lowered::route`, interpreted) against `moepass.dialect.route_ref`.

Shape legend: T tokens, E experts, K top-k.

Ties: the kernel breaks ties by the lowest index (a stable descending sort); `torch.topk` on CPU does
not promise any order among equal values, so tie cases compare against `route_ref` run with a
stable top-k (`_stable_topk`), and tie-free cases against `route_ref` itself.
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from lowering import codegen as cg
from lowering import gating
from moepass import dialect

Case = namedtuple("Case", "id T E K score_func before renorm n_group topk_group group_score scaling bias dtype ties")
#                        id                         T   E   K  score      before renorm G  TG group        scale bias   dtype           ties
CASES = [
    Case("mixtral_fp32",                            16, 8,  2, "softmax", True,  True,  1, 1, "top2_sum", 1.0, False, torch.float32, False),
    Case("qwen_no_renorm_E60",                      9,  60, 4, "softmax", True,  False, 1, 1, "top2_sum", 1.0, False, torch.float32, False),
    Case("softmax_after_topk_E6",                   16, 6,  2, "softmax", False, True,  1, 1, "top2_sum", 1.0, False, torch.float32, False),
    Case("softmax_after_with_bias",                 8,  10, 3, "softmax", False, True,  1, 1, "top2_sum", 1.0, True,  torch.float32, False),
    Case("deepseek_groups_top2",                    16, 24, 4, "sigmoid", True,  True,  4, 2, "top2_sum", 2.5, True,  torch.float32, False),
    Case("groups_max_E12",                          16, 12, 3, "sigmoid", True,  True,  4, 2, "max",      1.5, True,  torch.float32, False),
    Case("groups_of_one",                           8,  6,  2, "sigmoid", True,  True,  6, 3, "top2_sum", 1.0, False, torch.float32, False),
    Case("sigmoid_no_renorm",                       8,  7,  3, "sigmoid", True,  False, 1, 1, "top2_sum", 1.0, False, torch.float32, False),
    Case("K_equals_E",                              5,  5,  5, "softmax", True,  True,  1, 1, "top2_sum", 1.0, False, torch.float32, False),
    Case("E1",                                      4,  1,  1, "softmax", True,  True,  1, 1, "top2_sum", 1.0, False, torch.float32, False),
    Case("T0",                                      0,  8,  2, "softmax", True,  True,  1, 1, "top2_sum", 1.0, False, torch.float32, False),
    Case("T1_groups",                               1,  16, 2, "sigmoid", True,  True,  4, 1, "top2_sum", 2.0, True,  torch.float32, False),
    Case("mixtral_fp16",                            33, 8,  2, "softmax", True,  True,  1, 1, "top2_sum", 1.0, False, torch.float16, False),
    Case("mixtral_bf16",                            64, 8,  2, "softmax", True,  True,  1, 1, "top2_sum", 1.0, False, torch.bfloat16, False),
    Case("deepseek_bf16_fp32_bias",                 16, 24, 4, "sigmoid", True,  True,  4, 2, "top2_sum", 2.5, True,  torch.bfloat16, False),
    Case("ties_softmax",                            32, 8,  3, "softmax", True,  True,  1, 1, "top2_sum", 1.0, False, torch.float32, True),
    Case("ties_groups",                             32, 12, 4, "sigmoid", True,  True,  4, 2, "top2_sum", 1.0, True,  torch.float32, True),
    Case("ties_softmax_after",                      32, 9,  2, "softmax", False, True,  1, 1, "top2_sum", 1.0, False, torch.float32, True),
]


def _args(case: Case) -> tuple:
    if case.id.startswith("ties"):  # few distinct values: many exact ties, also between groups
        logits_TE = torch.randint(0, 3, (case.T, case.E)).to(case.dtype)
        bias_E = torch.randint(0, 2, (case.E,)).float() * 0.25 if case.bias else None
    else:
        logits_TE = (torch.randn(case.T, case.E) * 2).to(case.dtype)
        bias_E = torch.randn(case.E) if case.bias else None
    return (logits_TE, bias_E, case.score_func, case.before, case.K, case.renorm, case.n_group, case.topk_group,
            case.group_score, case.scaling)


def _stable_topk(input, k, dim=-1, largest=True, sorted=True):
    indices = torch.sort(input, dim=dim, descending=True, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((input.gather(dim, indices), indices))


def _expected(case: Case, args: tuple, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    with monkeypatch.context() as m:
        if case.ties:
            m.setattr(torch, "topk", _stable_topk)
        return dialect.route_ref(*args)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_route_matches_reference(case, monkeypatch):
    args = _args(case)
    weights_TK, experts_TK = torch.ops.moe_lowered.route(*args)
    want_weights_TK, want_experts_TK = _expected(case, args, monkeypatch)
    assert experts_TK.dtype == torch.int64 and weights_TK.dtype == case.dtype
    assert torch.equal(experts_TK, want_experts_TK)
    _close(weights_TK, want_weights_TK)


@pytest.mark.parametrize("case", [c for c in CASES if c.T and c.dtype == torch.float32 and not c.ties][:6],
                         ids=lambda c: c.id)
def test_route_gradient_matches_dialect(case):
    logits_TE, *rest = _args(case)
    grad_TK = torch.randn(case.T, case.K)
    grads = []
    for op in (torch.ops.moe_lowered.route, torch.ops.moe.route):
        leaf_TE = logits_TE.clone().requires_grad_()
        weights_TK, _ = op(leaf_TE, *rest)
        (grad_TE,) = torch.autograd.grad(weights_TK, leaf_TE, grad_TK)
        grads.append(grad_TE)
    _close(*grads)


def test_ties_break_by_lowest_index():
    logits_TE = torch.zeros(2, 8)
    logits_TE[1, [1, 4, 6]] = 1.0
    _, experts_TK = torch.ops.moe_lowered.route(logits_TE, None, "softmax", True, 3, True, 1, 1, "top2_sum", 1.0)
    assert experts_TK.tolist() == [[0, 1, 2], [1, 4, 6]]


def test_group_ties_keep_lowest_group():
    # 4 groups of 2 with equal group scores: groups 0 and 1 are kept, so experts 0..3 are chosen
    logits_TE = torch.zeros(1, 8)
    _, experts_TK = torch.ops.moe_lowered.route(logits_TE, None, "sigmoid", True, 4, True, 4, 2, "top2_sum", 1.0)
    assert sorted(experts_TK[0].tolist()) == [0, 1, 2, 3]


def test_opcheck():
    args = _args(CASES[4])
    torch.library.opcheck(torch.ops.moe_lowered.route.default, args)


def test_autocast_runs_router_in_fp32():
    args = _args(CASES[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        weights_TK, _ = torch.ops.moe_lowered.route(args[0].bfloat16(), *args[1:])
    assert weights_TK.dtype == torch.float32


def test_source_is_specialised():
    grouped = gating.generated_source(*_args(CASES[4]))
    plain = gating.generated_source(*_args(CASES[0]))
    assert "tl.static_range(4)" in grouped and "group-limited" in grouped and "selection-only bias" in grouped
    assert "group" not in plain.split("import triton", 1)[1] and "bias_C" not in plain
    assert "tl.arange(0, 8)" in plain and "tl.arange(0, 32)" in grouped  # E padded to a power of two


def test_eligible_declines_with_reasons(monkeypatch):
    args = list(_args(CASES[0]))
    assert gating.eligible(*args) is None
    assert "dtype" in gating.eligible(args[0].double(), *args[1:])
    assert "E=2000" in gating.eligible(torch.empty(4, 2000, device="meta"), *args[1:])
    assert "n_group" in gating.eligible(args[0], None, "sigmoid", True, 2, True, 3, 2, "top2_sum", 1.0)
    monkeypatch.setattr(cg, "is_interpreted", lambda: False)
    assert "TRITON_INTERPRET is off" in gating.eligible(*args)


def test_falls_back_to_reference_when_triton_cannot_launch(monkeypatch):
    args = _args(CASES[0])
    monkeypatch.setattr(cg, "launch_blocker", lambda device: "no Triton here")
    before = gating.FALLBACKS["route"]
    weights_TK, experts_TK = torch.ops.moe_lowered.route(*args)
    assert gating.FALLBACKS["route"] == before + 1
    assert torch.equal(experts_TK, dialect.route_ref(*args)[1])


def test_registered_lowering():
    from lowering import registry

    (entry,) = [r for r in registry() if r.family == "gating"]
    assert entry.dialect_op is dialect.ROUTE and entry.lowered_op is torch.ops.moe_lowered.route.default
    assert "route_kernel" in entry.source(*_args(CASES[0]))


def test_shape_errors_name_dimensions():
    with pytest.raises(ValueError, match="top_k=9 must lie in \\[1, E=8\\]"):
        gating.route_triton(torch.randn(4, 8), None, "softmax", True, 9, True, 1, 1, "top2_sum", 1.0)


def test_eligible_and_source_accept_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits_TE, bias_E = torch.empty(64, 24), torch.empty(24)
        args = (logits_TE, bias_E, "sigmoid", True, 4, True, 4, 2, "top2_sum", 2.5)
        assert gating.eligible(*args) is None
        assert "route_kernel" in gating.generated_source(*args)
        weights_TK, experts_TK = torch.ops.moe_lowered.route(*args)
    assert weights_TK.shape == (64, 4) and experts_TK.dtype == torch.int64
