"""Interpreted grouped-GEMM expert FFN kernels vs the dialect's torch reference (TRITON_INTERPRET=1).

Shapes: N routed rows sorted by expert, D model width, F expert hidden width, E experts.
Every case runs `moe_lowered::expert_ffn` forward and its autograd backward (the Triton backward op)
and compares output, grad_x, every weight and bias gradient with `expert_ffn_ref` under autograd:
fp32 within 1e-5; fp16/bf16 within 1e-2 of the tensor's scale against the fp32 reference computed
from the same (rounded) inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import lowering
from moepass import dialect

gg = pytest.importorskip("lowering.grouped_gemm")


@dataclass(frozen=True)
class Case:
    activation: str
    counts: tuple[int, ...]  # rows per expert: 0, 1, ragged
    D: int
    F: int  # 40, 80: not multiples of the 64-wide column block
    dtype: torch.dtype
    bias: bool
    fused_gate_up: bool = False  # w_gate/w_up as strided views of one [E, 2F, D] tensor, w_down stored transposed

    @property
    def id(self) -> str:
        dt = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype]
        layout = "-fused" if self.fused_gate_up else ""
        return f"{self.activation}-{dt}-{'bias' if self.bias else 'nobias'}-E{len(self.counts)}-D{self.D}F{self.F}{layout}"


_RAGGED = (0, 1, 7, 3)
CASES = [
    *(Case(a, _RAGGED, 24, 40, torch.float32, True) for a in gg.ACTIVATIONS),
    *(Case(a, (5, 0, 20, 9), 32, 80, torch.bfloat16, False) for a in gg.ACTIVATIONS),
    *(Case(a, (1, 1, 1, 1, 0, 2), 48, 24, torch.float16, True) for a in gg.ACTIVATIONS),
    Case("swiglu", (33, 2), 64, 64, torch.float32, False),  # more rows than one tile of an expert
    Case("swiglu", (0, 0, 13, 0), 16, 40, torch.bfloat16, True),  # all rows in one expert
    Case("gelu", (0, 0, 0), 16, 24, torch.float32, True),  # no rows at all: zero weight gradients
    Case("geglu", (3, 9, 4), 24, 40, torch.float32, True, fused_gate_up=True),
    Case("clamped_swiglu", (6, 0, 11), 32, 48, torch.bfloat16, True, fused_gate_up=True),
    Case("relu", (17,), 32, 64, torch.float16, False),  # one expert: the dense MLP
]


def make_args(case: Case, scale_limit: float = 1.5) -> tuple:
    E, D, F_, dt = len(case.counts), case.D, case.F, case.dtype
    gated = case.activation in gg.GATED_ACTIVATIONS
    x_ND = torch.randn(sum(case.counts), D).to(dt)
    counts_E = torch.tensor(case.counts, dtype=torch.int64)
    if case.fused_gate_up:
        gate_up_E2FD = (torch.randn(E, 2 * F_, D) / D**0.5).to(dt)
        w_gate_EFD, w_up_EFD = gate_up_E2FD[:, :F_], gate_up_E2FD[:, F_:]
        w_down_EDF = (torch.randn(E, F_, D) / F_**0.5).to(dt).transpose(1, 2)
    else:
        w_gate_EFD = (torch.randn(E, F_, D) / D**0.5).to(dt)
        w_up_EFD = (torch.randn(E, F_, D) / D**0.5).to(dt) if gated else None
        w_down_EDF = (torch.randn(E, D, F_) / F_**0.5).to(dt)
    if not gated:
        w_up_EFD = None
    b_gate_EF = torch.randn(E, F_).to(dt) if case.bias else None
    b_up_EF = torch.randn(E, F_).to(dt) if case.bias and gated else None
    b_down_ED = torch.randn(E, D).to(dt) if case.bias else None
    return (x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, case.activation,
            scale_limit, 1.702)


def _leaves(args: tuple, dtype: torch.dtype | None = None) -> tuple:
    """Copies of the floating tensors as autograd leaves (optionally cast)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            a = a.detach().to(dtype or a.dtype).requires_grad_(True)
        out.append(a)
    return tuple(out)


def _run(fn, args: tuple, grad_y: torch.Tensor) -> list[torch.Tensor | None]:
    """[y, grad x, grad w_gate, grad w_up, grad w_down, grad b_gate, grad b_up, grad b_down]."""
    y = fn(*args)
    inputs = [args[i] for i in dialect.FFN_DIFFERENTIABLE]
    present = [t for t in inputs if t is not None]
    grads = iter(torch.autograd.grad(y, present, grad_y.to(y.dtype), allow_unused=True))
    return [y.detach()] + [None if t is None else next(grads) for t in inputs]


