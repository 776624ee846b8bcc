"""Experts that compute in a lower precision than their weights (`ExpertsSpec.compute_dtype`, `moe.expert_ffn`'s
`compute_dtype`): the op casts x, weights and biases to it, y back to x's dtype, and every gradient to its
input's dtype — what autograd gives over a block's own casts (torchtitan's GroupedExperts: `x.bfloat16()`,
`w.bfloat16()` around `torch._grouped_mm`, then `.type_as(x)`).

- op level: bit for bit the op run on inputs cast by autograd, for every GEMM engine, with and without biases,
  saved or recomputed; the gradients in fp32; through the eager path, the Lancet deferral and FSEP's rebuild;
- model level, torchtitan's own bf16 experts: Plan(expert_recompute=True), Plan(lowering="triton")
  (interpreted) and torch.compile(backend="moepass") against the block itself.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_expert_compute import ENGINES, ffn_args, use_engine

import moepass
from moepass import dialect, eager
from moepass.runtime.scheduler import DEFER_WGRAD

BF16 = torch.bfloat16
OP = torch.ops.moe.expert_ffn.default


def cast_by_autograd(args):
    """The op's arguments as a block casting them itself would pass them: leaves kept, casts recorded."""
    return [a.to(BF16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def leaves(args):
    return [a for i, a in enumerate(args) if i in dialect.FFN_DIFFERENTIABLE and a is not None]


def run(fn, args, probe):
    y = fn(*args)
    return [y, *torch.autograd.grad((y * probe).sum(), leaves(args))]


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("D,F,engine", ENGINES)
def test_bit_for_bit_the_op_on_inputs_cast_by_autograd(activation, bias, recompute, D, F, engine, monkeypatch):
    use_engine(engine, monkeypatch)
    args = ffn_args(activation, D, F, bias)
    probe = torch.randn(args[0].shape[0], D, generator=torch.Generator().manual_seed(1))
    ours = run(lambda *a: OP(*a, recompute, BF16), args, probe)
    want = run(lambda *a: OP(*cast_by_autograd(a), recompute).float(), args, probe)
    assert all(t.dtype == torch.float32 for t in ours)  # y in x's dtype, each gradient in its input's
    for got, ref in zip(ours, want, strict=True):
        assert torch.equal(got, ref)
    fp32 = OP(*args)  # and the casts matter: fp32 compute is visibly elsewhere
    assert not torch.allclose(ours[0], fp32, rtol=1e-4, atol=1e-4)


def test_the_eager_path_and_no_grad_give_the_same():
    args = ffn_args("swiglu", 16, 32, True)
    probe = torch.randn(args[0].shape[0], 16, generator=torch.Generator().manual_seed(1))
    via_dispatcher = run(lambda *a: OP(*a, False, BF16), args, probe)
    via_eager = run(lambda *a: eager.EAGER[OP](*a, False, BF16), args, probe)
    for got, ref in zip(via_eager, via_dispatcher, strict=True):
        assert torch.equal(got, ref)
    with torch.no_grad():
        assert torch.equal(OP(*args, False, BF16), via_dispatcher[0])
        assert torch.equal(eager.EAGER[OP](*args, False, BF16), via_dispatcher[0])


def test_deferred_weight_gradients_arrive_cast_and_bit_for_bit():
    """Lancet: the weights' placeholders are fp32 and stride 0, the sinks hand over the fp32 gradients."""
    args = ffn_args("swiglu", 16, 32, True)
    probe = torch.randn(args[0].shape[0], 16, generator=torch.Generator().manual_seed(1))
    plain = run(lambda *a: OP(*a, False, BF16), args, probe)
    seen = {}

    def deferred(x, counts, *rest):
        operands = [DEFER_WGRAD(t) if isinstance(t, torch.Tensor) else t for t in rest[:6]]
        for i, t in enumerate(operands):
            if t is not None:
                t.register_hook(lambda g, i=i: seen.update({i: (g.dtype, g.stride() == (0,) * g.dim())}))
        return OP(x, counts, *operands, *rest[6:], False, BF16)

    got = run(deferred, args, probe)
    for a, b in zip(got, plain, strict=True):
        assert torch.equal(a, b)
    assert seen == {i: (torch.float32, True) for i, t in enumerate(args[2:8]) if t is not None}


def test_rebuilt_weights_are_rebuilt_in_the_compute_dtype():
    """FSEP's rebuildable operands: the backward rebuilds them and casts them as the forward did."""
    args = ffn_args("swiglu", 16, 32, False)
    probe = torch.randn(args[0].shape[0], 16, generator=torch.Generator().manual_seed(1))
    plain = run(lambda *a: OP(*a, False, BF16), args, probe)
    calls = []

    def rebuilt(x, counts, w_gate, *rest):
        view = w_gate * 1.0  # a non-leaf operand, as FSEP's restored experts are

        def rebuild():
            calls.append(1)
            return w_gate.detach() * 1.0
        return OP(x, counts, dialect.rebuildable(view, rebuild), *rest, False, BF16)

    got = run(rebuilt, args, probe)
    assert calls == [1]
    for a, b in zip(got, plain, strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# Model level: torchtitan's own experts, computing in bf16.
# ----------------------------------------------------------------------------------------------


def titan_block():
    pytest.importorskip("torchtitan")
    from samples import torchtitan_models as TT

    v = TT.VARIANTS["shared_experts"]
    return TT.moe_block(v, bf16_experts=True), v.dim


def close(got, want, kernels, what="", tol=1e-5):
    """As close as the same ops allow (`tol`), or as the Triton kernels' 16-bit contract (`lowering.numerics`:
    rtol 1e-2, atol 1e-2 of the reference's scale; they keep fp32 intermediates the block rounds to bf16)."""
    if kernels:
        rtol, atol = 1e-2, 1e-2 * float(want.abs().max())
    else:
        rtol = atol = tol
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_trains_as(block, model, dim, steps=2, kernels=False):
    """Outputs, the input gradient and every parameter gradient of `model` vs `block`, over AdamW steps."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (block, model)]
    eps = torch.finfo(BF16).eps
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, target = torch.randn(2, 6, dim, generator=g), torch.randn(2, 6, dim, generator=g)
        got = []
        for m, opt in zip((block, model), opts, strict=True):
            opt.zero_grad()
            xi = x.clone().requires_grad_()
            out = m(xi)
            (out * target).sum().backward()
            got.append((out.detach(), xi.grad, {n.removeprefix("_orig_mod."): p.grad for n, p in m.named_parameters()}))
        (ref_out, ref_dx, ref_grads), (out, dx, grads) = got
        # the same casts and bf16 GEMMs: outputs and parameter gradients as close as fp32 allows (fp32 experts
        # would be ~1e-2 off); the input gradient one bf16 unit (its two GEMMs summed in bf16, autograd: fp32)
        close(out, ref_out, kernels, "output")
        close(dx, ref_dx, kernels, "input gradient", tol=2 * eps)
        assert grads.keys() == ref_grads.keys()
        for n, ref in ref_grads.items():
            close(grads[n], ref, kernels, n)
        for opt in opts:
            opt.step()


def expert_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "expert_ffn" in str(n.target)]


def test_expert_recompute_keeps_the_compute_dtype():
    block, dim = titan_block()
    cm = moepass.compile(copy.deepcopy(block), moepass.Plan(expert_recompute=True))
    (ffn,) = expert_calls(cm.moepass_info.rewritten[""])
    assert ffn.args[11:] == (True, BF16)
    assert_trains_as(block, cm, dim)


def test_lowered_to_triton_in_bf16():
    block, dim = titan_block()
    cm = moepass.compile(copy.deepcopy(block), moepass.Plan(lowering="triton"))
    gm = cm.moepass_info.rewritten[""]
    (ffn,) = expert_calls(gm)
    stats = next(h["stats"] for h in gm.history if h["pass"] == "lower")
    assert ffn.target is torch.ops.moe_lowered.expert_ffn.default and ffn.args[11:] == (False, BF16), stats
    assert_trains_as(block, cm, dim, steps=1, kernels=True)


def test_torch_compile_backend():
    from moepass import backend

    block, dim = titan_block()
    compiled = torch.compile(copy.deepcopy(block), backend="moepass",
                             options={"plan": moepass.Plan(), "inner": "aot_eager"})
    assert_trains_as(block, compiled, dim)
    assert sum(r.rewritten for r in backend.reports()) == 1, [r.summary() for r in backend.reports()]


@pytest.mark.parametrize("kind,value", [("ffn", "float32"), ("ffn", "bf16"), ("generic", "bfloat16")])
def test_a_bad_compute_dtype_names_the_field_and_the_choices(kind, value):
    from dataclasses import replace

    from moepass.spec import ExpertsSpec, TensorSource

    experts = ExpertsSpec(num_experts=4, hidden_dim=8, ffn_dim=16, w_up=TensorSource.param("experts.w_up"),
                          compute_dtype=value)
    if kind == "generic":
        experts = replace(experts, kind="generic", template="experts.0", template_class="Expert",
                          tensors=(("w", TensorSource.stack([f"experts.{e}.w" for e in range(4)])),))
    with pytest.raises(moepass.PlanError, match=rf"^spec.experts.compute_dtype='{value}' is invalid: use None, or "
                                                r"for FFN experts \(kind='ffn'\) 'bfloat16' or 'float16'.$"):
        experts.validate("spec.experts")
