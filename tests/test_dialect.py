"""The MoE dialect ops: registrations (opcheck), exact inverses, autocast policy, semantics.

Legend: T tokens, D width, F expert width, E experts, K top-k, N = T*K.
"""

import pytest
import torch
from torch.library import opcheck

import moepass  # noqa: F401  (registers the moe:: ops)

T, D, F, E, K = 11, 8, 12, 5, 2  # E not a power of two
ACTIVATIONS = ["swiglu", "geglu", "gelu", "gelu_tanh", "relu", "clamped_swiglu"]
ROUTERS = [  # score_func, softmax_before_topk, renormalize, n_group, topk_group, scaling
    ("softmax", True, True, 1, 1, 1.0),
    ("softmax", True, False, 1, 1, 1.0),
    ("softmax", False, False, 1, 1, 1.0),
    ("sigmoid", True, True, 1, 1, 2.5),
    ("sigmoid", True, True, 5, 2, 2.5),
]


def _ffn_args(activation, bias=True, dtype=torch.float32, counts=None):
    gated = activation in ("swiglu", "geglu", "clamped_swiglu")
    counts = torch.tensor([3, 0, 7, 1, 11]) if counts is None else counts
    x = torch.randn(int(counts.sum()), D, dtype=dtype, requires_grad=True)
    w = lambda *s: torch.randn(*s, dtype=dtype, requires_grad=True)  # noqa: E731
    return (x, counts, w(E, F, D), w(E, F, D) if gated else None, w(E, D, F),
            w(E, F) if bias else None, w(E, F) if bias and gated else None, w(E, D) if bias else None,
            activation, 1.5, 1.702)


