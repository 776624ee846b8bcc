"""Grouped-GEMM expert FFN: `moe.expert_ffn` lowered to generated Triton kernels, forward and backward.

Shapes (suffixes on every tensor name):
    N  routed rows, sorted by expert (rows [offset_e, offset_e + counts_E[e]) belong to expert e)
    D  model width            F  expert hidden width          E  experts
    P, Q  the two sides of a weight gradient (F x D or D x F); K, Q reduction and output of rows_kernel

Kernels (one generated module per spec: activation, gating, bias flags, dtype baked in as constants):
    gate_up_kernel   a_NF = act(x_ND @ w_gate[e]^T + b_gate[e], x_ND @ w_up[e]^T + b_up[e]) for each
                     row tile; with BACKWARD it also computes grad_a = grad_y_ND @ w_down[e] in the same
                     loop over D and writes grad_gate_NF, grad_up_NF (the activation's backward) and a_NF.
    rows_kernel      out_NQ = a1_NK @ b1[e] (+ a2_NK @ b2[e]) (+ bias[e]): the down projection
                     (y = a @ w_down[e]^T + b_down[e]) and the input gradient
                     (grad_x = grad_gate @ w_gate[e] + grad_up @ w_up[e]).
    wgrad_kernel     out_EPQ[e] = a_NP[rows_e]^T @ b_NQ[rows_e] (+ bias_EP[e] = column sums of a_NP[rows_e]):
                     grad_w_gate, grad_w_up (a = grad_gate/up, b = x) and grad_w_down (a = grad_y, b = a_NF).

Tile schedule: row tiles are laid out expert after expert, cdiv(counts_E[e], BLOCK_M) tiles each. Each
program finds its expert on device from counts_E (a cumsum over E inside the kernel, as MegaBlocks'
and the Triton grouped-GEMM tutorial's schedules do): no host sync and no per-expert launch. The grid
is sized by the host-known bound cdiv(N, BLOCK_M) + E; programs past the last tile exit at once.
Precondition (what `moe.permute` produces): sum(counts_E) == N.

Backward recomputes: the Triton forward keeps only its inputs (`dialect.define_expert_ffn` would let it
hand h_gate/h_up over, as the torch path does; these kernels do not write them). The backward's first kernel recomputes
h_gate/h_up in registers while computing grad_a over the same reduction dimension D, which costs one
extra gate/up GEMM (4NDF of the backward's 16NDF FLOPs, gated) and saves keeping 2 x N x F
pre-activations alive between forward and backward.

Precision: tl.dot accumulates in fp32; activations are computed in fp32; stored intermediates (a_NF,
grad_gate_NF, grad_up_NF) are in the compute dtype, as in the torch reference. fp32 GEMMs use IEEE
products unless torch allows TF32 (`torch.backends.cuda.matmul.allow_tf32`). Interpreted
(TRITON_INTERPRET=1), fp16/bf16 tiles are upcast to fp32 before tl.dot (the interpreter's bf16 dot
is wrong, triton-lang/triton#11584), and bf16 stores round to nearest even by hand
(`codegen.round_bf16`: the interpreter's fp32 -> bf16 cast truncates, doubling the error).

Block sizes: on a GPU every kernel is `@triton.autotune`d over its config list (keyed on the
dimensions and a power-of-two bucket of rows per expert; configs over the device's shared memory are
pruned); interpreted, one config is picked per shape from the same list (`pick_config`). 16-bit and
fp32 have separate lists (`configs_for`), each checked to build for sm_80/sm_90 without spills.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
from torch import Tensor

import lowering
from lowering import codegen
from moepass import dialect, grouped_ffn
from moepass.activations import ACTIVATIONS, GATED_ACTIVATIONS

# ----------------------------------------------------------------------------------------------
# The spec a generated module is specialised to.
# ----------------------------------------------------------------------------------------------

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class FfnSpec:
    activation: str
    gated: bool  # an up projection multiplies the activation
    has_b_gate: bool
    has_b_up: bool
    has_b_down: bool
    dtype: str  # "float32" | "float16" | "bfloat16": every floating input and output
    interpreted: bool  # TRITON_INTERPRET: dot operands upcast to fp32, no autotune
    tf32: bool  # fp32 GEMMs may use TF32 (follows torch.backends.cuda.matmul.allow_tf32)

    @property
    def dot_dtype(self) -> str:
        return "float32" if self.interpreted else self.dtype

    @property
    def label(self) -> str:
        biases = "+".join(n for n, b in (("gate", self.has_b_gate), ("up", self.has_b_up), ("down", self.has_b_down)) if b)
        return (f"activation={self.activation} gated={self.gated} biases={biases or 'none'} dtype={self.dtype} "
                f"{'interpreted' if self.interpreted else 'gpu'}")


def spec_of(
    x_ND: Tensor, counts_E: Tensor, w_gate_EFD: Tensor, w_up_EFD: Tensor | None, w_down_EDF: Tensor,
    b_gate_EF: Tensor | None, b_up_EF: Tensor | None, b_down_ED: Tensor | None, activation: str,
    clamp_limit: float, alpha: float, *, interpreted: bool | None = None,
) -> FfnSpec:
    """The specialisation of these `moe.expert_ffn` arguments (works on fake tensors)."""
    return FfnSpec(
        activation=activation,
        gated=w_up_EFD is not None,
        has_b_gate=b_gate_EF is not None,
        has_b_up=b_up_EF is not None,
        has_b_down=b_down_ED is not None,
        dtype=DTYPES.get(x_ND.dtype, str(x_ND.dtype)),
        interpreted=codegen.is_interpreted() if interpreted is None else interpreted,
        tf32=bool(torch.backends.cuda.matmul.allow_tf32),
    )


# ----------------------------------------------------------------------------------------------
# Block-size configs. One list per kernel; autotuned on a GPU, `pick_config` when interpreted.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockConfig:
    block_m: int  # rows per tile (wgrad: rows per reduction step)
    block_n: int  # output columns per tile (wgrad: P)
    block_k: int  # reduction per step (wgrad: Q)
    num_warps: int = 4
    num_stages: int = 3

    def kwargs(self, kernel: str) -> dict[str, int]:
        if kernel == "wgrad_kernel":
            return {"BLOCK_M": self.block_m, "BLOCK_P": self.block_n, "BLOCK_Q": self.block_k}
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k}


# Checked by tests/test_lowering_gpu_build_gemm.py: every config builds for sm_80 and sm_90 without
# register spills, within shared memory (autotune drops configs over the device's limit: `fits`).
# Accumulator registers bound the tiles: gate_up holds 2 (forward) or 3 (backward) fp32 tiles.
CONFIGS: dict[str, tuple[BlockConfig, ...]] = {  # 16-bit operands (tensor cores)
    "gate_up_kernel": (
        BlockConfig(128, 64, 64, 8, 3),
        BlockConfig(64, 128, 64, 8, 3),
        BlockConfig(64, 64, 64, 4, 3),
        BlockConfig(32, 64, 32, 4, 3),
        BlockConfig(16, 64, 64, 4, 3),
    ),
    "gate_up_kernel.backward": (
        BlockConfig(64, 128, 32, 8, 3),
        BlockConfig(128, 64, 32, 8, 3),
        BlockConfig(64, 64, 32, 8, 3),
        BlockConfig(32, 64, 64, 4, 3),
        BlockConfig(16, 64, 64, 4, 3),
    ),
    "rows_kernel": (
        BlockConfig(128, 128, 64, 8, 3),
        BlockConfig(64, 128, 64, 4, 3),
        BlockConfig(128, 64, 64, 4, 3),
        BlockConfig(64, 64, 64, 4, 3),
        BlockConfig(32, 64, 64, 4, 3),
        BlockConfig(16, 64, 64, 4, 3),
    ),
    "wgrad_kernel": (  # block_m = rows per step of the reduction, block_n = P, block_k = Q
        BlockConfig(64, 128, 128, 8, 3),
        BlockConfig(64, 128, 64, 4, 3),
        BlockConfig(32, 64, 64, 4, 3),
        BlockConfig(16, 64, 64, 4, 3),
    ),
}
CONFIGS_FP32: dict[str, tuple[BlockConfig, ...]] = {  # fp32 operands: smaller tiles, BLOCK_K 32
    "gate_up_kernel": (BlockConfig(64, 64, 32, 8, 3), BlockConfig(32, 64, 32, 4, 3), BlockConfig(32, 32, 32, 4, 3),
                       BlockConfig(16, 32, 32, 4, 3)),
    "gate_up_kernel.backward": (BlockConfig(64, 64, 32, 8, 3), BlockConfig(64, 32, 32, 4, 3),
                                BlockConfig(32, 32, 32, 4, 3), BlockConfig(16, 64, 32, 4, 3)),
    "rows_kernel": (BlockConfig(64, 64, 32, 8, 3), BlockConfig(64, 64, 32, 4, 2), BlockConfig(32, 64, 32, 4, 3),
                    BlockConfig(16, 64, 32, 4, 3)),
    "wgrad_kernel": (BlockConfig(64, 64, 32, 8, 3), BlockConfig(64, 32, 32, 4, 3), BlockConfig(32, 64, 32, 4, 3),
                     BlockConfig(16, 64, 32, 4, 3)),
}
ROLES = tuple(CONFIGS)  # kernel roles: a kernel name, ".backward" for gate_up_kernel with BACKWARD=True


def configs_for(role: str, dtype: str) -> tuple[BlockConfig, ...]:
    return (CONFIGS_FP32 if dtype == "float32" else CONFIGS)[role]


def _pow2_at_least(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


def rows_bucket(N: int, E: int) -> int:
    """Autotune key for the ragged dimension: average rows per expert, as a power of two."""
    return _pow2_at_least(triton.cdiv(max(N, 1), max(E, 1)), floor=1)


def pick_config(kernel: str, dtype: str, rows_per_expert: int, n_cols: int, n_reduce: int) -> BlockConfig:
    """One config for a shape (the interpreted path): the first in the list whose tiles do not overhang.

    Tiles are shrunk to the problem (at least 16, tl.dot's minimum) so tiny test shapes run few,
    small programs.
    """
    configs = configs_for(kernel, dtype)
    for cfg in configs:
        if cfg.block_m <= _pow2_at_least(rows_per_expert) or cfg is configs[-1]:
            return BlockConfig(min(cfg.block_m, _pow2_at_least(rows_per_expert)), min(cfg.block_n, _pow2_at_least(n_cols)),
                               min(cfg.block_k, _pow2_at_least(n_reduce)), cfg.num_warps, cfg.num_stages)
    raise AssertionError("unreachable: the last config always matches")


def shared_bytes_estimate(kernel: str, cfg: BlockConfig, elem_bytes: int, gated: bool = True) -> int:
    """Operand tiles in shared memory for software pipelining: num_stages x (row tiles + weight tiles)."""
    m, n, k = cfg.block_m, cfg.block_n, cfg.block_k
    if kernel == "gate_up_kernel":
        per_stage = m * k + (2 if gated else 1) * k * n
    elif kernel == "gate_up_kernel.backward":
        per_stage = 2 * m * k + (3 if gated else 2) * k * n
    elif kernel == "rows_kernel":  # the two products run one after the other
        per_stage = m * k + k * n
    else:  # wgrad: a^T tile (P x rows) and b tile (rows x Q)
        per_stage = m * n + m * k
    return per_stage * elem_bytes * cfg.num_stages


def fits(kernel: str, cfg: BlockConfig, elem_bytes: int, limit_bytes: int, gated: bool = True) -> bool:
    return shared_bytes_estimate(kernel, cfg, elem_bytes, gated) <= limit_bytes


# ----------------------------------------------------------------------------------------------
# Generated source.
# ----------------------------------------------------------------------------------------------

# Each activation: its forward `act(g, u)` and backward `(dg, du)` in fp32; u is ignored when not gated.
_ACTIVATION_SOURCE = {
    "swiglu": '''
@triton.jit
def activate(g, u, limit, alpha):
    """swiglu: silu(gate) * up"""
    return g * tl.sigmoid(g) * u


@triton.jit
def activate_grad(da, g, u, limit, alpha):
    s = tl.sigmoid(g)
    return da * u * s * (1.0 + g * (1.0 - s)), da * g * s
''',
    "geglu": '''
@triton.jit
def activate(g, u, limit, alpha):
    """geglu: gelu(gate) * up (erf form)"""
    return _gelu(g) * u


@triton.jit
def activate_grad(da, g, u, limit, alpha):
    return da * u * _gelu_grad(g), da * _gelu(g)
''',
    "gelu": '''
@triton.jit
def activate(g, u, limit, alpha):
    """gelu (erf form)"""
    return _gelu(g)


@triton.jit
def activate_grad(da, g, u, limit, alpha):
    dg = da * _gelu_grad(g)
    return dg, dg
''',
    "gelu_tanh": '''
@triton.jit
def _tanh(z):
    return 2.0 * tl.sigmoid(2.0 * z) - 1.0


@triton.jit
def activate(g, u, limit, alpha):
    """gelu, tanh approximation"""
    return 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))


@triton.jit
def activate_grad(da, g, u, limit, alpha):
    t = _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))
    dt = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
    dg = da * (0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * dt)
    return dg, dg
''',
    "relu": '''
@triton.jit
def activate(g, u, limit, alpha):
    """relu"""
    return tl.maximum(g, 0.0)


@triton.jit
def activate_grad(da, g, u, limit, alpha):
    dg = tl.where(g > 0.0, da, 0.0)
    return dg, dg
''',
    "clamped_swiglu": '''
@triton.jit
def activate(g, u, limit, alpha):
    """clamped swiglu (GPT-OSS): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)"""
    gc = tl.minimum(g, limit)
    uc = tl.minimum(tl.maximum(u, -limit), limit)
    return (uc + 1.0) * gc * tl.sigmoid(alpha * gc)


@triton.jit
def activate_grad(da, g, u, limit, alpha):
    gc = tl.minimum(g, limit)
    uc = tl.minimum(tl.maximum(u, -limit), limit)
    s = tl.sigmoid(alpha * gc)
    dg = tl.where(g <= limit, da * (uc + 1.0) * (s + alpha * gc * s * (1.0 - s)), 0.0)
    du = tl.where((u >= -limit) & (u <= limit), da * gc * s, 0.0)
    return dg, du
''',
}

_GELU_SOURCE = '''
@triton.jit
def _gelu(g):
    return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))


@triton.jit
def _gelu_grad(g):
    return 0.5 * (1.0 + tl.erf(g * 0.7071067811865476)) + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
'''

# The kernels, identical for every spec: what varies comes from the constants above them.
_KERNEL_SOURCE = '''

@triton.jit
def _expert_rows(counts_ptr, e, E, E_POW2: tl.constexpr):
    """Rows [begin, end) of expert e: an exclusive/inclusive cumsum of counts_E, on device."""
    offs_e = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0).to(tl.int64)
    mine = offs_e == e
    end = tl.sum(tl.where(mine, tl.cumsum(counts, 0), 0), 0)
    return end - tl.sum(tl.where(mine, counts, 0), 0), end


@triton.jit
def _row_tile(counts_ptr, E, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """Expert e owning row tile program_id(0) and the tile's rows [row0, row_end); e == E past the last tile."""
    pid = tl.program_id(0)
    offs_e = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0).to(tl.int64)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    e = tl.sum((tile_end <= pid).to(tl.int32), 0)
    first_tile = tl.sum(tl.where(offs_e == e, tile_end - tiles, 0), 0)
    begin, end = _expert_rows(counts_ptr, e, E, E_POW2)
    return e, begin + (pid - first_tile) * BLOCK_M, end


