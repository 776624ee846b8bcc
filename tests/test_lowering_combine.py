"""Fused unpermute+combine kernels (`moe_lowered::unpermute_combine`, interpreted) against the dialect.

Shape legend: T tokens, D model width, K top-k, N = T*K routed rows (expert-sorted).
Reference: `combine_ref(unpermute_ref(y_ND, order_N, K), weights_TK)`; gradients against the dialect
ops' own autograd (`moe.unpermute` then `moe.combine`).
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from lowering import codegen as cg
from lowering import combine
from moepass import dialect

Case = namedtuple("Case", "id T D K E y_dtype w_dtype order")
CASES = [
    Case("fp32", 16, 32, 2, 8, torch.float32, torch.float32, "permute"),
    Case("bf16_fp32_weights_E6", 7, 20, 3, 6, torch.bfloat16, torch.float32, "permute"),
    Case("fp16_K1", 5, 8, 1, 3, torch.float16, torch.float16, "permute"),
    Case("bf16_bf16_weights", 12, 40, 4, 5, torch.bfloat16, torch.bfloat16, "permute"),
    Case("T0", 0, 8, 2, 4, torch.float32, torch.float32, "permute"),
    Case("T1_D300_several_D_tiles", 1, 300, 4, 5, torch.float32, torch.float32, "permute"),
    Case("all_to_one_expert", 24, 16, 2, 4, torch.float32, torch.float32, "one_expert"),
    Case("random_order", 33, 24, 3, 8, torch.float32, torch.float32, "random"),
]


def _inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    N = case.T * case.K
    if case.order == "random":
        order_N = torch.randperm(N)
    elif case.order == "one_expert":
        order_N = dialect.permute_ref(torch.zeros(case.T, 1), torch.zeros(case.T, case.K, dtype=torch.int64), 1)[2]
    else:  # what a real permute produces
        experts_TK = torch.stack([torch.randperm(case.E)[: case.K] for _ in range(case.T)]) if case.T \
            else torch.empty(0, case.K, dtype=torch.int64)
        order_N = dialect.permute_ref(torch.zeros(case.T, 1), experts_TK, case.E)[2]
    y_ND = torch.randn(N, case.D).to(case.y_dtype)
    weights_TK = torch.rand(case.T, case.K).to(case.w_dtype)
    return y_ND, order_N, case.K, weights_TK


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = 1e-5 if expected.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_combine_matches_reference(case):
    y_ND, order_N, K, weights_TK = _inputs(case)
    out_TD = torch.ops.moe_lowered.unpermute_combine(y_ND, order_N, K, weights_TK)
    assert out_TD.dtype == case.y_dtype and out_TD.shape == (case.T, case.D)
    _close(out_TD, dialect.combine_ref(dialect.unpermute_ref(y_ND, order_N, K), weights_TK))


@pytest.mark.parametrize("case", [c for c in CASES if c.T], ids=lambda c: c.id)
def test_combine_gradients_match_dialect(case):
    y_ND, order_N, K, weights_TK = _inputs(case)
    grad_TD = torch.randn(case.T, case.D).to(case.y_dtype)
    lowered = lambda y, w: torch.ops.moe_lowered.unpermute_combine(y, order_N, K, w)
    unfused = lambda y, w: torch.ops.moe.combine(torch.ops.moe.unpermute(y, order_N, K), w)
    grads = []
    for fn in (lowered, unfused):
        y, w = y_ND.clone().requires_grad_(), weights_TK.clone().requires_grad_()
        grads.append(torch.autograd.grad(fn(y, w), (y, w), grad_TD))
    (grad_y, grad_w), (want_grad_y, want_grad_w) = grads
    _close(grad_y, want_grad_y)
    _close(grad_w, want_grad_w)


def test_unweighted_sum_is_permute_backward():
    y_ND, order_N, K, _ = _inputs(CASES[1])
    out_TD = combine.combine_triton(y_ND, order_N, K, None)
    _close(out_TD, dialect.unpermute_ref(y_ND, order_N, K).float().sum(1).to(y_ND.dtype))


def test_opcheck():
    y_ND, order_N, K, weights_TK = _inputs(CASES[0])
    torch.library.opcheck(torch.ops.moe_lowered.unpermute_combine.default,
                          (y_ND.requires_grad_(), order_N, K, weights_TK.requires_grad_()))


def test_autocast_combines_in_fp32_as_the_dialect_op():
    y_ND, order_N, K, weights_TK = _inputs(CASES[1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_TD = torch.ops.moe_lowered.unpermute_combine(y_ND, order_N, K, weights_TK)
        want = dialect.COMBINE(dialect.UNPERMUTE(y_ND, order_N, K), weights_TK)
    assert y_ND.dtype == torch.bfloat16 and out_TD.dtype == want.dtype == torch.float32


def test_source_is_specialised():
    y_ND, order_N, K, weights_TK = _inputs(CASES[1])
    weighted = combine.generated_source(y_ND, order_N, K, weights_TK)
    unweighted = combine.generated_source(y_ND, order_N, K, None)
    assert "range(3)" in weighted and "combine_backward_kernel" in weighted and "round_bf16" in weighted
    assert "tl.load(w_ptr" not in unweighted and "tl.load(w_ptr" in weighted and "combine_backward_kernel" not in unweighted


def test_eligible_declines_with_reasons(monkeypatch):
    y_ND, order_N, K, weights_TK = _inputs(CASES[0])
    assert combine.eligible(y_ND, order_N, K, weights_TK) is None
    assert "weights_TK has shape" in combine.eligible(y_ND, order_N, K, weights_TK[:3])
    assert "order_N has shape" in combine.eligible(y_ND, order_N[:5], K, weights_TK)
    assert "order_N dtype" in combine.eligible(y_ND, order_N.int(), K, weights_TK)
    monkeypatch.setattr(cg, "is_interpreted", lambda: False)
    assert "TRITON_INTERPRET is off" in combine.eligible(y_ND, order_N, K, weights_TK)


def test_shape_errors_name_dimensions():
    y_ND, order_N, K, weights_TK = _inputs(CASES[0])
    with pytest.raises(ValueError, match=r"weights_TK has shape \(3, 2\), expected \(T=16, K=2\)"):
        combine.combine_triton(y_ND, order_N, K, weights_TK[:3])


def test_registered_lowering_fuses_unpermute():
    from lowering import registry

    (entry,) = [r for r in registry() if r.family == "combine"]
    assert entry.dialect_op is dialect.COMBINE and entry.fuses == (dialect.UNPERMUTE,)
    assert entry.lowered_op is torch.ops.moe_lowered.unpermute_combine.default


def test_lowered_block_compiles_and_matches_dialect():
    """route -> permute -> (stand-in experts) -> unpermute_combine under torch.compile(aot_eager), fwd + bwd."""
    T, D, E, K = 16, 32, 6, 2

    def block(x_TD, logits_TE, ns):
        weights_TK, experts_TK = ns.route(logits_TE, None, "softmax", True, K, True, 1, 1, "top2_sum", 1.0)
        x_ND, _counts_E, order_N = ns.permute(x_TD, experts_TK, E)
        y_ND = x_ND * 2.0
        if ns is torch.ops.moe_lowered:
            return ns.unpermute_combine(y_ND, order_N, K, weights_TK)
        return ns.combine(ns.unpermute(y_ND, order_N, K), weights_TK)

    x_TD, logits_TE = torch.randn(T, D, requires_grad=True), torch.randn(T, E, requires_grad=True)
    compiled = torch.compile(lambda x, l: block(x, l, torch.ops.moe_lowered), backend="aot_eager", fullgraph=True)
    out_TD = compiled(x_TD, logits_TE)
    want_TD = block(x_TD, logits_TE, torch.ops.moe)
    _close(out_TD, want_TD)
    for got, want in zip(torch.autograd.grad(out_TD.sum(), (x_TD, logits_TE)),
                         torch.autograd.grad(want_TD.sum(), (x_TD, logits_TE))):
        _close(got, want)
