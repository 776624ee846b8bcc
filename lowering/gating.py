"""Gating: `moe.route` as one Triton kernel generated per router specialisation.

Shape letters: `moepass.spec.SHAPES` (a tile of Y tokens by Z expert columns; A = n_group expert groups of
V = E/A experts, the template's $X). E_PAD and K_PAD are the next powers of two of E and K.

One program scores BLOCK_T tokens: load the logits row block, score (softmax over E, sigmoid, or raw
logits when the softmax comes after the top-k), add the selection-only bias, keep the best
`topk_group` groups (group score: sum of a group's top-2 or its max), select K experts, gather their
weights, renormalise and scale. Everything the spec fixes (E, K, G, score function, dtypes, scaling,
block size) is a literal in the generated source, so a spec with no groups has no group code at all.

Selection bias: `[E]` (every token the same) or `[T, E]` (one row per token: the per-head biases of a
Multi-Head LatentMoE repeated over its sub-tokens). The kernel reads row t of the bias at
`bias_ptr + t * bias_row_stride`, so `[E]` is the stride-0 case of the same code: one source and, as
`bias_row_stride` is never specialised (`do_not_specialize`), one compiled kernel for both layouts --
the one `GPU_BUILDS` builds. The bias rank is therefore not part of `GatingSpec`.

Precision: the kernel computes in fp32 and rounds to the logits' (or the choice's) dtype at exactly
the points where `moepass.dialect.route_ref` (which computes in the logits' dtype) rounds, so the
selected experts agree with the reference for fp16/bf16 logits too.

Ties: the kernel breaks every tie (equal choice scores, equal group scores) by the LOWEST index,
i.e. like `torch.sort(descending=True, stable=True)`. `torch.topk` on CPU does NOT do this: it uses
`std::partial_sort`/`nth_element`, whose order among equal values depends on E and K
(`torch.topk(torch.zeros(1, 8), 3).indices == [[6, 5, 4]]`), and on CUDA the order among ties is
unspecified as well. So on inputs with exact ties the kernel equals the stable-sort rule, not
`route_ref`; without ties it equals `route_ref` exactly. The same holds for masked (-inf) experts
when K exceeds the experts of the kept groups. Scores that differ in the last fp32 bit between
torch's and Triton's exp can also order near-ties differently (fp32 only; GPU `tl.exp` is
approximate). NaN logits are not supported.

Backward: `moepass.dialect.route_backward_ref` (pure torch; selection has no gradient).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lowering import Lowering
from lowering import codegen as cg
from moepass import dialect
from moepass.process_state import KERNEL_FALLBACKS
from moepass.spec import GROUP_SCORES, SCORE_FUNCS

MAX_EXPERTS = 1024  # E_PAD * BLOCK_T floats per tile stay within registers up to here
FALLBACKS = KERNEL_FALLBACKS  # op name -> launches that fell back to the torch reference (device cannot run Triton)


@dataclass(frozen=True)
class GatingSpec:
    """Everything the generated gating kernel is specialised to."""

    E: int
    K: int
    score_func: str
    softmax_before_topk: bool
    renormalize: bool
    n_group: int
    topk_group: int
    group_score: str
    scaling: float
    logits_dtype: torch.dtype
    bias_dtype: torch.dtype | None

    @classmethod
    def from_args(cls, logits_TE, selection_bias, score_func, softmax_before_topk, top_k, renormalize, n_group,
                  topk_group, group_score, scaling) -> GatingSpec:
        """The spec of these `moe.route` arguments; `selection_bias` is `[E]`, `[T, E]` or None."""
        return cls(int(logits_TE.shape[1]), int(top_k), score_func, bool(softmax_before_topk), bool(renormalize),
                   int(n_group), int(topk_group), group_score, float(scaling), logits_TE.dtype,
                   None if selection_bias is None else selection_bias.dtype)

    @property
    def softmax_after(self) -> bool:
        return self.score_func == "softmax" and not self.softmax_before_topk

    @property
    def grouped(self) -> bool:
        return self.n_group > 1 and self.topk_group < self.n_group

    @property
    def choice_dtype(self) -> torch.dtype:
        """Dtype of the selection scores in the reference (bias added with type promotion)."""
        if self.bias_dtype is None:
            return self.logits_dtype
        return torch.promote_types(self.logits_dtype, self.bias_dtype)

    @property
    def block_t(self) -> int:
        return max(1, min(64, 2048 // cg.next_pow2(self.E)))

    @property
    def num_warps(self) -> int:
        return 4 if self.block_t * cg.next_pow2(self.E) >= 1024 else 2


# ----------------------------------------------------------------------------------------------
# The template. `$NAME` placeholders are filled by `generated_source`; optional stages are pasted
# in only when the spec needs them.
# ----------------------------------------------------------------------------------------------

_TEMPLATE = '''"""Generated by lowering/gating.py -- moe.route specialised to:
$SUMMARY
Do not edit: regenerate from the template."""
import triton
import triton.language as tl

$HELPERS

@triton.jit(do_not_specialize=["bias_row_stride"])  # stride 0 and E: one compiled kernel
def route_kernel(
    logits_ptr,       # [T, $E] $LOGITS_DTYPE
    bias_ptr,         # [$E] or [T, $E] selection-only bias, $BIAS_DTYPE (None: not read)
    bias_row_stride,  # elements between bias rows: 0 for [$E], the row stride for [T, $E]
    weights_ptr,      # [T, $K] $LOGITS_DTYPE out
    experts_ptr,      # [T, $K] int64 out
    T,                # tokens
    BLOCK_T: tl.constexpr,
):
    NEG = float("-inf")
    rows_Y = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok_Y = rows_Y < T
    rows64_Y = rows_Y.to(tl.int64)
    cols_Z = tl.arange(0, $E_PAD)
    col_ok_Z = cols_Z < $E
    ok_YZ = row_ok_Y[:, None] & col_ok_Z[None, :]
    logits_YZ = tl.load(logits_ptr + rows64_Y[:, None] * $E + cols_Z[None, :], mask=ok_YZ, other=0.0).to(tl.float32)
    logits_YZ = tl.where(col_ok_Z[None, :], logits_YZ, NEG)  # padded experts never win
$STAGES
    # top-K: repeatedly take the best remaining expert, lowest index among equal scores
    kcols_K = tl.arange(0, $K_PAD)
    taken_YZ = tl.zeros([BLOCK_T, $E_PAD], dtype=tl.int32)
    experts_YK = tl.zeros([BLOCK_T, $K_PAD], dtype=tl.int32)
    picked_YK = tl.zeros([BLOCK_T, $K_PAD], dtype=tl.float32)
    for k in tl.static_range($K):
        cand_YZ = col_ok_Z[None, :] & (taken_YZ == 0)
        best_Y = tl.max(tl.where(cand_YZ, choice_YZ, NEG), axis=1)
        expert_Y = tl.min(tl.where(cand_YZ & (choice_YZ == best_Y[:, None]), cols_Z[None, :], $E_PAD), axis=1)
        hit_YZ = cols_Z[None, :] == expert_Y[:, None]
        taken_YZ = tl.where(hit_YZ, 1, taken_YZ)
        value_Y = tl.sum(tl.where(hit_YZ, source_YZ, 0.0), axis=1)
        experts_YK = tl.where(kcols_K[None, :] == k, expert_Y[:, None], experts_YK)
        picked_YK = tl.where(kcols_K[None, :] == k, value_Y[:, None], picked_YK)
    k_ok_K = kcols_K < $K
$WEIGHT_STAGES
    out_ok_YK = row_ok_Y[:, None] & k_ok_K[None, :]
    out_offsets_YK = rows64_Y[:, None] * $K + kcols_K[None, :]
    tl.store(weights_ptr + out_offsets_YK, weights_YK.to($LOGITS_TL), mask=out_ok_YK)
    tl.store(experts_ptr + out_offsets_YK, experts_YK.to(tl.int64), mask=out_ok_YK)


def launch(logits_TE, bias, bias_row_stride, weights_TK, experts_TK):
    T = logits_TE.shape[0]
    route_kernel[(triton.cdiv(T, $BLOCK_T),)](logits_TE, bias, bias_row_stride, weights_TK, experts_TK, T,
                                              BLOCK_T=$BLOCK_T, num_warps=$NUM_WARPS)


# One build serves an [E] bias (stride 0) and a [T, E] bias alike: bias_row_stride is never specialised.
GPU_BUILDS = [dict(kernel="route_kernel", num_warps=$NUM_WARPS, constexprs=dict(BLOCK_T=$BLOCK_T),
                   signature=dict(logits_ptr="*$LOGITS_SIG", bias_ptr="*$BIAS_SIG", bias_row_stride="i32",
                                  weights_ptr="*$LOGITS_SIG", experts_ptr="*i64", T="i32"))]
'''

_SCORE = {
    "softmax_before": '''    # scores: softmax over the E experts, rounded to the logits dtype
    shifted_YZ = logits_YZ - tl.max(logits_YZ, axis=1)[:, None]
    exp_YZ = tl.exp(shifted_YZ)
    scores_YZ = round_l(exp_YZ / tl.sum(exp_YZ, axis=1)[:, None])
    source_YZ = scores_YZ''',
    "sigmoid": '''    # scores: sigmoid, rounded to the logits dtype
    scores_YZ = round_l(tl.sigmoid(logits_YZ))
    source_YZ = scores_YZ''',
    "softmax_after": '''    # softmax comes after the top-k: select on the logits themselves
    scores_YZ = logits_YZ
    source_YZ = logits_YZ''',
}

_BIAS = '''    # selection-only bias (row t at t * bias_row_stride; stride 0: one [E] row for every token);
    # it picks the experts, the weights come from the unbiased scores
    bias_offsets_YZ = rows64_Y[:, None] * bias_row_stride + cols_Z[None, :]
    bias_YZ = tl.load(bias_ptr + bias_offsets_YZ, mask=ok_YZ, other=0.0).to(tl.float32)
    choice_YZ = round_c(scores_YZ + bias_YZ)'''

_GROUPS = '''    # group-limited selection: $G groups of $X experts, keep the best $TOPK_GROUP groups
    group_Z = cols_Z // $X
    group_score_YZ = tl.zeros([BLOCK_T, $E_PAD], dtype=tl.float32)
    for g in tl.static_range($G):
        in_g_YZ = (group_Z == g)[None, :] & col_ok_Z[None, :]
        member_YZ = tl.where(in_g_YZ, choice_YZ, NEG)
        first_Y = tl.max(member_YZ, axis=1)
$GROUP_SCORE
        group_score_YZ = tl.where(in_g_YZ, score_Y[:, None], group_score_YZ)
    keep_YZ = tl.zeros([BLOCK_T, $E_PAD], dtype=tl.int32)
    for j in tl.static_range($TOPK_GROUP):
        cand_YZ = col_ok_Z[None, :] & (keep_YZ == 0)
        best_Y = tl.max(tl.where(cand_YZ, group_score_YZ, NEG), axis=1)
        col_Y = tl.min(tl.where(cand_YZ & (group_score_YZ == best_Y[:, None]), cols_Z[None, :], $E_PAD), axis=1)
        keep_YZ = tl.where(group_Z[None, :] == (col_Y // $X)[:, None], 1, keep_YZ)
    choice_YZ = tl.where(keep_YZ != 0, choice_YZ, NEG)'''

_GROUP_SCORE = {
    "max": "        score_Y = first_Y",
    "top2_sum": '''        at_Y = tl.min(tl.where(in_g_YZ & (member_YZ == first_Y[:, None]), cols_Z[None, :], $E_PAD), axis=1)
        second_Y = tl.max(tl.where(cols_Z[None, :] == at_Y[:, None], NEG, member_YZ), axis=1)
        score_Y = round_c(first_Y + second_Y)''',
}

_WEIGHTS_SOFTMAX_AFTER = '''    # weights: softmax over the K selected logits
    picked_YK = tl.where(k_ok_K[None, :], picked_YK, NEG)
    exp_YK = tl.exp(picked_YK - tl.max(picked_YK, axis=1)[:, None])
    weights_YK = round_l(exp_YK / tl.sum(exp_YK, axis=1)[:, None])'''

_WEIGHTS_RENORMALIZE = '''    # renormalise the K weights to sum to one
    total_Y = round_l(tl.sum(tl.where(k_ok_K[None, :], weights_YK, 0.0), axis=1))
    total_Y = round_l(total_Y + 1e-20)
    weights_YK = round_l(weights_YK / total_Y[:, None])'''

_WEIGHTS_SCALE = '''    weights_YK = round_l(weights_YK * $SCALING)  # routed scaling factor'''


def _render(spec: GatingSpec) -> str:
    values = dict(
        SUMMARY="\n".join(f"    {k} = {v}" for k, v in vars(spec).items()),
        HELPERS=cg.rounding_helpers(round_l=spec.logits_dtype, round_c=spec.choice_dtype),
        E=spec.E, E_PAD=cg.next_pow2(spec.E), K=spec.K, K_PAD=cg.next_pow2(spec.K),
        G=spec.n_group, X=spec.E // max(spec.n_group, 1), TOPK_GROUP=spec.topk_group,
        SCALING=repr(spec.scaling), BLOCK_T=spec.block_t, NUM_WARPS=spec.num_warps,
        LOGITS_DTYPE=spec.logits_dtype, BIAS_DTYPE=spec.bias_dtype, LOGITS_TL=cg.TL_DTYPES[spec.logits_dtype],
        LOGITS_SIG=cg.SIG_DTYPES[spec.logits_dtype], BIAS_SIG=cg.SIG_DTYPES[spec.bias_dtype or spec.logits_dtype],
    )
    fill = functools.partial(cg.render, **values)
    score_kind = "softmax_after" if spec.softmax_after else "sigmoid" if spec.score_func == "sigmoid" else "softmax_before"
    groups = ""
    if spec.grouped:
        top2 = spec.group_score == "top2_sum" and spec.E // spec.n_group > 1
        groups = cg.render(_GROUPS, GROUP_SCORE=fill(_GROUP_SCORE["top2_sum" if top2 else "max"]), **values)
    weights = [_WEIGHTS_SOFTMAX_AFTER] if spec.softmax_after else ["    weights_YK = picked_YK"]
    if spec.renormalize and not spec.softmax_after:
        weights.append(_WEIGHTS_RENORMALIZE)
    if spec.scaling != 1.0:
        weights.append(_WEIGHTS_SCALE)
    return fill(_TEMPLATE.replace("$STAGES", "\n".join([
        _SCORE[score_kind], _BIAS if spec.bias_dtype is not None else "    choice_YZ = scores_YZ", groups,
    ])).replace("$WEIGHT_STAGES", fill("\n".join(weights))))


def generated_source(*route_args) -> str:
    """The Triton source specialised to these `moe.route` arguments (tensors may be fake)."""
    return _render(GatingSpec.from_args(*route_args))


@functools.cache
def _module(spec: GatingSpec, interpreted: bool):
    return cg.load_kernel_module(_render(spec), "gating")


def kernel_module(*route_args):
    """The imported generated module for these arguments (for the GPU build check and explain)."""
    return _module(GatingSpec.from_args(*route_args), cg.is_interpreted())


# ----------------------------------------------------------------------------------------------
# Eligibility and the host wrapper.
# ----------------------------------------------------------------------------------------------


def eligible(logits_TE, selection_bias, score_func, softmax_before_topk, top_k, renormalize, n_group, topk_group,
             group_score, scaling) -> str | None:
    """None if the generated kernel can run `moe.route` on these arguments, else the reason."""
    if logits_TE.dim() != 2:
        return f"logits_TE must be 2-D (T, E), got shape {tuple(logits_TE.shape)}"
    T, E = logits_TE.shape
    if logits_TE.dtype not in cg.FLOAT_DTYPES:
        return f"logits dtype {logits_TE.dtype} is not fp32/fp16/bf16"
    if not 1 <= E <= MAX_EXPERTS:
        return f"E={E} experts outside [1, {MAX_EXPERTS}]"
    if not 1 <= top_k <= E:
        return f"top_k={top_k} outside [1, E={E}]"
    if score_func not in SCORE_FUNCS or group_score not in GROUP_SCORES:
        return f"unknown score_func={score_func!r} or group_score={group_score!r}"
    if n_group > 1 and (E % n_group or not 1 <= topk_group <= n_group):
        return f"n_group={n_group} must divide E={E} and topk_group={topk_group} lie in [1, n_group]"
    if selection_bias is not None:  # [E], or [T, E]: one row per token (a Multi-Head LatentMoE's head biases)
        if selection_bias.shape not in ((E,), (T, E)) or selection_bias.dtype not in cg.FLOAT_DTYPES:
            return (f"selection_bias has shape {tuple(selection_bias.shape)} / dtype {selection_bias.dtype}; the "
                    f"kernel takes ({E},) or ({T}, {E}) in fp32/fp16/bf16")
        if selection_bias.device != logits_TE.device:
            return f"selection_bias on {selection_bias.device}, logits on {logits_TE.device}"
    return cg.launch_blocker(logits_TE.device)


def _bias_rows(selection_bias: Tensor | None, logits_TE: Tensor) -> tuple[Tensor, int]:
    """The bias pointer and its row stride for the kernel: [E] -> stride 0, [T, E] -> its row stride
    (an expanded [E] -> [T, E] view keeps stride 0, no copy). No bias: any pointer, never read."""
    if selection_bias is None:
        return logits_TE, 0
    if selection_bias.stride(-1) != 1:
        selection_bias = selection_bias.contiguous()
    return selection_bias, selection_bias.stride(0) if selection_bias.dim() == 2 else 0


def route_triton(logits_TE, selection_bias, score_func, softmax_before_topk, top_k, renormalize, n_group,
                 topk_group, group_score, scaling) -> tuple[Tensor, Tensor]:
    """Launch the generated kernel (no fallback: callers check `eligible` first). `selection_bias` is
    `[E]`, `[T, E]` (one row per token) or None."""
    args = (logits_TE, selection_bias, score_func, softmax_before_topk, top_k, renormalize, n_group, topk_group,
            group_score, scaling)
    dialect.check_route_operands("moe_lowered.route", logits_TE, selection_bias, top_k, "selection_bias")
    reason = eligible(*args)
    if reason is not None:
        raise ValueError(f"moe_lowered.route: cannot launch the Triton kernel: {reason}")
    T = logits_TE.shape[0]
    weights_TK = logits_TE.new_empty(T, top_k)
    experts_TK = logits_TE.new_empty(T, top_k, dtype=torch.int64)
    if T:
        logits_TE = logits_TE.contiguous()
        bias, bias_row_stride = _bias_rows(selection_bias, logits_TE)
        kernel_module(*args).launch(logits_TE, bias, bias_row_stride, weights_TK, experts_TK)
    return weights_TK, experts_TK


def _route(*args: Any) -> tuple[Tensor, Tensor]:
    if cg.launch_blocker(args[0].device) is not None:  # e.g. a CPU tensor with interpretation off
        FALLBACKS["route"] += 1
        with torch.no_grad():
            return dialect.route_ref(*args)
    return route_triton(*args)


# moe.route's declaration: the same operands, fake, autograd (selection has no gradient; weights via
# route_backward_ref) and autocast policy
LOWERING = Lowering.define("gating", dialect.ROUTE, dialect.ROUTE_SCHEMA, _route, eligible, generated_source)