@triton.jit
def _load(ptr, rows, cols, stride_r, stride_c, mask_r, mask_c):
    """A [len(rows), len(cols)] tile, zero outside the masks, as the tl.dot operand dtype."""
    tile = tl.load(ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask_r[:, None] & mask_c[None, :],
                   other=0.0)
    return tile.to(DOT_DTYPE)


@triton.jit
def _rounded(x):
    """fp32 -> STORE_DTYPE rounding to nearest even (the interpreter's fp32 -> bf16 cast truncates)."""
    if ROUND_BF16:
        x = round_bf16(x)
    return x.to(STORE_DTYPE)


@triton.jit
def _accumulate(acc, a_ptr, b_ptr, s_be, s_bk, s_bq, e, rows, row_ok, cols, col_ok, K, BLOCK_K: tl.constexpr):
    """acc += a[rows, :K] @ b[e, :K, cols], a row-major [N, K]."""
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = _load(a_ptr, rows, ks, K, 1, row_ok, k_ok)
        b = _load(b_ptr + e * s_be, ks, cols, s_bk, s_bq, k_ok, col_ok)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def gate_up_kernel(
    x_ptr,                                # [N, D] rows sorted by expert, row-major
    grad_y_ptr,                           # [N, D] row-major (BACKWARD)
    counts_ptr,                           # [E] rows per expert
    w_gate_ptr, s_wg_e, s_wg_f, s_wg_d,   # [E, F, D]
    w_up_ptr, s_wu_e, s_wu_f, s_wu_d,     # [E, F, D] (GATED)
    w_down_ptr, s_wd_e, s_wd_d, s_wd_f,   # [E, D, F] (BACKWARD)
    b_gate_ptr, b_up_ptr,                 # [E, F] row-major (HAS_B_GATE, HAS_B_UP)
    a_ptr,                                # out [N, F] the activation
    grad_gate_ptr, grad_up_ptr,           # out [N, F] d loss / d h_gate, d h_up (BACKWARD; up: GATED)
    D, F, E, limit, alpha,
    rows_bucket,                          # autotune key only: rows per expert, power of two
    BACKWARD: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    e, row0, row_end = _row_tile(counts_ptr, E, E_POW2, BLOCK_M)
    if e >= E:
        return
    e = e.to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < F
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_grad_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):  # one pass over D feeds the gate, up (and grad_a) products
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < D
        x = _load(x_ptr, rows, ks, D, 1, row_ok, k_ok)
        w = _load(w_gate_ptr + e * s_wg_e, ks, cols, s_wg_d, s_wg_f, k_ok, col_ok)
        acc_gate = tl.dot(x, w, acc_gate, input_precision=DOT_PRECISION)
        if GATED:
            w = _load(w_up_ptr + e * s_wu_e, ks, cols, s_wu_d, s_wu_f, k_ok, col_ok)
            acc_up = tl.dot(x, w, acc_up, input_precision=DOT_PRECISION)
        if BACKWARD:
            g = _load(grad_y_ptr, rows, ks, D, 1, row_ok, k_ok)
            w = _load(w_down_ptr + e * s_wd_e, ks, cols, s_wd_d, s_wd_f, k_ok, col_ok)
            acc_grad_a = tl.dot(g, w, acc_grad_a, input_precision=DOT_PRECISION)
    if HAS_B_GATE:
        acc_gate += tl.load(b_gate_ptr + e * F + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_B_UP:
        acc_up += tl.load(b_up_ptr + e * F + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = rows[:, None] * F + cols[None, :]
    out_ok = row_ok[:, None] & col_ok[None, :]
    tl.store(a_ptr + out, _rounded(activate(acc_gate, acc_up, limit, alpha)), mask=out_ok)
    if BACKWARD:
        grad_gate, grad_up = activate_grad(acc_grad_a, acc_gate, acc_up, limit, alpha)
        tl.store(grad_gate_ptr + out, _rounded(grad_gate), mask=out_ok)
        if GATED:
            tl.store(grad_up_ptr + out, _rounded(grad_up), mask=out_ok)


@triton.jit
def rows_kernel(
    a1_ptr,                               # [N, K] row-major
    b1_ptr, s_b1_e, s_b1_k, s_b1_q,       # [E, K, Q]
    a2_ptr,                               # [N, K] row-major (TWO)
    b2_ptr, s_b2_e, s_b2_k, s_b2_q,       # [E, K, Q] (TWO)
    bias_ptr,                             # [E, Q] row-major (HAS_BIAS)
    out_ptr,                              # out [N, Q] row-major
    counts_ptr,                           # [E] rows per expert
    K, Q, E,
    rows_bucket,                          # autotune key only
    TWO: tl.constexpr, HAS_BIAS: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    e, row0, row_end = _row_tile(counts_ptr, E, E_POW2, BLOCK_M)
    if e >= E:
        return
    e = e.to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < Q
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _accumulate(acc, a1_ptr, b1_ptr, s_b1_e, s_b1_k, s_b1_q, e, rows, row_ok, cols, col_ok, K, BLOCK_K)
    if TWO:
        acc = _accumulate(acc, a2_ptr, b2_ptr, s_b2_e, s_b2_k, s_b2_q, e, rows, row_ok, cols, col_ok, K, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * Q + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * Q + cols[None, :], _rounded(acc), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def wgrad_kernel(
    a_ptr,                                # [N, P] row-major, rows sorted by expert
    b_ptr,                                # [N, Q] row-major
    out_ptr,                              # out [E, P, Q]: out[e] = a[rows_e]^T @ b[rows_e]
    bias_ptr,                             # out [E, P]: column sums of a[rows_e] (HAS_BIAS)
    counts_ptr,                           # [E] rows per expert
    P, Q, E,
    rows_bucket,                          # autotune key only
    HAS_BIAS: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64)
    ps = tl.program_id(1).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = tl.program_id(2).to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_ok = ps < P
    q_ok = qs < Q
    begin, end = _expert_rows(counts_ptr, e, E, E_POW2)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    acc_bias = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for m0 in range(begin, end, BLOCK_M):  # an expert with no rows stores zeros
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        a_t = _load(a_ptr, ps, rows, 1, P, p_ok, row_ok)  # [BLOCK_P, BLOCK_M]
        acc = tl.dot(a_t, _load(b_ptr, rows, qs, Q, 1, row_ok, q_ok), acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc_bias += tl.sum(a_t.to(tl.float32), axis=1)
    tl.store(out_ptr + e * P * Q + ps[:, None] * Q + qs[None, :], _rounded(acc), mask=p_ok[:, None] & q_ok[None, :])
    if HAS_BIAS:
        tl.store(bias_ptr + e * P + ps, _rounded(acc_bias), mask=p_ok & (tl.program_id(2) == 0))
'''




def generated_source_for(spec: FfnSpec) -> str:
    """The Triton module for one spec: constants, the activation, the three kernels."""
    if spec.activation not in _ACTIVATION_SOURCE:
        raise ValueError(f"grouped_gemm: unknown activation {spec.activation!r}; known: {ACTIVATIONS}")
    why = "interpreted: 16-bit tl.dot is wrong (bf16) in the interpreter" if spec.interpreted else "storage dtype"
    tuned = "one config per shape (pick_config)" if spec.interpreted else "@triton.autotune over CONFIGS"
    header = f'''# Generated by lowering/grouped_gemm.py for {spec.label}. Do not edit: regenerate.
# Shapes: N rows sorted by expert, D model width, F expert hidden width, E experts, K reduction, Q columns.
# Block sizes: {tuned}.
import triton
import triton.language as tl

GATED = tl.constexpr({spec.gated})
HAS_B_GATE = tl.constexpr({spec.has_b_gate})
HAS_B_UP = tl.constexpr({spec.has_b_up})
HAS_B_DOWN = tl.constexpr({spec.has_b_down})  # for the reader: rows_kernel takes the down bias as HAS_BIAS
STORE_DTYPE = tl.constexpr(tl.{spec.dtype})
DOT_DTYPE = tl.constexpr(tl.{spec.dot_dtype})  # {why}
DOT_PRECISION = tl.constexpr("{'tf32' if spec.tf32 else 'ieee'}")  # fp32 products (ignored for 16-bit)
ROUND_BF16 = tl.constexpr({spec.interpreted and spec.dtype == "bfloat16"})  # round by hand: interpreted casts truncate
'''
    gelu = _GELU_SOURCE if spec.activation in ("gelu", "geglu") else ""
    return header + codegen.ROUND_BF16_SOURCE + gelu + _ACTIVATION_SOURCE[spec.activation] + _KERNEL_SOURCE


# ----------------------------------------------------------------------------------------------
# Loading and launching.
# ----------------------------------------------------------------------------------------------

_TUNING_KEYS = {
    "gate_up_kernel": ("D", "F", "rows_bucket"),
    "gate_up_kernel.backward": ("D", "F", "rows_bucket"),
    "rows_kernel": ("K", "Q", "rows_bucket", "TWO"),
    "wgrad_kernel": ("P", "Q", "rows_bucket"),
}
_LOADED: dict[FfnSpec, dict[str, Any]] = {}


def kernel_module(spec: FfnSpec) -> Any:
    """The imported generated module of `spec` (its functions are the raw @triton.jit kernels)."""
    return codegen.load_kernel_module(generated_source_for(spec), "grouped_gemm")


def _kernels(spec: FfnSpec) -> dict[str, Any]:
    """Launchable kernels by role: the jit functions when interpreted, autotuners over CONFIGS on a GPU."""
    kernels = _LOADED.get(spec)
    if kernels is None:
        module = kernel_module(spec)
        kernels = {role: getattr(module, role.split(".")[0]) for role in ROLES}
        if not spec.interpreted:
            elem = torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
            kernels = {role: triton.autotune(
                configs=[triton.Config(c.kwargs(role.split(".")[0]), num_warps=c.num_warps, num_stages=c.num_stages)
                         for c in configs_for(role, spec.dtype)],
                key=list(_TUNING_KEYS[role]),
                prune_configs_by={"early_config_prune": _pruner(role, elem, spec.gated)},
            )(fn) for role, fn in kernels.items()}
        _LOADED[spec] = kernels
    return kernels


def _pruner(role: str, elem_bytes: int, gated: bool):
    """Autotune pruning: drop configs whose pipelined operand tiles exceed the device's shared memory."""

    def prune(configs, named_args, **kwargs):
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        limit = getattr(props, "shared_memory_per_block_optin", None) or codegen.SHARED_LIMIT_BYTES.get(
            10 * props.major + props.minor, 48 * 1024)
        keep = [c for c in configs if fits(role, _as_block_config(role, c), elem_bytes, limit, gated)]
        return keep or configs[-1:]

    return prune


def _as_block_config(role: str, cfg: Any) -> BlockConfig:
    k = cfg.kwargs
    n, q = ("BLOCK_P", "BLOCK_Q") if role == "wgrad_kernel" else ("BLOCK_N", "BLOCK_K")
    return BlockConfig(k["BLOCK_M"], k[n], k[q], cfg.num_warps, cfg.num_stages)


def _launch(spec: FfnSpec, role: str, grid, args: tuple, constexprs: dict[str, Any], shape: tuple[int, int, int]) -> None:
    """Launch `role` with `grid(meta)`; interpreted, with the config `pick_config` gives for `shape`."""
    kernel = _kernels(spec)[role]
    if spec.interpreted:
        cfg = pick_config(role, spec.dtype, *shape)
        meta = cfg.kwargs(role.split(".")[0])
        kernel[grid(meta)](*args, **constexprs, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        kernel[grid](*args, **constexprs)


def _row_grid(N: int, E: int, n_cols: int):
    """Row tiles (host-known bound: every expert may end with one partial tile) x column tiles."""
    return lambda meta: (triton.cdiv(N, meta["BLOCK_M"]) + E, triton.cdiv(n_cols, meta["BLOCK_N"]))


def _strides_EKQ(w: Tensor, transpose: bool) -> tuple[int, int, int]:
    """Strides of a 3-D expert weight read as [E, K, Q]; `transpose` reads [E, A, B] as [E, B, A]."""
    return (w.stride(0), w.stride(2), w.stride(1)) if transpose else (w.stride(0), w.stride(1), w.stride(2))


# ----------------------------------------------------------------------------------------------
# Host wrappers: validate, allocate, launch. Same arguments as moe.expert_ffn / expert_ffn_backward.
# ----------------------------------------------------------------------------------------------


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


def rows_launch(spec, out_NQ, a1_NK, b1, a2_NK, b2, bias_EQ, counts_E, transpose_b: bool) -> None:
    """out = a1 @ b1[e] (+ a2 @ b2[e]) (+ bias[e]) over expert-sorted rows; b read as [E, K, Q]."""
    N, K = a1_NK.shape
    Q, E = out_NQ.shape[1], counts_E.shape[0]
    two = a2_NK is not None
    args = (a1_NK, b1, *_strides_EKQ(b1, transpose_b), a2_NK if two else a1_NK, b2 if two else b1,
            *_strides_EKQ(b2 if two else b1, transpose_b), a1_NK if bias_EQ is None else bias_EQ, out_NQ, counts_E,
            K, Q, E, rows_bucket(N, E))
    _launch(spec, "rows_kernel", _row_grid(N, E, Q), args,
            dict(TWO=two, HAS_BIAS=bias_EQ is not None, E_POW2=triton.next_power_of_2(E)),
            (triton.cdiv(N, E), Q, K))


def wgrad_launch(spec, a_NP: Tensor, b_NQ: Tensor, counts_E: Tensor, with_bias: bool) -> tuple[Tensor, Tensor | None]:
    """grad_w_EPQ[e] = a[rows_e]^T @ b[rows_e], and the bias gradient (column sums of a[rows_e])."""
    N, P = a_NP.shape
    Q, E = b_NQ.shape[1], counts_E.shape[0]
    out_EPQ = a_NP.new_empty(E, P, Q)
    bias_EP = a_NP.new_empty(E, P) if with_bias else None
    grid = lambda meta: (E, triton.cdiv(P, meta["BLOCK_P"]), triton.cdiv(Q, meta["BLOCK_Q"]))
    args = (a_NP, b_NQ, out_EPQ, out_EPQ if bias_EP is None else bias_EP, counts_E, P, Q, E, rows_bucket(N, E))
    _launch(spec, "wgrad_kernel", grid, args, dict(HAS_BIAS=with_bias, E_POW2=triton.next_power_of_2(E)),
            (triton.cdiv(N, E), P, Q))
    return out_EPQ, bias_EP


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
    _launch(spec, role, _row_grid(N, E, F), args, dict(BACKWARD=backward, E_POW2=triton.next_power_of_2(E)),
            (triton.cdiv(N, E), F, D))
    return a_NF, grad_gate_NF, grad_up_NF


def _contiguous(*tensors: Tensor | None) -> list[Tensor | None]:
    """Activations, biases and counts row-major (cheap, usually no-ops); weights keep their strides."""
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
    x_ND, counts_E, b_gate_EF, b_up_EF, b_down_ED = _contiguous(x_ND, counts_E, b_gate_EF, b_up_EF, b_down_ED)
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
    grad_y_ND, x_ND, counts_E, b_gate_EF, b_up_EF = _contiguous(grad_y_ND, x_ND, counts_E, b_gate_EF, b_up_EF)
    a_NF, grad_gate_NF, grad_up_NF = gate_up_launch(spec, x_ND, grad_y_ND, counts_E, w_gate_EFD, w_up_EFD,
                                                     w_down_EDF, b_gate_EF, b_up_EF, clamp_limit, alpha)
    grad_x_ND = torch.empty_like(x_ND)
    if x_ND.shape[0]:
        rows_launch(spec, grad_x_ND, grad_gate_NF, w_gate_EFD, grad_up_NF, w_up_EFD, None, counts_E,
                     transpose_b=False)
    grad_w_gate, grad_b_gate = wgrad_launch(spec, grad_gate_NF, x_ND, counts_E, b_gate_EF is not None)
    grad_w_up, grad_b_up = (None, None) if grad_up_NF is None else wgrad_launch(spec, grad_up_NF, x_ND, counts_E,
                                                                                 b_up_EF is not None)
    grad_w_down, grad_b_down = wgrad_launch(spec, grad_y_ND, a_NF, counts_E, b_down_ED is not None)
    return [grad_x_ND, grad_w_gate, grad_w_up, grad_w_down, grad_b_gate, grad_b_up, grad_b_down]


# ----------------------------------------------------------------------------------------------
# Eligibility, generated source, the custom ops and their registration.
# ----------------------------------------------------------------------------------------------

MAX_EXPERTS = 8192  # the tile schedule loads counts_E as one block of next_pow2(E) per program


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


def eligible(
    x_ND: Tensor, counts_E: Tensor, w_gate_EFD: Tensor, w_up_EFD: Tensor | None, w_down_EDF: Tensor,
    b_gate_EF: Tensor | None, b_up_EF: Tensor | None, b_down_ED: Tensor | None, activation: str,
    clamp_limit: float, alpha: float,
) -> str | None:
    """None if the Triton kernels can run these arguments (real or fake tensors), else why not."""
    (x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, activation, clamp_limit,
     alpha) = unfused((x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, activation,
                       clamp_limit, alpha))
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
    clamp_limit: float, alpha: float,
) -> str:
    """The kernel source these arguments run (for `moepass.explain`)."""
    return generated_source_for(spec_of(*unfused((x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF,
                                                  b_up_EF, b_down_ED, activation, clamp_limit, alpha))))


@torch.library.custom_op("moe_lowered::expert_ffn_forward", mutates_args=())
def expert_ffn_forward_op(
    x_ND: Tensor,
    counts_E: Tensor,
    w_gate_EFD: Tensor,
    w_up_EFD: Tensor | None,
    w_down_EDF: Tensor,
    b_gate_EF: Tensor | None,
    b_up_EF: Tensor | None,
    b_down_ED: Tensor | None,
    activation: str,
    clamp_limit: float,
    alpha: float,
    save: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """y_ND with the Triton kernels; nothing kept for backward (its first kernel recomputes gate/up)."""
    args = (x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, activation, clamp_limit,
            alpha)
    if eligible(*args) is None:
        return expert_ffn_forward(*unfused(args)), x_ND.new_empty(0), x_ND.new_empty(0)
    return torch.ops.moe.expert_ffn_forward(*args, save)  # the torch fallback


@expert_ffn_forward_op.register_fake
def _(x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, activation, clamp_limit,
      alpha, save):
    dialect.check_ffn_shapes(x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, activation)
    args = (x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, activation, clamp_limit,
            alpha)
    keep = save and eligible(*args) is not None  # only the torch fallback keeps pre-activations
    return (x_ND.new_empty(x_ND.shape[0], w_down_EDF.shape[1]),
            *dialect.saved_activations(x_ND, w_gate_EFD, w_up_EFD is not None, keep))


@torch.library.custom_op("moe_lowered::expert_ffn_backward", mutates_args=())
def expert_ffn_backward_op(
    grad_y_ND: Tensor,
    x_ND: Tensor,
    h_gate_NF: Tensor,
    h_up_NF: Tensor,
    counts_E: Tensor,
    w_gate_EFD: Tensor,
    w_up_EFD: Tensor | None,
    w_down_EDF: Tensor,
    b_gate_EF: Tensor | None,
    b_up_EF: Tensor | None,
    b_down_ED: Tensor | None,
    activation: str,
    clamp_limit: float,
    alpha: float,
) -> list[Tensor]:
    """Backward of `moe_lowered::expert_ffn`; absent optional inputs get an empty tensor in their slot."""
    args = (x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, activation, clamp_limit,
            alpha)
    if eligible(*args) is None:
        grads = fused_grads(expert_ffn_backward(grad_y_ND, *unfused(args)), args)
        return [x_ND.new_empty(0) if g is None else g for g in grads]
    return torch.ops.moe.expert_ffn_backward(grad_y_ND, x_ND, h_gate_NF, h_up_NF, *args[1:])  # torch fallback


@expert_ffn_backward_op.register_fake
def _(grad_y_ND, x_ND, h_gate_NF, h_up_NF, counts_E, *weights_and_options):
    # the kernels write contiguous gradients; the torch fallback writes them as the dialect's op does
    contiguous = eligible(x_ND, counts_E, *weights_and_options) is None
    return dialect.ffn_gradient_fakes(x_ND, *weights_and_options[:6], contiguous=contiguous)


expert_ffn = dialect.define_expert_ffn("moe_lowered::expert_ffn", torch.ops.moe_lowered.expert_ffn_forward,
                                       torch.ops.moe_lowered.expert_ffn_backward)
codegen.register_autocast(torch.ops.moe_lowered.expert_ffn.default, "compute")
codegen.register_autocast(torch.ops.moe_lowered.expert_ffn_forward.default, "compute")

LOWERING = lowering.register(lowering.Lowering(
    family="grouped_gemm",
    dialect_op=torch.ops.moe.expert_ffn.default,
    lowered_op=torch.ops.moe_lowered.expert_ffn.default,
    eligible=eligible,
    source=generated_source,
))


# ----------------------------------------------------------------------------------------------
# GPU build check (compile-only, no GPU): every kernel role x config of a spec, for sm_<arch>.
# ----------------------------------------------------------------------------------------------

_ROLE_CONSTEXPRS = {  # the widest variant of each role (every optional operand present)
    "gate_up_kernel": {"BACKWARD": False},
    "gate_up_kernel.backward": {"BACKWARD": True},
    "rows_kernel": {"TWO": True, "HAS_BIAS": True},
    "wgrad_kernel": {"HAS_BIAS": True},
}
_UNIT_STRIDES = ("s_wg_d", "s_wu_d", "s_wd_f", "s_b1_q", "s_b2_q")  # row-major weights: Triton specialises 1s
_NOT_DIVISIBLE = ("E", "rows_bucket", "limit", "alpha")  # ints a real launch would not see as multiples of 16


def gpu_build_requests(spec: FfnSpec, arch: int, num_experts: int = 128,
                       which: str = "all") -> list[tuple[str, BlockConfig, Any]]:
    """(role, config, `codegen.BuildRequest`) for every kernel role and config ("all") or the
    first and last config of each role ("ends").

    The signature is what a launch on row-major weights with 16-byte aligned tensors and dimensions
    that are multiples of 16 specialises to (the proxy shapes all are): unit strides as constants,
    pointers and the other ints marked divisible by 16. Without those hints the compiler cannot
    vectorise or pipeline the loads, and the build no longer represents what runs.
    """
    module = kernel_module(FfnSpec(**{**spec.__dict__, "interpreted": False}))
    sig_dtype = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[spec.dtype]
    out = []
    for role in ROLES:
        name = role.split(".")[0]
        kernel = getattr(module, name)
        raw = codegen.unwrap(kernel)
        arg_names = raw.__code__.co_varnames[: raw.__code__.co_argcount]
        configs = configs_for(role, spec.dtype)
        for cfg in configs if which == "all" else dict.fromkeys((configs[0], configs[-1])):
            constexprs = {"E_POW2": triton.next_power_of_2(num_experts), **_ROLE_CONSTEXPRS[role], **cfg.kwargs(name)}
            constexprs.update({s: 1 for s in _UNIT_STRIDES if s in arg_names})
            signature = {a: ("*i64" if a == "counts_ptr" else f"*{sig_dtype}" if a.endswith("_ptr")
                             else "fp32" if a in ("limit", "alpha") else "i32")
                         for a in arg_names if a not in constexprs}
            divisible = tuple(a for a in signature if a not in _NOT_DIVISIBLE)
            out.append((role, cfg, codegen.BuildRequest.of(kernel, signature, constexprs, arch, cfg.num_warps,
                                                            cfg.num_stages, divisible=divisible)))
    return out
