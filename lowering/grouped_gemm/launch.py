"""Launching the grouped-GEMM kernels: one host wrapper per kernel (allocate outputs, lay out the
arguments, size the grid), each launch autotuned on a GPU or run with `pick_config`'s config when interpreted or deterministic,
through `lowering.launcher` (Triton's launch path once per launch signature, the compiled kernel's own after).

Shape letters: `moepass.spec.SHAPES` (p, q: a grouped GEMM's reduction and output widths; rows_kernel's
arguments K and Q are p and q, a weight gradient's P and Q its two sides). Tensors must be row-major
except the weights, whose strides the kernels take.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton
from torch import Tensor

from lowering import codegen
from lowering.grouped_gemm.configs import (
    ROLES,
    BlockConfig,
    FfnSpec,
    configs_for,
    fits,
    kernel_name,
    pick_config,
    rows_bucket,
)
from lowering.grouped_gemm.source import kernel_module
from lowering.launcher import launcher

_TUNING_KEYS = {
    "gate_up_kernel": ("D", "F", "rows_bucket"),
    "gate_up_kernel.backward": ("D", "F", "rows_bucket"),
    "rows_kernel": ("K", "Q", "rows_bucket", "TWO"),
    "wgrad_kernel": ("P", "Q", "rows_bucket"),
}
Grid = Callable[[dict[str, Any]], tuple[int, ...]]  # launch meta-parameters -> grid


@functools.cache
def _kernels(spec: FfnSpec) -> dict[str, Any]:
    """Launchable kernels by role: the jit functions with fixed configs (interpreted, or deterministic),
    autotuners over CONFIGS otherwise."""
    module = kernel_module(spec)
    by_role = {role: getattr(module, kernel_name(role)) for role in ROLES}
    if spec.fixed_configs:
        return by_role
    return {role: triton.autotune(
        configs=[triton.Config(c.kwargs(kernel_name(role)), num_warps=c.num_warps, num_stages=c.num_stages)
                 for c in configs_for(role, spec.dtype)],
        key=list(_TUNING_KEYS[role]),
        prune_configs_by={"early_config_prune": _pruner(role, spec.torch_dtype.itemsize, spec.gated)},
    )(fn) for role, fn in by_role.items()}


def _pruner(role: str, elem_bytes: int, gated: bool):
    """Autotune pruning: drop configs whose pipelined operand tiles exceed the device's shared memory."""

    def prune(configs, named_args, **kwargs):
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        limit = getattr(props, "shared_memory_per_block_optin", None) or codegen.shared_limit_bytes(
            10 * props.major + props.minor)
        keep = [c for c in configs
                if fits(role, BlockConfig.of(role, c.kwargs, c.num_warps, c.num_stages), elem_bytes, limit, gated)]
        return keep or configs[-1:]

    return prune


