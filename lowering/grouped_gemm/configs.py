"""What one generated grouped-GEMM module is specialised to (`FfnSpec`) and the block sizes its kernels run with.

A config's block_m tiles the N routed rows, block_n the output columns (wgrad: p), block_k the reduction
(wgrad: q); letters as `moepass.spec.SHAPES`.

Block sizes: on a GPU every kernel is `@triton.autotune`d over its config list (keyed on the
dimensions and a power-of-two bucket of rows per expert; configs over the device's shared memory are
pruned: `fits`); interpreted, or while `torch.use_deterministic_algorithms` is on (a timing race must
not choose the summation order), one config is picked per shape from the same list (`pick_config`).
16-bit and fp32 have separate lists (`configs_for`), each checked to build for sm_80/sm_90 without
spills (`source.gpu_build_requests`).

A kernel *role* is a kernel name, or "gate_up_kernel.backward" for gate_up_kernel with BACKWARD=True
(its own configs: it holds three accumulators).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lowering import codegen

# Supported dtypes and their `triton.language` names ("float32", "float16", "bfloat16").
DTYPES = {dtype: codegen.TL_DTYPES[dtype].removeprefix("tl.") for dtype in codegen.FLOAT_DTYPES}


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
    # torch.use_deterministic_algorithms is on (Plan(deterministic=True)): no autotuning race on a GPU, one
    # config per shape (`pick_config`), so every run reduces in the same order
    deterministic: bool = False

    @property
    def fixed_configs(self) -> bool:
        """Launch with `pick_config`'s config (interpreted, or deterministic) rather than autotuning."""
        return self.interpreted or self.deterministic

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

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
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )


# ----------------------------------------------------------------------------------------------
# Block-size configs. One list per kernel role; autotuned on a GPU, `pick_config` when interpreted.
# ----------------------------------------------------------------------------------------------


def kernel_name(role: str) -> str:
    """The kernel a role launches ("gate_up_kernel.backward" -> "gate_up_kernel")."""
    return role.split(".")[0]


def _block_names(kernel: str) -> tuple[str, str, str]:
    """The kernel's block-size meta-parameters for (block_m, block_n, block_k)."""
    return ("BLOCK_M", "BLOCK_P", "BLOCK_Q") if kernel == "wgrad_kernel" else ("BLOCK_M", "BLOCK_N", "BLOCK_K")


@dataclass(frozen=True)
class BlockConfig:
    block_m: int  # rows per tile (wgrad: rows per reduction step)
    block_n: int  # output columns per tile (wgrad: P)
    block_k: int  # reduction per step (wgrad: Q)
    num_warps: int = 4
    num_stages: int = 3

    def kwargs(self, kernel: str) -> dict[str, int]:
        return dict(zip(_block_names(kernel), (self.block_m, self.block_n, self.block_k)))

    @classmethod
    def of(cls, role: str, meta: dict[str, Any], num_warps: int, num_stages: int) -> BlockConfig:
        """The config a launch's meta-parameters spell (`kwargs` read back)."""
        m, n, k = (meta[name] for name in _block_names(kernel_name(role)))
        return cls(m, n, k, num_warps, num_stages)


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
    return max(floor, codegen.next_pow2(max(int(n), 1)))


def rows_bucket(N: int, E: int) -> int:
    """Autotune key for the ragged dimension: average rows per expert, as a power of two."""
    return _pow2_at_least(codegen.cdiv(max(N, 1), max(E, 1)), floor=1)


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
