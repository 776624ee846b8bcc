"""The generated grouped-GEMM module: `render(spec)` fills `templates.TEMPLATE`, `kernel_module` imports it,
and `gpu_build_requests` reads its `GPU_BUILDS` for the compile-only GPU build check.

Like every family in `lowering/` (see `lowering/codegen.py`), the generated module lists its kernels
for the GPU build check in `GPU_BUILDS`: here every kernel role in its widest variant (every optional
operand present) x every block config it may be tuned over, each entry also naming its `role`.
The entries describe what a launch on row-major weights with 16-byte aligned tensors and dimensions
that are multiples of 16 specialises to (the proxy shapes all are): unit strides as constants,
pointers and the other ints marked divisible by 16. Without those hints the compiler cannot
vectorise or pipeline the loads, and the build no longer represents what runs. E is a launch-time
value; the builds take `PROXY_EXPERTS` for the E_POW2 constexpr.
"""

from __future__ import annotations

import ast
import dataclasses
from types import ModuleType
from typing import Any

import torch
import triton

from lowering import codegen
from lowering.grouped_gemm.configs import DTYPES, ROLES, BlockConfig, FfnSpec, configs_for, kernel_name
from lowering.grouped_gemm.templates import ACTIVATION_HELPERS, ACTIVATION_SOURCE, KERNEL_SOURCE, TEMPLATE
from moepass.activations import ACTIVATIONS

PROXY_EXPERTS = 128  # E of the GPU build check's kernels
_ROLE_CONSTEXPRS = {  # the widest variant of each role (every optional operand present)
    "gate_up_kernel": {"BACKWARD": False},
    "gate_up_kernel.backward": {"BACKWARD": True},
    "rows_kernel": {"TWO": True, "HAS_BIAS": True},
    "wgrad_kernel": {"HAS_BIAS": True},
}
_UNIT_STRIDES = ("s_wg_d", "s_wu_d", "s_wd_f", "s_b1_q", "s_b2_q")  # row-major weights: Triton specialises 1s
_NOT_DIVISIBLE = ("E", "rows_bucket", "limit", "alpha")  # ints a real launch would not see as multiples of 16
# Parameter names of every function of the kernel source, in order.
_PARAMETERS = {f.name: tuple(a.arg for a in f.args.args) for f in ast.parse(KERNEL_SOURCE).body
               if isinstance(f, ast.FunctionDef)}


def render(spec: FfnSpec) -> str:
    """The Triton module for one spec: constants, the activation, the three kernels, GPU_BUILDS."""
    if spec.activation not in ACTIVATION_SOURCE:
        raise ValueError(f"grouped_gemm: unknown activation {spec.activation!r}; known: {ACTIVATIONS}")
    if spec.dtype not in DTYPES.values():
        raise ValueError(f"grouped_gemm: dtype {spec.dtype} not supported; use one of {list(DTYPES.values())}")
    return codegen.render(
        TEMPLATE,
        LABEL=spec.label,
        TUNED="one config per shape (pick_config)" if spec.fixed_configs else "@triton.autotune over CONFIGS",
        GATED=spec.gated, HAS_B_GATE=spec.has_b_gate, HAS_B_UP=spec.has_b_up, HAS_B_DOWN=spec.has_b_down,
        STORE_TL=codegen.TL_DTYPES[spec.torch_dtype],
        DOT_TL=codegen.TL_DTYPES[getattr(torch, spec.dot_dtype)],
        DOT_WHY="interpreted: 16-bit tl.dot is wrong (bf16) in the interpreter" if spec.interpreted else "storage dtype",
        DOT_PRECISION="tf32" if spec.tf32 else "ieee",
        ROUND_BF16=spec.interpreted and spec.dtype == "bfloat16",
        HELPERS=codegen.ROUND_BF16_SOURCE,
        ACTIVATION=ACTIVATION_HELPERS.get(spec.activation, "") + ACTIVATION_SOURCE[spec.activation],
        KERNELS=KERNEL_SOURCE,
        GPU_BUILDS="".join(f"    {build!r},\n" for build in gpu_builds(spec)),
    )


def gpu_builds(spec: FfnSpec) -> list[dict[str, Any]]:
    """The `GPU_BUILDS` entries of `spec`'s module: every role x config, in `ROLES` and list order."""
    signature_dtype = codegen.SIG_DTYPES[spec.torch_dtype]
    return [_build(role, cfg, signature_dtype) for role in ROLES for cfg in configs_for(role, spec.dtype)]


def _build(role: str, cfg: BlockConfig, signature_dtype: str) -> dict[str, Any]:
    kernel = kernel_name(role)
    parameters = _PARAMETERS[kernel]
    constexprs = {"E_POW2": triton.next_power_of_2(PROXY_EXPERTS), **_ROLE_CONSTEXPRS[role], **cfg.kwargs(kernel)}
    constexprs.update({s: 1 for s in _UNIT_STRIDES if s in parameters})
    signature = {p: _parameter_type(p, signature_dtype) for p in parameters if p not in constexprs}
    return dict(kernel=kernel, role=role, num_warps=cfg.num_warps, num_stages=cfg.num_stages, constexprs=constexprs,
                signature=signature, divisible=tuple(p for p in signature if p not in _NOT_DIVISIBLE))


def _parameter_type(name: str, signature_dtype: str) -> str:
    """Triton type of a kernel parameter: counts int64, the other pointers the spec's dtype, ints i32."""
    if name == "counts_ptr":
        return "*i64"
    if name.endswith("_ptr"):
        return f"*{signature_dtype}"
    return "fp32" if name in ("limit", "alpha") else "i32"


def kernel_module(spec: FfnSpec) -> ModuleType:
    """The imported generated module of `spec` (its functions are the raw @triton.jit kernels)."""
    return codegen.load_kernel_module(render(spec), "grouped_gemm")


def gpu_build_requests(spec: FfnSpec, arch: int, num_experts: int = PROXY_EXPERTS,
                       which: str = "all") -> list[tuple[str, BlockConfig, codegen.BuildRequest]]:
    """(role, config, `codegen.BuildRequest`) for every entry of the GPU module's `GPU_BUILDS` ("all") or
    the first and last config of each role ("ends"), for sm_<arch> and `num_experts` experts."""
    module = kernel_module(dataclasses.replace(spec, interpreted=False))
    e_pow2 = {"E_POW2": triton.next_power_of_2(num_experts)}
    out = []
    for build in module.GPU_BUILDS:
        role = build["role"]
        cfg = BlockConfig.of(role, build["constexprs"], build["num_warps"], build["num_stages"])
        configs = configs_for(role, spec.dtype)
        if which == "all" or cfg in (configs[0], configs[-1]):
            build = dict(build, constexprs={**build["constexprs"], **e_pow2})
            out.append((role, cfg, codegen.build_request(module, build, arch)))
    return out