def _launch(spec: FfnSpec, role: str, grid: Grid, args: tuple, constexprs: dict[str, Any],
            shape: tuple[int, int, int]) -> None:
    """Launch `role` with `grid(meta)`; with fixed configs, the config `pick_config` gives for `shape`."""
    launch = launcher(_kernels(spec)[role])
    if spec.fixed_configs:
        cfg = pick_config(role, spec.dtype, *shape)
        meta = cfg.kwargs(kernel_name(role))
        launch[grid(meta)](*args, **constexprs, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        launch[grid](*args, **constexprs)


def _row_grid(N: int, E: int, n_cols: int) -> Grid:
    """Row tiles (host-known bound: every expert may end with one partial tile) x column tiles."""
    return lambda meta: (codegen.cdiv(N, meta["BLOCK_M"]) + E, codegen.cdiv(n_cols, meta["BLOCK_N"]))


def _strides_Epq(w: Tensor, transpose: bool) -> tuple[int, int, int]:
    """Strides of a 3-D expert weight read as [E, K, Q]; `transpose` reads [E, A, B] as [E, B, A]."""
    return (w.stride(0), w.stride(2), w.stride(1)) if transpose else (w.stride(0), w.stride(1), w.stride(2))


def rows_launch(spec, out_Nq, a1_Np, b1, a2_Np, b2, bias_Eq, counts_E, transpose_b: bool) -> None:
    """out = a1 @ b1[e] (+ a2 @ b2[e]) (+ bias[e]) over expert-sorted rows; b read as [E, K, Q]."""
    N, K = a1_Np.shape
    Q, E = out_Nq.shape[1], counts_E.shape[0]
    two = a2_Np is not None
    args = (a1_Np, b1, *_strides_Epq(b1, transpose_b), a2_Np if two else a1_Np, b2 if two else b1,
            *_strides_Epq(b2 if two else b1, transpose_b), a1_Np if bias_Eq is None else bias_Eq, out_Nq, counts_E,
            K, Q, E, rows_bucket(N, E))
    _launch(spec, "rows_kernel", _row_grid(N, E, Q), args,
            dict(TWO=two, HAS_BIAS=bias_Eq is not None, E_POW2=codegen.next_pow2(E)),
            (codegen.cdiv(N, E), Q, K))


def wgrad_launch(spec, a_Np: Tensor, b_Nq: Tensor, counts_E: Tensor, with_bias: bool) -> tuple[Tensor, Tensor | None]:
    """grad_w_Epq[e] = a[rows_e]^T @ b[rows_e], and the bias gradient (column sums of a[rows_e])."""
    N, P = a_Np.shape
    Q, E = b_Nq.shape[1], counts_E.shape[0]
    out_Epq = a_Np.new_empty(E, P, Q)
    bias_Ep = a_Np.new_empty(E, P) if with_bias else None
    grid = lambda meta: (E, codegen.cdiv(P, meta["BLOCK_P"]), codegen.cdiv(Q, meta["BLOCK_Q"]))
    args = (a_Np, b_Nq, out_Epq, out_Epq if bias_Ep is None else bias_Ep, counts_E, P, Q, E, rows_bucket(N, E))
    _launch(spec, "wgrad_kernel", grid, args, dict(HAS_BIAS=with_bias, E_POW2=codegen.next_pow2(E)),
            (codegen.cdiv(N, E), P, Q))
    return out_Epq, bias_Ep


def gate_up_launch(spec, x_ND, grad_y_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF,
                    clamp_limit, alpha) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """a_NF (and with grad_y_ND: grad_gate_NF, grad_up_NF)."""
    N, D = x_ND.shape
    E, F, _ = w_gate_EFD.shape
    backward = grad_y_ND is not None
    a_NF = x_ND.new_empty(N, F)
    grad_gate_NF = x_ND.new_empty(N, F) if backward else None
    grad_up_NF = x_ND.new_empty(N, F) if backward and spec.gated else None
    if N == 0:
        return a_NF, grad_gate_NF, grad_up_NF
    w_up = w_gate_EFD if w_up_EFD is None else w_up_EFD
    args = (x_ND, x_ND if grad_y_ND is None else grad_y_ND, counts_E,
            w_gate_EFD, *w_gate_EFD.stride(), w_up, *w_up.stride(), w_down_EDF, *w_down_EDF.stride(),
            x_ND if b_gate_EF is None else b_gate_EF, x_ND if b_up_EF is None else b_up_EF,
            a_NF, a_NF if grad_gate_NF is None else grad_gate_NF, a_NF if grad_up_NF is None else grad_up_NF,
            D, F, E, float(clamp_limit), float(alpha), rows_bucket(N, E))
    role = "gate_up_kernel.backward" if backward else "gate_up_kernel"
    _launch(spec, role, _row_grid(N, E, F), args, dict(BACKWARD=backward, E_POW2=codegen.next_pow2(E)),
            (codegen.cdiv(N, E), F, D))
    return a_NF, grad_gate_NF, grad_up_NF
