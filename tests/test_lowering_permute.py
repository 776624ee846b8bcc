"""Generated permute kernels (`moe_lowered::permute`, interpreted) against `moepass.dialect.permute_ref`.

Shape legend: T tokens, D model width, E experts, K top-k, N = T*K routed rows.
Permutation is data movement: x_ND, counts_E and order_N must be bit-identical to the reference
(stable order included); gradients (sums over K) within dtype tolerance.
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from lowering import codegen as cg
from lowering import permute
from moepass import dialect

Case = namedtuple("Case", "id T D E K dtype routing")
CASES = [
    Case("small_fp32", 16, 32, 8, 2, torch.float32, "random"),
    Case("E6_bf16", 37, 20, 6, 3, torch.bfloat16, "random"),
    Case("fp16_K1", 5, 8, 3, 1, torch.float16, "random"),
    Case("T0", 0, 8, 4, 2, torch.float32, "random"),
    Case("T1_D300", 1, 300, 5, 4, torch.float32, "random"),
    Case("one_expert_takes_all", 64, 16, 8, 1, torch.float32, "one_expert"),
    Case("same_experts_every_token", 40, 16, 7, 3, torch.bfloat16, "same"),
    Case("E1", 9, 8, 1, 1, torch.float32, "random"),
    Case("skewed_int32_ids", 50, 24, 10, 2, torch.float32, "skewed"),
    Case("many_blocks_E1000", 200, 8, 1000, 8, torch.float32, "random"),  # 100 row blocks, 2 scan steps
]


def _inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, int]:
    x_TD = torch.randn(case.T, case.D).to(case.dtype)
    if case.routing == "one_expert":
        experts_TK = torch.full((case.T, case.K), case.E - 1)
    elif case.routing == "same":
        experts_TK = torch.arange(case.K).repeat(case.T, 1)
    elif case.routing == "skewed":  # int32 ids, heavily skewed, duplicates within a token allowed
        experts_TK = (torch.rand(case.T, case.K) ** 4 * case.E).long().clamp(max=case.E - 1).int()
    else:
        experts_TK = torch.stack([torch.randperm(case.E)[: case.K] for _ in range(case.T)]) if case.T \
            else torch.empty(0, case.K, dtype=torch.int64)
    return x_TD, experts_TK, case.E


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_permute_matches_reference_exactly(case):
    x_TD, experts_TK, E = _inputs(case)
    x_ND, counts_E, order_N = torch.ops.moe_lowered.permute(x_TD, experts_TK, E)
    want_x_ND, want_counts_E, want_order_N = dialect.permute_ref(x_TD, experts_TK.long(), E)
    assert torch.equal(order_N, want_order_N)  # the stable order
    assert torch.equal(counts_E, want_counts_E)
    assert torch.equal(x_ND, want_x_ND)


@pytest.mark.parametrize("case", [c for c in CASES if c.T and c.E < 1000], ids=lambda c: c.id)
def test_permute_gradient_matches_dialect(case):
    x_TD, experts_TK, E = _inputs(case)
    grad_ND = torch.randn(case.T * case.K, case.D).to(case.dtype)
    grads = []
    for op in (torch.ops.moe_lowered.permute, torch.ops.moe.permute):
        leaf_TD = x_TD.clone().requires_grad_()
        (grad_TD,) = torch.autograd.grad(op(leaf_TD, experts_TK.long(), E)[0], leaf_TD, grad_ND)
        grads.append(grad_TD)
    tol = 1e-5 if case.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(*grads, rtol=tol, atol=tol)


def test_opcheck():
    x_TD, experts_TK, E = _inputs(CASES[0])
    torch.library.opcheck(torch.ops.moe_lowered.permute.default, (x_TD.requires_grad_(), experts_TK, E))


def test_source_is_specialised():
    x_TD, experts_TK, E = _inputs(CASES[1])
    source = permute.generated_source(x_TD, experts_TK, E)
    assert "tl.arange(0, 8)" in source and "* 20 +" in source and "n_Y // 3" in source  # E_PAD, D, K baked in
    assert "torch.bfloat16" in source


def test_eligible_declines_with_reasons(monkeypatch):
    x_TD, experts_TK, E = _inputs(CASES[0])
    assert permute.eligible(x_TD, experts_TK, E) is None
    assert "experts_TK dtype" in permute.eligible(x_TD, experts_TK.float(), E)
    assert "T=16" in permute.eligible(x_TD, experts_TK[:3], E)
    assert "num_experts=5000" in permute.eligible(x_TD, experts_TK, 5000)
    monkeypatch.setattr(cg, "is_interpreted", lambda: False)
    assert "TRITON_INTERPRET is off" in permute.eligible(x_TD, experts_TK, E)


def test_shape_errors_name_dimensions():
    with pytest.raises(ValueError, match="experts_TK has 3 rows, x_TD has T=4"):
        permute.permute_triton(torch.randn(4, 8), torch.zeros(3, 2, dtype=torch.int64), 4)


def test_registered_lowering():
    from lowering import registry

    (entry,) = [r for r in registry() if r.family == "permute"]
    assert entry.dialect_op is dialect.PERMUTE and entry.lowered_op is torch.ops.moe_lowered.permute.default
