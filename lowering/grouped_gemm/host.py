"""The expert FFN on the host: validate the arguments, then forward / backward as a few kernel launches;
and the fused gate/up adapters between `moe.expert_ffn`'s argument layout and the kernels'.

Backward recomputes: the Triton forward keeps only its inputs (`dialect.define_expert_ffn` would let it
hand h_gate/h_up over, as the torch path does; these kernels do not write them). The backward's first
kernel recomputes h_gate/h_up in registers while computing grad_a over the same reduction dimension D,
which costs one extra gate/up GEMM (4NDF of the backward's 16NDF FLOPs, gated) and saves keeping
2 x N x F pre-activations alive between forward and backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowering.grouped_gemm.configs import DTYPES, spec_of
from lowering.grouped_gemm.launch import gate_up_launch, rows_launch, wgrad_launch
from moepass import dialect, grouped_ffn
from moepass.activations import ACTIVATIONS, GATED_ACTIVATIONS


def validate(
    x_ND: Tensor, counts_E: Tensor, w_gate_EFD: Tensor, w_up_EFD: Tensor | None, w_down_EDF: Tensor,
    b_gate_EF: Tensor | None, b_up_EF: Tensor | None, b_down_ED: Tensor | None, activation: str,
) -> None:
    """Raise ValueError naming the dimension / dtype / device that does not fit the kernels."""
    dialect.check_ffn_shapes(x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, activation)
    E, F, D = w_gate_EFD.shape
    for name, b, want in (("b_gate_EF", b_gate_EF, (E, F)), ("b_up_EF", b_up_EF, (E, F)), ("b_down_ED", b_down_ED, (E, D))):
        if b is not None and tuple(b.shape) != want:
            raise ValueError(f"grouped_gemm: {name} has shape {tuple(b.shape)}, expected {want} (E={E}, F={F}, D={D})")
    if b_up_EF is not None and w_up_EFD is None:
        raise ValueError("grouped_gemm: b_up_EF given without w_up_EFD")
    if activation not in ACTIVATIONS:
        raise ValueError(f"grouped_gemm: unknown activation {activation!r}; known: {ACTIVATIONS}")
    if (activation in GATED_ACTIVATIONS) != (w_up_EFD is not None):
        raise ValueError(f"grouped_gemm: activation {activation!r} {'needs' if activation in GATED_ACTIVATIONS else 'takes no'} w_up_EFD")
    floats = {"x_ND": x_ND, "w_gate_EFD": w_gate_EFD, "w_up_EFD": w_up_EFD, "w_down_EDF": w_down_EDF,
              "b_gate_EF": b_gate_EF, "b_up_EF": b_up_EF, "b_down_ED": b_down_ED}
    for name, t in floats.items():
        if t is None:
            continue
        if t.dtype != x_ND.dtype:
            raise ValueError(f"grouped_gemm: {name} is {t.dtype} but x_ND is {x_ND.dtype}; all must share one "
                             "dtype (autocast casts them to the compute dtype)")
        if t.device != x_ND.device:
            raise ValueError(f"grouped_gemm: {name} is on {t.device} but x_ND on {x_ND.device}")
    if x_ND.dtype not in DTYPES:
        raise ValueError(f"grouped_gemm: dtype {x_ND.dtype} not supported; use one of {list(DTYPES.values())}")
    if counts_E.dtype not in (torch.int32, torch.int64) or counts_E.device != x_ND.device:
        raise ValueError(f"grouped_gemm: counts_E must be int32/int64 on {x_ND.device}, got {counts_E.dtype} "
                         f"on {counts_E.device}")


def _contiguous(*tensors: Tensor | None) -> list[Tensor | None]:
    """Optional tensors row-major (cheap, usually no-ops). Activations, biases and counts are made
    row-major; weights keep their strides."""
    return [None if t is None else t.contiguous() for t in tensors]


def expert_ffn_forward(
    x_ND: Tensor, counts_E: Tensor, w_gate_EFD: Tensor, w_up_EFD: Tensor | None, w_down_EDF: Tensor,
    b_gate_EF: Tensor | None, b_up_EF: Tensor | None, b_down_ED: Tensor | None, activation: str,
    clamp_limit: float, alpha: float,
) -> Tensor:
    """y_ND = down(act(gate(x), up(x))) per expert, with the Triton kernels (no fallback here)."""
    validate(x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, activation)
    spec = spec_of(x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, activation,
                   clamp_limit, alpha)
    x_ND, counts_E = x_ND.contiguous(), counts_E.contiguous()
    b_gate_EF, b_up_EF, b_down_ED = _contiguous(b_gate_EF, b_up_EF, b_down_ED)
    a_NF, _, _ = gate_up_launch(spec, x_ND, None, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF,
                                 clamp_limit, alpha)
    y_ND = x_ND.new_empty(x_ND.shape[0], w_down_EDF.shape[1])
    if x_ND.shape[0]:
        rows_launch(spec, y_ND, a_NF, w_down_EDF, None, None, b_down_ED, counts_E, transpose_b=True)
    return y_ND


def expert_ffn_backward(
    grad_y_ND: Tensor, x_ND: Tensor, counts_E: Tensor, w_gate_EFD: Tensor, w_up_EFD: Tensor | None,
    w_down_EDF: Tensor, b_gate_EF: Tensor | None, b_up_EF: Tensor | None, b_down_ED: Tensor | None,
    activation: str, clamp_limit: float, alpha: float,
) -> list[Tensor | None]:
    """Gradients for (x, w_gate, w_up, w_down, b_gate, b_up, b_down), None for absent inputs.

    Recomputes h_gate/h_up (see the module docstring), then: grad_x from one rows_kernel over both
    projections, and three wgrad launches (two when not gated).
    """
    validate(x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, activation)
    if grad_y_ND.shape != (x_ND.shape[0], w_down_EDF.shape[1]) or grad_y_ND.dtype != x_ND.dtype:
        raise ValueError(f"grouped_gemm: grad_y_ND is {tuple(grad_y_ND.shape)} {grad_y_ND.dtype}, expected "
                         f"(N={x_ND.shape[0]}, D={w_down_EDF.shape[1]}) {x_ND.dtype}")
    spec = spec_of(x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, activation,
                   clamp_limit, alpha)
    grad_y_ND, x_ND, counts_E = grad_y_ND.contiguous(), x_ND.contiguous(), counts_E.contiguous()
    b_gate_EF, b_up_EF = _contiguous(b_gate_EF, b_up_EF)
    a_NF, grad_gate_NF, grad_up_NF = gate_up_launch(spec, x_ND, grad_y_ND, counts_E, w_gate_EFD, w_up_EFD,
                                                     w_down_EDF, b_gate_EF, b_up_EF, clamp_limit, alpha)
    assert grad_gate_NF is not None  # written by every backward gate_up launch
    grad_x_ND = torch.empty_like(x_ND)
    if x_ND.shape[0]:
        rows_launch(spec, grad_x_ND, grad_gate_NF, w_gate_EFD, grad_up_NF, w_up_EFD, None, counts_E,
                     transpose_b=False)
    grad_w_gate, grad_b_gate = wgrad_launch(spec, grad_gate_NF, x_ND, counts_E, b_gate_EF is not None)
    grad_w_up, grad_b_up = (None, None) if grad_up_NF is None else wgrad_launch(spec, grad_up_NF, x_ND, counts_E,
                                                                                 b_up_EF is not None)
    grad_w_down, grad_b_down = wgrad_launch(spec, grad_y_ND, a_NF, counts_E, b_down_ED is not None)
    return [grad_x_ND, grad_w_gate, grad_w_up, grad_w_down, grad_b_gate, grad_b_up, grad_b_down]


def unfused(args: tuple) -> tuple:
    """The kernels' view of `moe.expert_ffn` arguments: fused gate/up (`w_gate` [E, 2F, D], no `w_up`)
    as its two halves, strided views (the kernels take weight strides), biases likewise."""
    x_ND, counts_E, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, clamp_limit, alpha = args
    if not grouped_ffn.fused_gate_up(w_up, activation):
        return args
    F = w_gate.shape[1] // 2
    if b_gate is not None:
        b_gate, b_up = b_gate[:, :F], b_gate[:, F:]
    return (x_ND, counts_E, w_gate[:, :F], w_gate[:, F:], w_down, b_gate, b_up, b_down, activation, clamp_limit, alpha)


def fused_grads(grads: list, args: tuple) -> list:
    """Gradients of the kernels (gate and up apart) in the layout of `args` (fused: one [E, 2F, D])."""
    if not grouped_ffn.fused_gate_up(args[3], args[8]):
        return grads
    gx, gwg, gwu, gwd, gbg, gbu, gbd = grads
    return [gx, torch.cat([gwg, gwu], 1), None, gwd, None if gbg is None else torch.cat([gbg, gbu], 1), None, gbd]
