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
    _gradients_match(case, _args(case))


def _gradients_match(case, args):
    """The lowered route's logits gradient equals the dialect op's for the same weights gradient."""
    logits_TE, *rest = args
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
    assert "group" not in plain.split("import triton", 1)[1] and "bias_Z" not in plain
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
    before = cg.FALLBACKS["route"]
    weights_TK, experts_TK = torch.ops.moe_lowered.route(*args)
    assert cg.FALLBACKS["route"] == before + 1
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


# ----------------------------------------------------------------------------------------------
# A per-row selection bias [T, E] (one row per token: a Multi-Head LatentMoE's per-head biases
# repeated over its sub-tokens). The kernel reads row t at t * bias_row_stride; [E] is stride 0.
# ----------------------------------------------------------------------------------------------

#                        id                         T   E   K  score      before renorm G  TG group        scale bias   dtype           ties
ROW_BIAS_CASES = [
    Case("rows_softmax_after_latent",               24, 4,  2, "softmax", False, False, 1, 1, "top2_sum", 1.0, True,  torch.float32, False),
    Case("rows_softmax_after_renorm_E10",           16, 10, 3, "softmax", False, True,  1, 1, "top2_sum", 1.0, True,  torch.float32, False),
    Case("rows_softmax_before",                     16, 8,  2, "softmax", True,  True,  1, 1, "top2_sum", 1.0, True,  torch.float32, False),
    Case("rows_softmax_before_no_renorm_E60",       9,  60, 4, "softmax", True,  False, 1, 1, "top2_sum", 1.0, True,  torch.float32, False),
    Case("rows_sigmoid",                            8,  7,  3, "sigmoid", True,  True,  1, 1, "top2_sum", 1.5, True,  torch.float32, False),
    Case("rows_sigmoid_groups",                     16, 24, 4, "sigmoid", True,  True,  4, 2, "top2_sum", 2.5, True,  torch.float32, False),
    Case("rows_sigmoid_groups_max",                 16, 12, 3, "sigmoid", True,  True,  4, 2, "max",      1.0, True,  torch.float32, False),
    Case("rows_K1",                                 16, 8,  1, "softmax", False, False, 1, 1, "top2_sum", 1.0, True,  torch.float32, False),
    Case("rows_K1_softmax_before",                  16, 8,  1, "softmax", True,  True,  1, 1, "top2_sum", 1.0, True,  torch.float32, False),
    Case("rows_K_equals_E",                         5,  5,  5, "softmax", False, False, 1, 1, "top2_sum", 1.0, True,  torch.float32, False),
    Case("rows_K_equals_E_sigmoid",                 5,  6,  6, "sigmoid", True,  True,  1, 1, "top2_sum", 1.0, True,  torch.float32, False),
    Case("rows_E1",                                 4,  1,  1, "softmax", False, False, 1, 1, "top2_sum", 1.0, True,  torch.float32, False),
    Case("rows_T0",                                 0,  8,  2, "softmax", False, False, 1, 1, "top2_sum", 1.0, True,  torch.float32, False),
    Case("rows_T1",                                 1,  16, 2, "sigmoid", True,  True,  4, 1, "top2_sum", 2.0, True,  torch.float32, False),
    Case("rows_bf16_fp32_bias",                     64, 8,  2, "softmax", False, False, 1, 1, "top2_sum", 1.0, True,  torch.bfloat16, False),
    Case("rows_fp16_groups",                        33, 24, 4, "sigmoid", True,  True,  4, 2, "top2_sum", 2.5, True,  torch.float16, False),
    Case("ties_rows_softmax_after",                 32, 9,  2, "softmax", False, False, 1, 1, "top2_sum", 1.0, True,  torch.float32, True),
    Case("ties_rows_softmax_before",                32, 8,  3, "softmax", True,  True,  1, 1, "top2_sum", 1.0, True,  torch.float32, True),
    Case("ties_rows_groups",                        32, 12, 4, "sigmoid", True,  True,  4, 2, "top2_sum", 1.0, True,  torch.float32, True),
]