@pytest.mark.parametrize("router", ROUTERS)
def test_route_opcheck_and_gradcheck(router):
    sf, before, renorm, groups, keep, scale = router
    logits = torch.randn(T, E, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(E, dtype=torch.float64)
    args = (bias, sf, before, K, renorm, groups, keep, "top2_sum", scale)
    opcheck(torch.ops.moe.route.default, (logits, *args))
    torch.autograd.gradcheck(lambda l: torch.ops.moe.route(l, *args)[0], (logits,))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_expert_ffn_opcheck_and_gradcheck(activation):
    args = _ffn_args(activation)
    opcheck(torch.ops.moe.expert_ffn.default, args)
    double = [a.detach().double().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
              for a in args]
    torch.autograd.gradcheck(lambda *t: torch.ops.moe.expert_ffn(*t), double)


def test_expert_ffn_rejects_mismatched_weights_with_dims():
    x, counts, wg, wu, wd, *rest = _ffn_args("swiglu", bias=False)
    with pytest.raises(ValueError, match=r"w_down_EDF has shape \(5, 8, 7\), expected \(E=5, D=8, F=12\)"):
        torch.ops.moe.expert_ffn(x, counts, wg, wu, torch.randn(E, D, 7), *rest)


def test_permute_unpermute_is_an_exact_inverse_with_gradients():
    x = torch.randn(T, D, requires_grad=True)
    experts = torch.randint(0, E, (T, K))
    x_ND, counts, order = torch.ops.moe.permute(x, experts, E)
    assert counts.tolist() == torch.bincount(experts.flatten(), minlength=E).tolist()
    assert torch.equal(torch.ops.moe.unpermute(x_ND, order, K), x[:, None, :].expand(T, K, D))
    # rows are sorted by expert, stably
    assert torch.equal(experts.flatten()[order], experts.flatten()[order].sort(stable=True).values)
    g = torch.randn(T, K, D)
    (gx,) = torch.autograd.grad(torch.ops.moe.unpermute(x_ND, order, K), x, g)
    assert torch.equal(gx, g.sum(1))
    opcheck(torch.ops.moe.permute.default, (x, experts, E))
    opcheck(torch.ops.moe.unpermute.default, (x_ND.detach().requires_grad_(), order, K))


def test_unpermute_then_permute_gradient_round_trip_is_exact():
    y = torch.randn(T * K, D, requires_grad=True)
    experts = torch.randint(0, E, (T, K))
    _, _, order = torch.ops.moe.permute(torch.randn(T, D), experts, E)
    y_TKD = torch.ops.moe.unpermute(y, order, K)
    g = torch.randn(T, K, D)
    (gy,) = torch.autograd.grad(y_TKD, y, g)
    assert torch.equal(gy, g.reshape(-1, D)[order])


def test_combine_matches_weighted_sum_and_opcheck():
    y = torch.randn(T, K, D, requires_grad=True)
    w = torch.rand(T, K, requires_grad=True)
    torch.testing.assert_close(torch.ops.moe.combine(y, w), (y * w[..., None]).sum(1))
    opcheck(torch.ops.moe.combine.default, (y, w))


def test_capacity_keep_matches_a_naive_queue():
    experts = torch.randint(0, E, (T, K))
    for capacity, k_major in [(1, True), (2, True), (2, False), (0, True)]:
        keep = torch.ops.moe.capacity_keep(experts, E, capacity, 0, k_major)
        used = [0] * E
        expected = torch.zeros(T, K, dtype=torch.bool)
        order = [(t, k) for k in range(K) for t in range(T)] if k_major else [(t, k) for t in range(T) for k in range(K)]
        for t, k in order:
            e = int(experts[t, k])
            if used[e] < capacity:
                used[e] += 1
                expected[t, k] = True
        assert torch.equal(keep, expected), (capacity, k_major)


@pytest.mark.parametrize("group_size", [0, 4])
@pytest.mark.parametrize("k_major", [True, False])
def test_capacity_keep_is_laid_out_as_its_fake(group_size, k_major):
    """Row-major as the fake says: Inductor asserts every extern op's strides against its fake, and a k-major
    mask over one group came back as a transposed view (torch.compile(..., backend="inductor") of a GShard block
    raised `expected ... stride 1==2`)."""
    experts = torch.randint(0, E, (8, 2))
    keep = torch.ops.moe.capacity_keep(experts, E, 2, group_size, k_major)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch.ops.moe.capacity_keep(mode.from_tensor(experts), E, 2, group_size, k_major)
    assert keep.stride() == fake.stride() == (2, 1)
    opcheck(torch.ops.moe.capacity_keep.default, (experts, E, 2, group_size, k_major))


def test_capacity_groups_are_independent():
    experts = torch.zeros(8, 1, dtype=torch.long)  # everyone wants expert 0
    keep = torch.ops.moe.capacity_keep(experts, E, 2, 4, True)  # two groups of 4, capacity 2 each
    assert keep.flatten().tolist() == [True, True, False, False, True, True, False, False]


def test_route_group_limited_selection_masks_groups():
    # 2 groups of 2: group 0 = experts {0, 1}, group 1 = {2, 3}; keep 1 group
    logits = torch.tensor([[3.0, -5.0, 1.0, 1.0]])
    w, idx = torch.ops.moe.route(logits, None, "sigmoid", True, 2, False, 2, 1, "top2_sum", 1.0)
    assert sorted(idx[0].tolist()) == [2, 3]  # group 1's top-2 sum beats group 0's despite expert 0 being best
    w, idx = torch.ops.moe.route(logits, None, "sigmoid", True, 2, False, 1, 1, "top2_sum", 1.0)
    assert sorted(idx[0].tolist()) == [0, 2]


def test_autocast_policy_router_fp32_experts_compute_dtype_combine_fp32():
    logits = torch.randn(T, E, dtype=torch.bfloat16)
    args = _ffn_args("swiglu", bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w, _ = torch.ops.moe.route(logits, None, "softmax", True, K, True, 1, 1, "top2_sum", 1.0)
        y = torch.ops.moe.expert_ffn(*args)
        out = torch.ops.moe.combine(y.view(T, K, -1), w)  # the weighted sum: in fp32, as a block's own buffer
    assert w.dtype == torch.float32 and y.dtype == torch.bfloat16 and out.dtype == torch.float32