NAMES = ["y", "grad_x", "grad_w_gate", "grad_w_up", "grad_w_down", "grad_b_gate", "grad_b_up", "grad_b_down"]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_forward_and_gradients_match_reference(case: Case):
    args = make_args(case)
    assert gg.eligible(*args) is None  # the Triton path runs, not the torch fallback
    N, D = args[0].shape[0], case.D
    grad_y = torch.randn(N, D)
    got = _run(torch.ops.moe_lowered.expert_ffn, _leaves(args), grad_y)
    want = _run(dialect.expert_ffn_ref, _leaves(args, torch.float32), grad_y)
    for name, g, w in zip(NAMES, got, want):
        assert (g is None) == (w is None), name
        if g is None:
            continue
        assert g.dtype == case.dtype and g.shape == w.shape, name
        if case.dtype == torch.float32:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        else:
            scale = max(w.abs().max().item(), 1e-6) if w.numel() else 1.0
            torch.testing.assert_close(g.float(), w, rtol=1e-2, atol=1e-2 * scale,
                                       msg=lambda m, name=name: f"{name}: {m}")


def test_no_rows_gives_zero_weight_gradients():
    case = Case("swiglu", (0, 0), 16, 24, torch.float32, True)
    got = _run(torch.ops.moe_lowered.expert_ffn, _leaves(make_args(case)), torch.randn(0, 16))
    assert got[0].shape == (0, 16)
    for name, g in zip(NAMES[2:], got[2:]):
        assert g is not None and not g.any(), name


def test_opcheck():
    args = make_args(Case("swiglu", (2, 0, 3), 16, 24, torch.float32, True))
    torch.library.opcheck(torch.ops.moe_lowered.expert_ffn.default, args)


def test_autocast_runs_in_compute_dtype():
    args = make_args(Case("gelu_tanh", (3, 4), 16, 24, torch.float32, False))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.ops.moe_lowered.expert_ffn(*args)
    assert y.dtype == torch.bfloat16
    want = dialect.expert_ffn_ref(*[a.bfloat16() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                    for a in args])
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_eligibility_on_fake_tensors_and_declines_with_reasons(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = make_args(Case("swiglu", (2, 3), 16, 24, torch.float32, True))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        assert gg.eligible(*fake) is None
        assert "GATED = tl.constexpr(True)" in gg.generated_source(*fake)
    mixed = (args[0].double(),) + args[1:]
    assert "dtype" in gg.eligible(*mixed)
    assert "activation" in gg.eligible(*args[:8], "swish", 1.0, 1.0)
    monkeypatch.setattr(gg.codegen, "is_interpreted", lambda: False)
    reason = gg.eligible(*args)
    assert reason is not None and "CPU" in reason
    # Declined: the op falls back to the dialect reference instead of launching.
    torch.testing.assert_close(torch.ops.moe_lowered.expert_ffn(*args), dialect.expert_ffn_ref(*args))


def test_validation_names_the_dimension():
    args = list(make_args(Case("swiglu", (2, 3), 16, 24, torch.float32, True)))
    args[5] = torch.zeros(2, 23)
    with pytest.raises(ValueError, match=r"b_gate_EF .* expected \(2, 24\) \(E=2, F=24, D=16\)"):
        gg.expert_ffn_forward(*args)


def test_generated_source_is_specialised():
    args = make_args(Case("clamped_swiglu", (1, 2), 16, 24, torch.bfloat16, False))
    source = gg.generated_source(*args)
    assert "GATED = tl.constexpr(True)" in source and "HAS_B_DOWN = tl.constexpr(False)" in source
    assert "STORE_DTYPE = tl.constexpr(tl.bfloat16)" in source and "GPT-OSS" in source
    assert "def gate_up_kernel(" in source and "def wgrad_kernel(" in source
    assert source != gg.generated_source(*make_args(Case("relu", (1, 2), 16, 24, torch.bfloat16, False)))


def test_registered_with_the_lowering_registry():
    (entry,) = [r for r in lowering.registry() if r.family == "grouped_gemm"]
    assert entry.dialect_op is torch.ops.moe.expert_ffn.default
    assert entry.lowered_op is torch.ops.moe_lowered.expert_ffn.default
    signature = lambda op: [(a.name, str(a.type)) for a in op._schema.arguments]
    assert signature(entry.lowered_op) == signature(entry.dialect_op)


def test_block_configs_shrink_to_small_shapes():
    cfg = gg.pick_config("gate_up_kernel", "bfloat16", rows_per_expert=3, n_cols=40, n_reduce=24)
    assert (cfg.block_m, cfg.block_n, cfg.block_k) == (16, 64, 32)
    big = gg.pick_config("gate_up_kernel", "bfloat16", rows_per_expert=1000, n_cols=14336, n_reduce=4096)
    assert big == gg.CONFIGS["gate_up_kernel"][0]