def _row_args(case: Case) -> tuple:
    """`_args(case)` with a [T, E] bias instead of the [E] one (rows differ from each other)."""
    logits_TE, _, *rest = _args(case)
    if case.ties:  # bias values on the same coarse grid as the logits: ties between biased choices too
        bias_TE = torch.randint(0, 2, (case.T, case.E)).float() * 0.25
    else:
        bias_TE = torch.randn(case.T, case.E)
    return (logits_TE, bias_TE, *rest)


def _expected_weights(logits_TE, experts_TK, case: Case) -> torch.Tensor:
    """The weights of the chosen experts straight from the unbiased scores (the bias only selects)."""
    if case.score_func == "softmax" and not case.before:
        weights_TK = torch.softmax(logits_TE.gather(1, experts_TK), dim=-1)
    else:
        scores_TE = torch.softmax(logits_TE, dim=-1) if case.score_func == "softmax" else torch.sigmoid(logits_TE)
        weights_TK = scores_TE.gather(1, experts_TK)
        if case.renorm:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
    return weights_TK * case.scaling


@pytest.mark.parametrize("case", ROW_BIAS_CASES, ids=[c.id for c in ROW_BIAS_CASES])
def test_route_with_a_row_bias_matches_reference(case, monkeypatch):
    args = _row_args(case)
    weights_TK, experts_TK = torch.ops.moe_lowered.route(*args)
    want_weights_TK, want_experts_TK = _expected(case, args, monkeypatch)
    assert experts_TK.dtype == torch.int64 and weights_TK.dtype == case.dtype
    assert experts_TK.shape == weights_TK.shape == (case.T, case.K)
    assert torch.equal(experts_TK, want_experts_TK)
    _close(weights_TK, want_weights_TK)


ROW_SELECTS = [c for c in ROW_BIAS_CASES if c.id in ("rows_softmax_after_latent", "rows_softmax_before", "rows_sigmoid",
                                                     "rows_K1", "rows_K1_softmax_before")]


@pytest.mark.parametrize("case", ROW_SELECTS, ids=lambda c: c.id)
def test_row_bias_changes_the_selection_but_not_the_weights(case):
    # every row's bias forces a different set of experts: the LEAST likely ones of that row
    logits_TE = torch.randn(case.T, case.E) * 2
    worst_TK = torch.topk(-logits_TE, case.K, dim=-1).indices
    bias_TE = torch.zeros(case.T, case.E).scatter(1, worst_TK, 100.0)
    args = (logits_TE, bias_TE, case.score_func, case.before, case.K, case.renorm, case.n_group, case.topk_group,
            case.group_score, case.scaling)
    weights_TK, experts_TK = torch.ops.moe_lowered.route(*args)
    unbiased_TK = torch.ops.moe_lowered.route(logits_TE, None, *args[2:])[1]
    assert torch.equal(experts_TK.sort(-1).values, worst_TK.sort(-1).values)
    assert not torch.equal(experts_TK.sort(-1).values, unbiased_TK.sort(-1).values)
    _close(weights_TK, _expected_weights(logits_TE, experts_TK, case))  # unbiased scores, never +100
    assert weights_TK.max() <= case.scaling + 1e-6


def test_each_row_uses_its_own_bias_row():
    # a Multi-Head LatentMoE: H heads' biases repeated over the tokens, row g = t * H + j is head j's
    T, H, E, K = 6, 3, 5, 2
    logits_GE = torch.randn(T * H, E)
    bias_HE = torch.randn(H, E) * 3
    bias_GE = bias_HE.repeat(T, 1)
    options = ("softmax", False, K, False, 1, 1, "top2_sum", 1.0)
    weights_GK, experts_GK = torch.ops.moe_lowered.route(logits_GE, bias_GE, *options)
    for g in range(T * H):  # one token at a time with that row's bias as an [E] bias
        w_K, e_K = torch.ops.moe_lowered.route(logits_GE[g:g + 1], bias_HE[g % H], *options)
        assert torch.equal(experts_GK[g], e_K[0]) and torch.equal(weights_GK[g], w_K[0]), g
    assert torch.equal(experts_GK, dialect.route_ref(logits_GE, bias_GE, *options)[1])


