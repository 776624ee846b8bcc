"""The MoE dialect: the ops every moepass graph is written in.

Each op is a `torch.library.custom_op` in the `moe` namespace with a fake (meta) implementation, an
autograd formula and an autocast policy, so it stays one opaque, readable node in FX, Dynamo and AOT
graphs and behaves the same eagerly and compiled. Each is defined through `moepass.eager`, so a rewritten
block run eagerly calls the op's function and autograd directly, without the dispatcher:

    route(logits_TE, selection_bias_E?)            -> weights_TK (logits dtype), experts_TK (int64)
                                                      (bias [E], or [T, E]: one row per token)
    update_selection_bias(bias, experts_TK, rate, training)  in place: aux-loss-free balancing step
    count_load(counter_O, experts_TK, training)  in place: the block's own per-expert load counter
    capacity_keep(experts_TK, ...)                 -> keep_TK (bool)
    permute(x_TD, experts_TK)                      -> x_ND, counts_E, order_N
    expert_ffn(x_ND, counts_E, w_gate_EFD, ...)    -> y_ND
    unpermute(y_ND, order_N)                       -> y_TKD        (exact inverse of permute)
    combine(y_TKD, weights_TK)                     -> out_TD       (weighted sum over K, fp32 accumulate)

Autocast: `route` runs in fp32 (router precision), `expert_ffn` in the autocast compute dtype, `combine`
in fp32 (the block's output in its fp32 input's dtype, as the original accumulating into it returns it),
the data-movement ops keep their input dtype.

The pure-torch references (`*_ref`) are the semantics; kernels in `lowering/` must match them.

Shape letters: `moepass.spec.SHAPES`.
The expert FFN op lives in `moepass.dialect_ffn` (re-exported here). Host sync points: the reference
`expert_ffn_ref` reads `counts_E` on the host (`grouped_ffn.split_sizes`); the op itself runs
`moepass.grouped_ffn`, which syncs only in its per-expert fallback. Nothing else syncs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moepass import eager
from moepass.dialect_ffn import (  # noqa: F401  (the expert FFN op: part of the dialect, re-exported)
    EXPERT_FFN_BACKWARD_SCHEMA,
    EXPERT_FFN_FORWARD_SCHEMA,
    EXPERT_FFN_SCHEMA,
    FFN_ARGS,
    FFN_DIFFERENTIABLE,
    FFN_WEIGHT_NAMES,
    REBUILD,
    WGRAD_SINK,
    DeferredWeightGrads,
    WeightGradSink,
    check_ffn_shapes,
    define_expert_ffn,
    expert_ffn,
    expert_ffn_backward,
    expert_ffn_forward,
    expert_ffn_function,
    expert_ffn_ref,
    expert_ffn_split_backward,
    ffn_gradient_fakes,
    in_compute_dtype,
    kept,
    rebuildable,
    saved_activations,
    sinks_of,
)
from moepass.operands import AUTOCAST_POLICIES, OpSchema, register_autocast  # noqa: F401  (re-exported)

NAMESPACE = "moe"

# ----------------------------------------------------------------------------------------------
# References: plain differentiable torch, the semantics of each op.
# ----------------------------------------------------------------------------------------------


def route_ref(
    logits_TE: Tensor,
    selection_bias_E: Tensor | None,
    score_func: str,
    softmax_before_topk: bool,
    top_k: int,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    group_score: str,
    scaling: float,
) -> tuple[Tensor, Tensor]:
    """Select top_k experts per token and their weights. Ties break as `torch.topk` does.

    The selection-only bias is `[E]` (the same for every token) or `[T, E]` (one row per token, e.g.
    per-head biases repeated over the sub-tokens of a Multi-Head LatentMoE); it changes which experts
    are chosen, never their weights. Computes in the logits' dtype: the graph (and the autocast
    policy) hands it fp32 logits.
    """
    T, E = logits_TE.shape
    if score_func == "softmax" and not softmax_before_topk:
        choice_TE = logits_TE if selection_bias_E is None else logits_TE + selection_bias_E
        choice_TE = _limit_groups(choice_TE, n_group, topk_group, group_score)
        experts_TK = torch.topk(choice_TE, top_k, dim=-1).indices
        weights_TK = torch.softmax(logits_TE.gather(1, experts_TK), dim=-1)
        return scaled(weights_TK, scaling), experts_TK
    scores_TE = torch.softmax(logits_TE, dim=-1) if score_func == "softmax" else torch.sigmoid(logits_TE)
    choice_TE = scores_TE if selection_bias_E is None else scores_TE + selection_bias_E
    choice_TE = _limit_groups(choice_TE, n_group, topk_group, group_score)
    experts_TK = torch.topk(choice_TE, top_k, dim=-1).indices
    weights_TK = scores_TE.gather(1, experts_TK)
    if renormalize:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return scaled(weights_TK, scaling), experts_TK


def scaled(weights_TK: Tensor, scaling: float) -> Tensor:
    """`weights_TK * scaling`; a scaling of 1 multiplies nothing (x * 1.0 is x, bit for bit)."""
    return weights_TK if scaling == 1.0 else weights_TK * scaling


def _limit_groups(choice_TE: Tensor, n_group: int, topk_group: int, group_score: str) -> Tensor:
    """Group-limited selection: only experts of the best `topk_group` groups stay selectable."""
    if n_group <= 1 or topk_group >= n_group:
        return choice_TE
    T, E = choice_TE.shape
    grouped_TAV = choice_TE.view(T, n_group, E // n_group)
    if group_score == "top2_sum":
        score_TA = grouped_TAV.topk(min(2, E // n_group), dim=-1).values.sum(dim=-1)
    else:
        score_TA = grouped_TAV.amax(dim=-1)
    groups_TI = torch.topk(score_TA, topk_group, dim=-1, sorted=False).indices
    keep_TA = torch.zeros_like(score_TA, dtype=torch.bool).scatter_(1, groups_TI, True)
    keep_TE = keep_TA.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    return choice_TE.masked_fill(~keep_TE, float("-inf"))


def update_selection_bias_ref(selection_bias: Tensor, experts_TK: Tensor, rate: float) -> Tensor:
    """The selection bias after one aux-loss-free balancing step (DeepSeek-V3), as a new tensor.

    `selection_bias` is `[E]`, or `[H, E]` with one row per head when the rows of `experts_TK` are
    token-major, head-minor sub-tokens (row t*H + j belongs to head j). Per head, every expert's load
    (how many of the rows' K choices picked it) is compared with the mean load T*K/E:
    `bias[j, e] += rate * sign(mean - load[j, e])`: overloaded experts get less attractive, idle ones more.
    """
    E = selection_bias.shape[-1]
    H = selection_bias.numel() // E
    rows, K = experts_TK.shape
    load_HE = head_load_ref(experts_TK, H, E).view(selection_bias.shape).to(selection_bias.dtype)
    mean = (rows // H) * K / E
    return selection_bias + rate * torch.sign(mean - load_HE)


def head_load_ref(experts_TK: Tensor, num_heads: int, experts_per_head: int) -> Tensor:
    """[num_heads, E] int64: how many of the rows' K choices picked each expert of each head (rows token-major,
    head-minor: row t*H + j belongs to head j; head j's expert e is global expert j*E + e)."""
    rows, K = experts_TK.shape
    H, E = num_heads, experts_per_head
    heads_TH1 = torch.arange(H, device=experts_TK.device).view(1, H, 1) * E
    ids_N = (experts_TK.reshape(rows // H, H, K) + heads_TH1).reshape(-1)  # head-major global expert ids
    return torch.bincount(ids_N, minlength=H * E).view(H, E)


def capacity_keep_ref(
    experts_TK: Tensor, num_experts: int, capacity: int, group_size: int, k_major: bool
) -> Tensor:
    """Which (token, choice) assignments fit in their expert's capacity.

    Tokens form contiguous groups of `group_size` (0: one group); each expert takes at most
    `capacity` assignments per group, in priority order: k-major (every first choice before any
    second choice, GShard) or token-major.
    """
    T, K = experts_TK.shape
    size = group_size if group_size > 0 else max(T, 1)
    if T % size:
        raise ValueError(f"capacity_keep: {T} tokens do not split into groups of {size}")
    groups = T // size
    # a scatter, not F.one_hot: one_hot reads the ids' min and max on the host to validate them
    onehot_TKE = experts_TK.new_zeros(T, K, num_experts).scatter_(-1, experts_TK.unsqueeze(-1), 1)
    # per capacity group: [groups, size, K, E], then in priority order [groups, size*K, E]
    onehot = onehot_TKE.view(groups, size, K, num_experts)
    order = (onehot.transpose(1, 2) if k_major else onehot).reshape(groups, size * K, num_experts)
    position = torch.cumsum(order, dim=1) - 1  # the slot each assignment would take in its expert
    fits = ((position < capacity) & order.bool()).any(dim=-1)  # [groups, size*K]
    if k_major:
        fits = fits.view(groups, K, size).transpose(1, 2)
    return fits.reshape(T, K).contiguous()  # row-major as its fake (one group: the reshape is a transposed view)


def permute_ref(x_TD: Tensor, experts_TK: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Sort the T*K (token, choice) rows by expert, stably. `x_ND[n] = x_TD[order_N[n] // K]`."""
    K = experts_TK.shape[1]
    flat_N = experts_TK.reshape(-1)
    order_N = torch.sort(flat_N, stable=True).indices
    counts_E = expert_load_ref(experts_TK, num_experts)  # a scatter: bincount reads the ids' max on the host
    return x_TD.index_select(0, order_N // K), counts_E, order_N


def unpermute_ref(y_ND: Tensor, order_N: Tensor, top_k: int) -> Tensor:
    """Back to (token, choice) order: `y_TKD.view(-1, D)[order_N] = y_ND`, computed as a gather through the inverse
    permutation (`argsort(order_N)`: row i comes from `y_ND[inverse_N[i]]`). The same rows as scattering with
    `index_copy`, bit for bit; on a CPU gathering whole rows is ~3x faster than scattering them, and there is no
    clone of a fresh buffer (the out-of-place `index_copy`'s)."""
    N, D = y_ND.shape
    inverse_N = torch.argsort(order_N)  # order_N is a permutation: unique keys, so any sort gives the inverse
    return y_ND.index_select(0, inverse_N).view(N // top_k, top_k, D)


def accumulation_dtype(t: Tensor) -> torch.dtype:
    """What the combine sums in: fp32, or the input's dtype where it is wider (a float64 model stays float64)."""
    return torch.promote_types(t.dtype, torch.float32)


def combine_ref(y_TKD: Tensor, weights_TK: Tensor) -> Tensor:
    """Weighted sum over the K choices, accumulated in fp32 (or wider: `accumulation_dtype`), returned in y's dtype.

    Each product y·w is rounded, then the products are added in choice order: the arithmetic of
    `(y * w).sum` and of a loop's `out.index_add_(y_e * w)` (for K=2 bitwise either way), not a fused
    multiply-add (`addcmul_` rounds once: up to 1 ulp apart from what the user's block computes)."""
    # K multiplies and adds over [T, D] (einsum would run T tiny batched GEMMs: ~5x slower on CPU)
    acc = accumulation_dtype(y_TKD)
    y_f32, w_f32 = y_TKD.to(acc), weights_TK.to(acc)
    out_TD = y_f32[:, 0] * w_f32[:, :1]
    for k in range(1, y_TKD.shape[1]):
        out_TD += y_f32[:, k] * w_f32[:, k:k + 1]
    return out_TD.to(y_TKD.dtype)



# ----------------------------------------------------------------------------------------------
# The ops: one declaration each (`moepass.operands.OpSchema`: operands, outputs, fake, autograd,
# autocast), from which the `moe::` op here and the lowerings' `moe_lowered::` ops are made.
# ----------------------------------------------------------------------------------------------


def check_route_operands(op: str, logits_TE: Tensor, selection_bias: Tensor | None, top_k: int,
                         bias_name: str = "selection_bias_E") -> None:
    """The shape checks of a route op (`op`: its name in the message): logits [T, E], 1 <= top_k <= E, the
    selection bias [E] or one row per token [T, E]; a ValueError naming the operand and the dimensions."""
    if logits_TE.dim() != 2:
        raise ValueError(f"{op}: logits_TE has shape {tuple(logits_TE.shape)}, expected (T, E)")
    T, E = logits_TE.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"{op}: top_k={top_k} must lie in [1, E={E}]")
    if selection_bias is not None and selection_bias.shape not in ((E,), (T, E)):
        raise ValueError(f"{op}: {bias_name} has shape {tuple(selection_bias.shape)}, expected (E={E},) or one row "
                         f"per token (T={T}, E={E})")


def _route_fake(logits_TE, selection_bias_E, score_func, softmax_before_topk, top_k, renormalize, n_group, topk_group,
                group_score, scaling):
    check_route_operands("moe.route", logits_TE, selection_bias_E, top_k)
    T = logits_TE.shape[0]
    return logits_TE.new_empty(T, top_k), logits_TE.new_empty(T, top_k, dtype=torch.int64)


def route_backward_ref(
    grad_weights_TK: Tensor,
    logits_TE: Tensor,
    experts_TK: Tensor,
    score_func: str,
    softmax_before_topk: bool,
    renormalize: bool,
    scaling: float,
) -> Tensor:
    """d(weights_TK)/d(logits_TE) for the selected experts; selection itself has no gradient."""
    g_TK = scaled(grad_weights_TK.to(logits_TE.dtype), scaling)
    if score_func == "softmax" and not softmax_before_topk:
        p_TK = torch.softmax(logits_TE.gather(1, experts_TK), dim=-1)
        g_logit_TK = p_TK * (g_TK - (g_TK * p_TK).sum(-1, keepdim=True))
        return torch.zeros_like(logits_TE).scatter_add(1, experts_TK, g_logit_TK)
    scores_TE = torch.softmax(logits_TE, dim=-1) if score_func == "softmax" else torch.sigmoid(logits_TE)
    s_TK = scores_TE.gather(1, experts_TK)
    if renormalize:  # autograd's derivative of s / total, term by term: g / total - sum(g * ((s / total) / total))
        total_T1 = s_TK.sum(-1, keepdim=True) + 1e-20
        g_TK = g_TK / total_T1 + (-g_TK * ((s_TK / total_T1) / total_T1)).sum(-1, keepdim=True)
    g_scores_TE = torch.zeros_like(logits_TE).scatter_add(1, experts_TK, g_TK)
    if score_func == "softmax":
        return scores_TE * (g_scores_TE - (g_scores_TE * scores_TE).sum(-1, keepdim=True))
    return g_scores_TE * (1 - scores_TE) * scores_TE  # sigmoid_backward's order: (g * (1 - y)) * y


def _route_setup(ctx, inputs, output):
    logits_TE, _bias, score_func, softmax_before_topk, _k, renormalize, _g, _tg, _gs, scaling = inputs
    ctx.save_for_backward(logits_TE, output[1])
    ctx.options = (score_func, softmax_before_topk, renormalize, scaling)


def _route_bwd(ctx, grad_weights_TK, _grad_experts):
    logits_TE, experts_TK = ctx.saved_tensors
    grad = route_backward_ref(grad_weights_TK, logits_TE, experts_TK, *ctx.options)
    return (grad.to(logits_TE.dtype),) + (None,) * 9


ROUTE_SCHEMA = OpSchema(
    "route",
    "Tensor logits_TE, Tensor? selection_bias_E, str score_func, bool softmax_before_topk, SymInt top_k, "
    "bool renormalize, SymInt n_group, SymInt topk_group, str group_score, float scaling",
    "(Tensor, Tensor)", fake=_route_fake, autograd=(_route_bwd, _route_setup), autocast="fp32")


def _route(*args: Any) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        return route_ref(*args)


route = ROUTE_SCHEMA.define(NAMESPACE, _route)


def _update_selection_bias(selection_bias: Tensor, experts_TK: Tensor, rate: float, training: bool) -> None:
    """In train mode, one balancing step of `selection_bias` in place (`update_selection_bias_ref`);
    in eval mode nothing. The bias is state, not a parameter: no gradient flows through this."""
    if training:
        with torch.no_grad():
            selection_bias.copy_(update_selection_bias_ref(selection_bias, experts_TK, rate))


def _update_selection_bias_fake(selection_bias, experts_TK, rate, training):
    E = selection_bias.shape[-1]
    H = selection_bias.numel() // E
    if selection_bias.dim() not in (1, 2) or experts_TK.dim() != 2 or experts_TK.shape[0] % H:
        raise ValueError(f"moe.update_selection_bias: selection_bias {tuple(selection_bias.shape)} must be [E] or "
                         f"[H, E] and experts_TK {tuple(experts_TK.shape)} [T*H, K]")
    return None


UPDATE_SELECTION_BIAS_SCHEMA = OpSchema("update_selection_bias",
                                        "Tensor(a0!) selection_bias, Tensor experts_TK, float rate, bool training", "()",
                                        fake=_update_selection_bias_fake)
update_selection_bias = UPDATE_SELECTION_BIAS_SCHEMA.define(NAMESPACE, _update_selection_bias)


def expert_load_ref(experts_TK: Tensor, num_experts: int) -> Tensor:
    """How many of the rows' choices picked each expert, [O] int64. A scatter, not bincount: a fixed shape (fake
    tensors trace it) and no host sync."""
    ids = experts_TK.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def count_load_ref(counter_O: Tensor, experts_TK: Tensor) -> Tensor:
    """`counter_O` plus each expert's load (`expert_load_ref`; a block's own statistic, e.g. the token counts a
    training loop reads to balance the experts), as a new tensor in the counter's dtype."""
    return counter_O + expert_load_ref(experts_TK, counter_O.shape[0]).to(counter_O.dtype)


def _count_load(counter_O: Tensor, experts_TK: Tensor, training: bool) -> None:
    """In train mode, add each expert's load to `counter_O` in place (`count_load_ref`); in eval mode nothing.
    The counter is the block's state (a buffer), never a parameter: nothing flows back through it."""
    if training:
        with torch.no_grad():
            counter_O.copy_(count_load_ref(counter_O, experts_TK))


def _count_load_fake(counter_O, experts_TK, training):
    if counter_O.dim() != 1 or experts_TK.dim() != 2:
        raise ValueError(f"moe.count_load: counter_O {tuple(counter_O.shape)} must be [O] and experts_TK "
                         f"{tuple(experts_TK.shape)} [T, K]")
    return None


COUNT_LOAD_SCHEMA = OpSchema("count_load", "Tensor(a0!) counter_O, Tensor experts_TK, bool training", "()",
                             fake=_count_load_fake)
count_load = COUNT_LOAD_SCHEMA.define(NAMESPACE, _count_load)


def _capacity_keep_fake(experts_TK, num_experts, capacity, group_size, k_major):
    return torch.empty_like(experts_TK, dtype=torch.bool)


CAPACITY_KEEP_SCHEMA = OpSchema(
    "capacity_keep", "Tensor experts_TK, SymInt num_experts, SymInt capacity, SymInt group_size, bool k_major",
    "Tensor", fake=_capacity_keep_fake)
capacity_keep = CAPACITY_KEEP_SCHEMA.define(NAMESPACE, capacity_keep_ref)


def _permute_fake(x_TD, experts_TK, num_experts):
    T, D = x_TD.shape
    if experts_TK.shape[0] != T:
        raise ValueError(f"moe.permute: experts_TK has {experts_TK.shape[0]} rows, x_TD has T={T}")
    N = T * experts_TK.shape[1]
    return (
        x_TD.new_empty(N, D),
        experts_TK.new_empty(num_experts, dtype=torch.int64),
        experts_TK.new_empty(N, dtype=torch.int64),
    )


def _permute_setup(ctx, inputs, output):
    ctx.top_k = inputs[1].shape[1]
    ctx.save_for_backward(output[2])


def permute_backward(grad_x_ND: Tensor, order_N: Tensor, top_k: int) -> Tensor:
    """grad_x_TD of `permute`: each token's K routed rows summed (one row each when K = 1: no sum to copy)."""
    grad_x_TKD = eager.call(torch.ops.moe.unpermute.default, grad_x_ND, order_N, top_k)
    return grad_x_TKD.squeeze(1) if top_k == 1 else grad_x_TKD.sum(dim=1)


def _permute_bwd(ctx, grad_x_ND, _grad_counts, _grad_order):
    (order_N,) = ctx.saved_tensors
    return permute_backward(grad_x_ND, order_N, ctx.top_k), None, None


PERMUTE_SCHEMA = OpSchema("permute", "Tensor x_TD, Tensor experts_TK, SymInt num_experts",
                          "(Tensor, Tensor, Tensor)", fake=_permute_fake, autograd=(_permute_bwd, _permute_setup))
permute = PERMUTE_SCHEMA.define(NAMESPACE, permute_ref)


def _unpermute_fake(y_ND, order_N, top_k):
    N, D = y_ND.shape
    if order_N.shape != (N,):
        raise ValueError(f"moe.unpermute: order_N has shape {tuple(order_N.shape)}, expected (N={N},)")
    return y_ND.new_empty(N // top_k, top_k, D)


def _unpermute_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def unpermute_backward(grad_y_TKD: Tensor, order_N: Tensor) -> Tensor:
    """grad_y_ND of `unpermute`: the gradient rows gathered back into expert order."""
    return grad_y_TKD.reshape(-1, grad_y_TKD.shape[-1]).index_select(0, order_N)


def _unpermute_bwd(ctx, grad_y_TKD):
    (order_N,) = ctx.saved_tensors
    return unpermute_backward(grad_y_TKD, order_N), None, None


UNPERMUTE_SCHEMA = OpSchema("unpermute", "Tensor y_ND, Tensor order_N, SymInt top_k", "Tensor",
                            fake=_unpermute_fake, autograd=(_unpermute_bwd, _unpermute_setup))
unpermute = UNPERMUTE_SCHEMA.define(NAMESPACE, unpermute_ref)


def _combine_fake(y_TKD, weights_TK):
    T, K, D = y_TKD.shape
    if weights_TK.shape != (T, K):
        raise ValueError(f"moe.combine: weights_TK has shape {tuple(weights_TK.shape)}, expected (T={T}, K={K})")
    return y_TKD.new_empty(T, D)


def _combine_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def combine_backward(grad_TD: Tensor, y_TKD: Tensor, weights_TK: Tensor) -> tuple[Tensor, Tensor]:
    """(grad_y_TKD, grad_weights_TK) of `combine`, in fp32 (or wider), returned in the inputs' dtypes."""
    acc = accumulation_dtype(y_TKD)
    g_TD = grad_TD.to(acc)
    grad_y = (g_TD.unsqueeze(1) * weights_TK.to(acc).unsqueeze(-1)).to(y_TKD.dtype)
    grad_w = (y_TKD.to(acc) * g_TD.unsqueeze(1)).sum(-1).to(weights_TK.dtype)
    return grad_y, grad_w


def _combine_bwd(ctx, grad_TD):
    return combine_backward(grad_TD, *ctx.saved_tensors)


COMBINE_SCHEMA = OpSchema("combine", "Tensor y_TKD, Tensor weights_TK", "Tensor", fake=_combine_fake,
                          autograd=(_combine_bwd, _combine_setup), autocast="fp32")
combine = COMBINE_SCHEMA.define(NAMESPACE, combine_ref)




# The block's output in the autocast dtype under autocast (`MoESpec.autocast_output`: the block returns its experts'
# outputs as they come, not an fp32 sum), else itself: a view (no copy); the autocast kernel casts the input first.
_OUTPUT_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_OUTPUT_LIB.define("autocast_output(Tensor(a) out) -> Tensor(a)")
_OUTPUT_LIB.impl("autocast_output", lambda out: out.view_as(out), "CompositeImplicitAutograd")
AUTOCAST_OUTPUT = torch.ops.moe.autocast_output.default
register_autocast(AUTOCAST_OUTPUT, "compute")


def autocast_output_eager(out: Tensor) -> Tensor:
    """What the op does, without the dispatcher (the eager path)."""
    device = out.device.type
    return out.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else out.view_as(out)


eager.register(AUTOCAST_OUTPUT, eager.EagerOp(AUTOCAST_OUTPUT, autocast_output_eager))

# Autocast (each schema's policy): the router in fp32, the experts in the autocast compute dtype, the combine in
# fp32 (the weighted sum of the experts' outputs, as a block accumulating into a buffer of its fp32 input does).
SCHEMAS = {schema.name: schema for schema in (
    ROUTE_SCHEMA, UPDATE_SELECTION_BIAS_SCHEMA, COUNT_LOAD_SCHEMA, CAPACITY_KEEP_SCHEMA, PERMUTE_SCHEMA,
    EXPERT_FFN_SCHEMA, EXPERT_FFN_FORWARD_SCHEMA, EXPERT_FFN_BACKWARD_SCHEMA, UNPERMUTE_SCHEMA, COMBINE_SCHEMA)}

# Ops of the dialect, by role (the verifier and the passes use these sets).
ROUTE = torch.ops.moe.route.default
CAPACITY_KEEP = torch.ops.moe.capacity_keep.default
PERMUTE = torch.ops.moe.permute.default
EXPERT_FFN = torch.ops.moe.expert_ffn.default
UNPERMUTE = torch.ops.moe.unpermute.default
COMBINE = torch.ops.moe.combine.default
UPDATE_SELECTION_BIAS = torch.ops.moe.update_selection_bias.default
COUNT_LOAD = torch.ops.moe.count_load.default
DIALECT_OPS = frozenset({ROUTE, CAPACITY_KEEP, PERMUTE, EXPERT_FFN, UNPERMUTE, COMBINE, UPDATE_SELECTION_BIAS,
                         COUNT_LOAD})


def is_dialect_op(target: object) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == NAMESPACE
