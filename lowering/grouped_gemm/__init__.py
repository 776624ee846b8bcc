"""Grouped-GEMM expert FFN: `moe.expert_ffn` lowered to generated Triton kernels, forward and backward.

Three kernels (gate_up_kernel, rows_kernel, wgrad_kernel), generated once per spec (activation,
gating, bias flags, dtype baked in as constants), run the forward in two launches and the backward
(which recomputes h_gate/h_up instead of keeping them) in five (four when not gated). Where each part lives:

    templates.py  the Triton source text: module skeleton, activations, the kernels, their tile schedule
    source.py     render(spec) -> the generated module with its GPU_BUILDS; kernel_module; gpu_build_requests
    configs.py    FfnSpec (what a module is specialised to), spec_of, block-size configs, pick_config, fits
    launch.py     one host wrapper per kernel; autotuned on a GPU, `pick_config` when interpreted
    host.py       validate, expert_ffn_forward / expert_ffn_backward, the fused gate/up adapters
    this file     eligibility, the `moe_lowered` custom ops (fakes, autograd, autocast), the `Lowering` record

Every name the rest of the repository uses (the lower pass, tests, benchmarks) is importable from here; the
block-size tables' helpers (`configs_for`, `fits`, `BlockConfig`, ...) from `lowering.grouped_gemm.configs`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lowering import Lowering, codegen
from lowering.grouped_gemm.configs import CONFIGS, ROLES, FfnSpec, pick_config, shared_bytes_estimate, spec_of
from lowering.grouped_gemm.host import expert_ffn_backward, expert_ffn_forward, fused_grads, unfused, validate
from lowering.grouped_gemm.launch import gate_up_launch, rows_launch, wgrad_launch
from lowering.grouped_gemm.source import PROXY_EXPERTS, gpu_build_requests, gpu_builds, kernel_module, render
from moepass import dialect, eager
from moepass.activations import ACTIVATIONS, GATED_ACTIVATIONS

generated_source_for = render  # its name before the family followed the `render` convention

__all__ = [
    "ACTIVATIONS", "CONFIGS", "GATED_ACTIVATIONS", "LOWERING", "MAX_EXPERTS", "PROXY_EXPERTS", "ROLES", "FfnSpec",
    "codegen", "eligible", "expert_ffn", "expert_ffn_backward", "expert_ffn_backward_op", "expert_ffn_forward",
    "expert_ffn_forward_op", "fused_grads", "gate_up_launch", "generated_source", "generated_source_for",
    "gpu_build_requests", "gpu_builds", "kernel_module", "kernel_operands", "pick_config", "render", "rows_launch",
    "shared_bytes_estimate", "spec_of", "unfused", "validate", "wgrad_launch",
]

MAX_EXPERTS = 8192  # the tile schedule loads counts_E as one block of next_pow2(E) per program


def eligible(
    x_ND: Tensor, counts_E: Tensor, w_gate_EFD: Tensor, w_up_EFD: Tensor | None, w_down_EDF: Tensor,
    b_gate_EF: Tensor | None, b_up_EF: Tensor | None, b_down_ED: Tensor | None, activation: str,
    clamp_limit: float, alpha: float, recompute: bool = False, compute_dtype: torch.dtype | None = None,
) -> str | None:
    """None if the Triton kernels can run these arguments (real or fake tensors), else why not."""
    (x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, activation, clamp_limit,
     alpha) = kernel_operands((x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED,
                               activation, clamp_limit, alpha), compute_dtype)
    blocker = codegen.launch_blocker(x_ND.device)
    if blocker is not None:
        return blocker
    try:
        validate(x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, activation)
    except ValueError as err:
        return str(err)
    if w_gate_EFD.shape[0] > MAX_EXPERTS:
        return f"grouped_gemm: E={w_gate_EFD.shape[0]} experts > {MAX_EXPERTS} (the tile schedule's block of counts)"
    return None


def generated_source(
    x_ND: Tensor, counts_E: Tensor, w_gate_EFD: Tensor, w_up_EFD: Tensor | None, w_down_EDF: Tensor,
    b_gate_EF: Tensor | None, b_up_EF: Tensor | None, b_down_ED: Tensor | None, activation: str,
    clamp_limit: float, alpha: float, recompute: bool = False, compute_dtype: torch.dtype | None = None,
) -> str:
    """The kernel source these arguments run (for `moepass.explain`)."""
    return render(spec_of(*kernel_operands((x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF,
                                            b_down_ED, activation, clamp_limit, alpha), compute_dtype)))


def kernel_operands(args: tuple, compute_dtype: torch.dtype | None) -> tuple:
    """The kernels' view of `moe.expert_ffn`'s first 11 arguments: in the call's compute dtype (the op casts
    its operands before the kernels run), fused gate/up as its halves (`unfused`)."""
    return unfused(dialect.in_compute_dtype(args, compute_dtype))


def _forward(*operands: Any) -> tuple[Tensor, Tensor, Tensor]:
    """y_ND with the Triton kernels; nothing kept for backward (its first kernel recomputes gate/up).
    `operands`: moe.expert_ffn_forward's (the FFN's operands, then `save`)."""
    args, x_ND = operands[:-1], operands[0]
    if eligible(*args) is None:
        return expert_ffn_forward(*unfused(args)), x_ND.new_empty(0), x_ND.new_empty(0)
    return eager.call(torch.ops.moe.expert_ffn_forward.default, *operands)  # the torch fallback


def _forward_fake(*operands: Any) -> tuple[Tensor, Tensor, Tensor]:
    args, save = operands[:-1], operands[-1]
    x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, *_, activation = args[:9]
    dialect.check_ffn_shapes(x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, activation)
    keep = save and eligible(*args) is not None  # only the torch fallback keeps pre-activations
    return (x_ND.new_empty(x_ND.shape[0], w_down_EDF.shape[1]),
            *dialect.saved_activations(x_ND, w_gate_EFD, w_up_EFD is not None, keep))


def _backward(grad_y_ND: Tensor, x_ND: Tensor, h_gate_NF: Tensor, h_up_NF: Tensor, *rest: Any) -> list[Tensor]:
    """Backward of `moe_lowered::expert_ffn`; absent optional inputs get an empty tensor in their slot.
    `rest`: counts_E, the weights, biases and options (moe.expert_ffn_backward's operands)."""
    args = (x_ND, *rest)
    if eligible(*args) is None:
        grads = fused_grads(expert_ffn_backward(grad_y_ND, *unfused(args)), args)
        return [x_ND.new_empty(0) if g is None else g for g in grads]
    return eager.call(torch.ops.moe.expert_ffn_backward.default, grad_y_ND, x_ND, h_gate_NF, h_up_NF,  # torch fallback
                      *rest)


def _backward_fake(grad_y_ND, x_ND, h_gate_NF, h_up_NF, counts_E, *weights_and_options):
    # the kernels write contiguous gradients; the torch fallback writes them as the dialect's op does
    contiguous = eligible(x_ND, counts_E, *weights_and_options) is None
    return dialect.ffn_gradient_fakes(x_ND, *weights_and_options[:6], contiguous=contiguous)


# the dialect's declarations (operands, autocast), with this family's fakes: the kernels keep nothing
expert_ffn_forward_op = dialect.EXPERT_FFN_FORWARD_SCHEMA.define("moe_lowered", _forward, fake=_forward_fake)
expert_ffn_backward_op = dialect.EXPERT_FFN_BACKWARD_SCHEMA.define("moe_lowered", _backward, fake=_backward_fake)


expert_ffn = dialect.define_expert_ffn("moe_lowered::expert_ffn", torch.ops.moe_lowered.expert_ffn_forward,
                                       torch.ops.moe_lowered.expert_ffn_backward)

LOWERING = Lowering(
    family="grouped_gemm",
    dialect_op=torch.ops.moe.expert_ffn.default,
    lowered_op=torch.ops.moe_lowered.expert_ffn.default,
    eligible=eligible,
    source=generated_source,
)