@pytest.mark.parametrize("case", [c for c in CASES if c.bias], ids=lambda c: c.id)
def test_shared_bias_is_the_stride_zero_row_bias(case):
    # [E], the same row repeated as [T, E], and an expanded [T, E] view (stride 0, no copy) agree exactly
    args = _args(case)
    logits_TE, bias_E, *rest = args
    want = torch.ops.moe_lowered.route(*args)
    for bias_TE in (bias_E.repeat(case.T, 1), bias_E.expand(case.T, case.E)):
        got = torch.ops.moe_lowered.route(logits_TE, bias_TE, *rest)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    assert gating.kernel_module(*args) is gating.kernel_module(logits_TE, bias_E.repeat(case.T, 1), *rest)


def test_row_bias_with_any_row_stride(monkeypatch):
    case = ROW_BIAS_CASES[1]
    logits_TE, bias_TE, *rest = _row_args(case)
    want = dialect.route_ref(logits_TE, bias_TE, *rest)
    wide = torch.randn(case.T, case.E + 7)
    wide[:, 3:3 + case.E] = bias_TE
    transposed = bias_TE.t().contiguous().t()
    for layout in (wide[:, 3:3 + case.E], transposed):  # row stride E + 7; column stride T (copied)
        weights_TK, experts_TK = torch.ops.moe_lowered.route(logits_TE, layout, *rest)
        assert torch.equal(experts_TK, want[1])
        _close(weights_TK, want[0])


@pytest.mark.parametrize("case", [c for c in ROW_BIAS_CASES if c.T and c.dtype == torch.float32 and not c.ties][:4],
                         ids=lambda c: c.id)
def test_row_bias_gradient_matches_dialect(case):
    _gradients_match(case, _row_args(case))


def test_opcheck_row_bias():
    torch.library.opcheck(torch.ops.moe_lowered.route.default, _row_args(ROW_BIAS_CASES[5]))


def test_eligible_takes_a_row_bias_and_declines_other_shapes():
    logits_TE, bias_TE, *rest = _row_args(ROW_BIAS_CASES[0])
    T, E = logits_TE.shape
    assert gating.eligible(logits_TE, bias_TE, *rest) is None
    assert gating.eligible(logits_TE, bias_TE[0], *rest) is None
    for bad in (torch.randn(T + 1, E), torch.randn(E + 1), torch.randn(T, E, 1), torch.randn(1, E)):
        reason = gating.eligible(logits_TE, bad, *rest)
        assert reason is not None and f"({E},) or ({T}, {E})" in reason and str(tuple(bad.shape)) in reason
    assert "dtype" in gating.eligible(logits_TE, bias_TE.double(), *rest)
    assert "meta" in gating.eligible(logits_TE, bias_TE.to("meta"), *rest)


def test_row_bias_shape_errors_name_dimensions():
    with pytest.raises(ValueError, match=r"selection_bias has shape \(3, 8\), expected \(E=8,\) or one row per "
                                         r"token \(T=4, E=8\)"):
        gating.route_triton(torch.randn(4, 8), torch.randn(3, 8), "softmax", True, 2, True, 1, 1, "top2_sum", 1.0)


def test_row_bias_source_reads_a_row_per_token():
    row_args = _row_args(ROW_BIAS_CASES[0])
    source = gating.generated_source(*row_args)
    plain = gating.generated_source(*_args(CASES[0]))
    assert source == gating.generated_source(row_args[0], row_args[1][0], *row_args[2:])  # [E]: the same source
    assert "rows64_Y[:, None] * bias_row_stride" in source and "bias_YZ" in source
    assert "bias_YZ" not in plain  # no bias: no bias load at all
    assert 'do_not_specialize=["bias_row_stride"]' in source  # [E] and [T, E] launch one compiled kernel
    (build,) = gating.kernel_module(*_row_args(ROW_BIAS_CASES[0])).GPU_BUILDS
    assert build["signature"]["bias_row_stride"] == "i32"


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


