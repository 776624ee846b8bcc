"""Hand-written MoE models in the three styles moepass recognises, and a tiny Mixtral-like LM.

These are written the way people write MoE layers by hand, *not* in terms of moepass: moepass must
find them, describe them with an MoESpec and prove the description right before rewriting them.

- `LoopMoE`: ModuleList of expert MLPs, a Python loop over experts (Mixtral reference style).
- `FusedMoE`: fused 3-D expert weights with batched matmul, softmax over the top-k logits, and a
  sigmoid-gated shared expert (Qwen-MoE style).
- `GShardMoE`: GShard-style one-hot einsum dispatch with expert capacity (drops overflow tokens).

Shape letters as moepass's (`moepass.spec.SHAPES`; c: an expert's capacity).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class ExpertMLP(nn.Module):
    """SwiGLU (or GeLU/ReLU when `gated=False`) feed-forward expert."""

    def __init__(self, dim: int, ffn_dim: int, gated: bool = True, act: str = "silu", bias: bool = False):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=bias)
        self.w3 = nn.Linear(dim, ffn_dim, bias=bias) if gated else None
        self.w2 = nn.Linear(ffn_dim, dim, bias=bias)
        self.act = {"silu": nn.SiLU(), "gelu": nn.GELU(), "relu": nn.ReLU()}[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.w1(x))
        if self.w3 is not None:
            h = h * self.w3(x)
        return self.w2(h)


class LoopMoE(nn.Module):
    """Softmax router → top-k → (renormalise) → loop over experts."""

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, top_k: int, renormalize: bool = True,
                 act: str = "silu", gated: bool = True):
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(dim, ffn_dim, gated, act) for _ in range(num_experts))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x_TD = hidden_states.reshape(-1, shape[-1])
        logits_TE = F.linear(x_TD.float(), self.gate.weight.float())  # router in fp32
        probs_TE = logits_TE.softmax(dim=-1)
        weights_TK, experts_TK = probs_TE.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        out_TD = torch.zeros_like(x_TD)
        for e, expert in enumerate(self.experts):
            token_idx, choice_idx = torch.where(experts_TK == e)
            if token_idx.numel() == 0:
                continue
            y = expert(x_TD[token_idx]) * weights_TK[token_idx, choice_idx, None]
            out_TD.index_add_(0, token_idx, y.to(out_TD.dtype))
        return out_TD.reshape(shape)


class SharedMLP(nn.Module):
    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 2 * ffn_dim, bias=False)
        self.down = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class FusedMoE(nn.Module):
    """Fused 3-D expert weights; top-k logits then softmax; sigmoid-gated shared expert."""

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, top_k: int, shared_ffn_dim: int | None = None):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.randn(num_experts, dim, 2 * ffn_dim) / math.sqrt(dim))  # [E, D, 2F]
        self.w_down = nn.Parameter(torch.randn(num_experts, ffn_dim, dim) / math.sqrt(ffn_dim))  # [E, F, D]
        self.shared_expert = SharedMLP(dim, shared_ffn_dim) if shared_ffn_dim else None
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if shared_ffn_dim else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x_TD = hidden_states.reshape(-1, shape[-1])
        logits_TE = F.linear(x_TD.float(), self.router.weight.float())
        top_logits_TK, experts_TK = logits_TE.topk(self.top_k, dim=-1)
        weights_TK = top_logits_TK.softmax(dim=-1)
        # every token through every selected expert with batched matmul over the K choices
        w_gate_up_TKDF = self.w_gate_up[experts_TK]  # [T, K, D, 2F]
        w_down_TKFD = self.w_down[experts_TK]  # [T, K, F, D]
        x_TK1D = x_TD[:, None, None, :].expand(-1, self.top_k, 1, -1)
        gate, up = torch.matmul(x_TK1D, w_gate_up_TKDF).chunk(2, dim=-1)
        y_TKD = torch.matmul(F.silu(gate) * up, w_down_TKFD).squeeze(2)
        out_TD = (y_TKD * weights_TK[..., None].to(y_TKD.dtype)).sum(dim=1)
        if self.shared_expert is not None:
            out_TD = out_TD + torch.sigmoid(self.shared_expert_gate(x_TD)) * self.shared_expert(x_TD)
        return out_TD.reshape(shape)


class GShardMoE(nn.Module):
    """GShard top-2 with capacity: one-hot dispatch/combine tensors and einsums; overflow dropped."""

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, top_k: int = 2, capacity_factor: float = 1.0):
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.wg = nn.Linear(dim, num_experts, bias=True)
        self.wi = nn.Parameter(torch.randn(num_experts, dim, ffn_dim) / math.sqrt(dim))  # [E, D, F]
        self.bi = nn.Parameter(torch.zeros(num_experts, ffn_dim))
        self.wo = nn.Parameter(torch.randn(num_experts, ffn_dim, dim) / math.sqrt(ffn_dim))  # [E, F, D]
        self.bo = nn.Parameter(torch.zeros(num_experts, dim))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x_TD = hidden_states.reshape(-1, shape[-1])
        T, E, K = x_TD.shape[0], self.num_experts, self.top_k
        capacity = math.ceil(self.capacity_factor * T * K / E)
        probs_TE = self.wg(x_TD.float()).softmax(dim=-1)
        gates_TK, experts_TK = probs_TE.topk(K, dim=-1)
        gates_TK = gates_TK / gates_TK.sum(dim=-1, keepdim=True)
        # priority: every token's first choice, then every second choice (k-major)
        mask_KTE = F.one_hot(experts_TK.t(), E)
        position_KTE = (torch.cumsum(mask_KTE.reshape(K * T, E), dim=0).reshape(K, T, E) - 1) * mask_KTE
        mask_KTE = mask_KTE * (position_KTE < capacity)
        slot_KTEc = F.one_hot(position_KTE.clamp(0, capacity - 1), capacity) * mask_KTE[..., None]
        combine_TEc = torch.einsum("kt,ktec->tec", gates_TK.t(), slot_KTEc.float())
        dispatch_TEc = combine_TEc > 0
        x_EcD = torch.einsum("tec,td->ecd", dispatch_TEc.to(x_TD.dtype), x_TD)
        h_EcF = F.gelu(torch.einsum("ecd,edf->ecf", x_EcD, self.wi) + self.bi[:, None, :])
        y_EcD = torch.einsum("ecf,efd->ecd", h_EcF, self.wo) + self.bo[:, None, :]
        out_TD = torch.einsum("tec,ecd->td", combine_TEc.to(y_EcD.dtype), y_EcD)
        return out_TD.reshape(shape)


# ----------------------------------------------------------------------------------------------
# A tiny Mixtral-like language model.
# ----------------------------------------------------------------------------------------------


@dataclass
class SampleConfig:
    vocab_size: int = 256
    dim: int = 64
    ffn_dim: int = 128
    num_experts: int = 8
    top_k: int = 2
    layers: int = 2
    heads: int = 4
    style: str = "loop"  # "loop", "fused", "gshard" or "mixed" (cycles through the three)
    dense_layers: int = 0  # the first layers use a dense MLP (DeepSeek-style)
    capacity_factor: float = 1.25


def make_moe(style: str, cfg: SampleConfig) -> nn.Module:
    if style == "loop":
        return LoopMoE(cfg.dim, cfg.ffn_dim, cfg.num_experts, cfg.top_k)
    if style == "fused":
        return FusedMoE(cfg.dim, cfg.ffn_dim, cfg.num_experts, cfg.top_k, shared_ffn_dim=cfg.ffn_dim)
    if style == "gshard":
        return GShardMoE(cfg.dim, cfg.ffn_dim, cfg.num_experts, cfg.top_k, cfg.capacity_factor)
    raise ValueError(f"SampleConfig.style={style!r} is invalid: use 'loop', 'fused', 'gshard' or 'mixed'")


def routed_loop_moe(dim: int, num_experts: int) -> LoopMoE:
    """A top-2 LoopMoE whose router picks, for an input `onehot(a) + 0.9 onehot(b)` (a, b < num_experts <= dim),
    expert a then expert b: a routing the tests choose token by token."""
    block = LoopMoE(dim, 2 * dim, num_experts, top_k=2)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[:, :num_experts] = 10 * torch.eye(num_experts)
    return block


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(x_BSD).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(B, S, D))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: SampleConfig, mlp: nn.Module):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.heads)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyMoELM(nn.Module):
    """Embedding → layers of (attention, MoE) → norm → LM head."""

    def __init__(self, cfg: SampleConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or SampleConfig()
        styles = ["loop", "fused", "gshard"]
        layers = []
        for i in range(cfg.layers):
            if i < cfg.dense_layers:
                mlp: nn.Module = ExpertMLP(cfg.dim, cfg.ffn_dim)
            else:
                mlp = make_moe(styles[i % 3] if cfg.style == "mixed" else cfg.style, cfg)
            layers.append(DecoderLayer(cfg, mlp))
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens_BS)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))

    def loss(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        logits = self(tokens_BS[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens_BS[:, 1:].reshape(-1))


def tiny_mixtral(**overrides) -> TinyMoELM:
    """The built-in demo model: a 2-layer Mixtral-like LM with 8 experts, top-2."""
    return TinyMoELM(SampleConfig(**overrides))


def tiny_latent_lm(heads: int = 4, head_dim: int = 16, experts: int = 4, top_k: int = 2, latent_ffn_dim: int = 32,
                   activation: str = "gelu", bias_update_rate: float = 1e-3, **overrides) -> TinyMoELM:
    """The demo LM with every MoE layer a Multi-Head LatentMoE (`moepass.nn.MultiHeadLatentMoE`: H heads
    of width h, `experts` per head, top-k per sub-token); dense layers (`dense_layers`) stay dense."""
    from moepass.nn import MultiHeadLatentMoE

    model = TinyMoELM(SampleConfig(**overrides))
    cfg = model.cfg
    for i, layer in enumerate(model.layers):
        if i >= cfg.dense_layers:
            layer.mlp = MultiHeadLatentMoE(cfg.dim, heads=heads, head_dim=head_dim, experts=experts, top_k=top_k,
                                           ffn_dim=latent_ffn_dim, activation=activation,
                                           bias_update_rate=bias_update_rate)
    return model