ROW_BIAS_BUILDS = {  # compile-only sm_80/sm_90 builds of the per-row bias kernel (meta tensors)
    "latent_softmax_after": (_meta(1, 64), _meta(1, 64), "softmax", False, 4, False, 1, 1, "top2_sum", 1.0),
    "deepseek_v3_rows": (_meta(1, 256), _meta(1, 256), "sigmoid", True, 8, True, 8, 4, "top2_sum", 2.5),
    "bf16_rows_E6": (_meta(1, 6, dtype=torch.bfloat16), _meta(1, 6), "softmax", False, 2, True, 1, 1, "top2_sum", 1.0),
}


@pytest.mark.skipif(cg.gpu_build_blocker() is not None, reason=str(cg.gpu_build_blocker()))
def test_row_bias_kernel_builds_for_gpus_without_spills():
    requests, names = [], []
    for name, args in ROW_BIAS_BUILDS.items():
        module = gating.kernel_module(*args)
        assert module is gating.kernel_module(args[0], args[1][0], *args[2:])  # the [E] bias runs the same kernel
        for arch in (80, 90):
            batch = cg.module_requests(module, arch)
            requests += batch
            names += [(name, arch)] * len(batch)
    for (name, arch), report in zip(names, cg.build_many(requests), strict=True):
        assert report.name == "route_kernel" and report.cubin_bytes > 0 and report.registers > 0, (name, arch)
        assert report.problems() == [], (name, arch, report)


# ----------------------------------------------------------------------------------------------
# The lower pass on a Multi-Head LatentMoE: its routing (a [T*H, E] bias) is one generated launch.
# ----------------------------------------------------------------------------------------------


def test_lower_pass_lowers_the_gating_of_a_latent_moe_and_matches_the_unlowered_compile():
    import moepass
    from samples.models import tiny_latent_lm

    torch.manual_seed(0)
    model = tiny_latent_lm(layers=1, dim=32, heads=4, head_dim=8, experts=4, top_k=2, bias_update_rate=0.01)
    with torch.no_grad():  # biases that matter for the selection
        for block in (layer.mlp for layer in model.layers):
            block.selection_bias.copy_(torch.randn_like(block.selection_bias) * 0.3)
    lowered = moepass.compile(model, moepass.Plan(form="single", lowering="triton"))
    unlowered = moepass.compile(model, moepass.Plan(form="single", lowering="torch"))
    assert len(lowered.moepass_info.rewritten) == 1
    for path, gm in lowered.moepass_info.rewritten.items():
        (record,) = [h for h in gm.history if h["pass"] == "lower"]
        assert record["stats"]["lowered"]["gating"] >= 1, path
        assert "gating" not in record["stats"]["declined"] and "*" not in record["stats"]["declined"], path
        assert any(n.target is torch.ops.moe_lowered.route.default for n in gm.graph.nodes), path
        assert not any(n.target is dialect.ROUTE for n in gm.graph.nodes), path

    launches = {"route": 0}
    real_route_triton = gating.route_triton

    def counting_route_triton(*args):
        launches["route"] += 1
        return real_route_triton(*args)

    fallbacks = cg.FALLBACKS["route"]
    tokens = torch.randint(0, 256, (2, 7))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(gating, "route_triton", counting_route_triton)
        for step in range(2):  # train mode: the second step routes with the biases the first one updated
            losses = []
            for compiled in (lowered, unlowered):
                compiled.zero_grad(set_to_none=True)
                loss = compiled.loss(tokens)
                loss.backward()
                losses.append(loss)
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
            theirs = dict(unlowered.named_parameters())
            for name, p in lowered.named_parameters():
                assert p.grad is not None, f"{name} got no gradient"
                torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-5, atol=1e-6,
                                           msg=lambda msg, name=name: f"step {step} {name}: {msg}")
            theirs_buffers = dict(unlowered.named_buffers())
            for name, b in lowered.named_buffers():
                assert torch.equal(b, theirs_buffers[name]), f"step {step} {name}"
        lowered.eval(), unlowered.eval()
        with torch.no_grad():
            torch.testing.assert_close(lowered(tokens), unlowered(tokens), rtol=1e-5, atol=1e-6)
    assert launches["route"] == 2 + 1  # 2 train steps + 1 eval forward
    assert cg.FALLBACKS["route"] == fallbacks
