"""Multi-Head LatentMoE (arXiv 2602.04870): an MoE block that routes latent sub-tokens, not tokens.

A token x (width D) is projected to H heads of width h (`w_in`, W_mh: D -> H*h). Each head has its own
router (E experts per head, `router` [H, E, h]) and its own E expert MLPs (hidden width m). A head's
sub-token goes to the top-K of its own head's experts; the weighted sum of their outputs, for all
heads side by side, is projected back (`w_out`, W_mg: H*h -> D).

    z_THh = w_in(x_TD).view(T, H, h)
    logits_THE[t, j] = z_THh[t, j] @ router[j].T                      (fp32)
    experts_THK = top-K of (logits_THE + selection_bias[j])           selection only
    weights_THK = softmax of the K selected *unbiased* logits
    y_THh[t, j] = sum_k weights_THK[t, j, k] * expert[j*E + experts_THK[t, j, k]](z_THh[t, j])
    out_TD = w_out(y_THh.view(T, H*h))

Experts are stored flattened head-major (head j owns experts j*E .. j*E+E-1): `w_up` [H*E, m, h]
(and `w_gate` [H*E, m, h] for swiglu: silu(gate) * up), `w_down` [H*E, h, m] — the layouts of
`moe.expert_ffn`, so a compiled graph reads them without a copy.

Aux-loss-free balancing (DeepSeek-V3, arXiv 2412.19437 §2.1.2): `selection_bias` [H, E] is a buffer,
not a parameter. It only changes which experts are selected, never the weights. After every forward
in train mode, under `torch.no_grad()`, each head's expert loads (how many of the T*K choices of that
head picked the expert) are compared with the head's mean load T*K/E:

    selection_bias[j, e] += bias_update_rate * sign(T*K/E - load[j, e])

so overloaded experts become less attractive and idle ones more. Eval mode never updates it. (A
forward recomputed by activation checkpointing updates it again: it counts as another forward.)

The block describes itself to moepass (`moepass_spec`): detection still checks that description
against this forward on probe inputs before anything is compiled.

Shape letters: `moepass.spec.SHAPES` (G = T*H sub-tokens, X = H*E experts in all; the expert hidden width
is `ffn_dim`, m in the paper).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moepass.spec import ExpertsSpec, HeadsSpec, MoESpec, RouterSpec, TensorSource

LATENT_ACTIVATIONS = ("gelu", "swiglu")


class MultiHeadLatentMoE(nn.Module):
    """Multi-Head LatentMoE block: [..., D] -> [..., D] (see the module docstring)."""

    selection_bias: torch.Tensor  # buffer [H, E]
    w_gate: nn.Parameter | None  # swiglu only

    def __init__(self, dim: int, heads: int, head_dim: int, experts: int, top_k: int, ffn_dim: int,
                 activation: str = "gelu", bias_update_rate: float = 1e-3):
        super().__init__()
        if activation not in LATENT_ACTIVATIONS:
            raise ValueError(f"MultiHeadLatentMoE: activation={activation!r} is invalid: use one of "
                             f"{list(LATENT_ACTIVATIONS)}")
        for name, value in (("dim", dim), ("heads", heads), ("head_dim", head_dim), ("experts", experts),
                            ("ffn_dim", ffn_dim)):
            if value < 1:
                raise ValueError(f"MultiHeadLatentMoE: {name}={value} is invalid: use a positive size")
        if not 1 <= top_k <= experts:
            raise ValueError(f"MultiHeadLatentMoE: top_k={top_k} is invalid: use 1..experts={experts} "
                             f"(experts are per head)")
        if bias_update_rate < 0:
            raise ValueError(f"MultiHeadLatentMoE: bias_update_rate={bias_update_rate} is invalid: use a rate >= 0")
        self.dim, self.heads, self.head_dim, self.num_experts = dim, heads, head_dim, experts
        self.top_k, self.ffn_dim, self.activation = top_k, ffn_dim, activation
        self.bias_update_rate = bias_update_rate
        X = heads * experts
        self.w_in = nn.Linear(dim, heads * head_dim, bias=False)  # W_mh
        self.router = nn.Parameter(torch.randn(heads, experts, head_dim) / math.sqrt(head_dim))  # [H, E, h]
        self.register_buffer("selection_bias", torch.zeros(heads, experts))  # [H, E], selection only
        self.w_gate = (nn.Parameter(torch.randn(X, ffn_dim, head_dim) / math.sqrt(head_dim))
                       if activation == "swiglu" else None)  # [X, m, h]
        self.w_up = nn.Parameter(torch.randn(X, ffn_dim, head_dim) / math.sqrt(head_dim))  # [X, m, h]
        self.w_down = nn.Parameter(torch.randn(X, head_dim, ffn_dim) / math.sqrt(ffn_dim))  # [X, h, m]
        self.w_out = nn.Linear(heads * head_dim, dim, bias=False)  # W_mg

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, heads={self.heads}, head_dim={self.head_dim}, experts={self.num_experts}/head, "
                f"top_k={self.top_k}, ffn_dim={self.ffn_dim}, activation={self.activation!r}, "
                f"bias_update_rate={self.bias_update_rate:g}")

    def expert(self, index: int, rows_Mh: torch.Tensor) -> torch.Tensor:
        """Expert `index` (global, head-major) on rows of sub-tokens [M, h] -> [M, h]."""
        up = F.linear(rows_Mh, self.w_up[index])
        if self.w_gate is None:
            a = F.gelu(up)
        else:
            a = F.silu(F.linear(rows_Mh, self.w_gate[index])) * up
        return F.linear(a, self.w_down[index])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        H, h, E, K = self.heads, self.head_dim, self.num_experts, self.top_k
        x_TD = hidden_states.reshape(-1, self.dim)
        T = x_TD.shape[0]
        z_THh = self.w_in(x_TD).view(T, H, h)

        # per-head routers in fp32; the bias picks the experts, the unbiased logits weigh them
        logits_THE = torch.einsum("thc,hec->the", z_THh.float(), self.router.float())
        choice_THE = logits_THE.detach() + self.selection_bias.float()
        experts_THK = choice_THE.topk(K, dim=-1).indices
        weights_THK = logits_THE.gather(-1, experts_THK).softmax(dim=-1)

        # every sub-token through the K experts of its own head: head j's expert e is j*E + e
        z_Gh = z_THh.reshape(T * H, h)
        ids_GK = (experts_THK + torch.arange(H, device=x_TD.device).view(1, H, 1) * E).reshape(T * H, K)
        weights_GK = weights_THK.reshape(T * H, K)
        y_Gh = torch.zeros_like(z_Gh)
        for expert in range(H * E):
            rows, choice = torch.where(ids_GK == expert)
            if rows.numel() == 0:
                continue
            y_Mh = self.expert(expert, z_Gh[rows]) * weights_GK[rows, choice, None]
            y_Gh.index_add_(0, rows, y_Mh.to(y_Gh.dtype))

        if self.training and self.bias_update_rate > 0:
            self.update_selection_bias(experts_THK)
        return self.w_out(y_Gh.view(T, H * h)).reshape(shape)

    @torch.no_grad()
    def update_selection_bias(self, experts_THK: torch.Tensor) -> None:
        """One aux-loss-free balancing step from this forward's selection (see the module docstring)."""
        T, H, K = experts_THK.shape
        E = self.num_experts
        load_HE = torch.zeros(H, E, device=experts_THK.device)
        load_HE.scatter_add_(1, experts_THK.permute(1, 0, 2).reshape(H, T * K),
                             torch.ones(H, T * K, device=experts_THK.device))
        self.selection_bias.add_(torch.sign(T * K / E - load_HE).to(self.selection_bias.dtype), alpha=self.bias_update_rate)

    def moepass_spec(self, path: str) -> MoESpec:
        """moepass's self-description protocol: "I am an MoE block, here is my spec" (detection still
        verifies it against `forward` on probe inputs)."""
        H, h, E = self.heads, self.head_dim, self.num_experts
        gated = self.w_gate is not None
        return MoESpec(
            path=path,
            recogniser="moepass_spec",
            router=RouterSpec(
                num_experts=E, top_k=self.top_k, score_func="softmax", softmax_before_topk=False,
                renormalize=False, dtype="float32", weight=TensorSource.param("router"),
                selection_bias=TensorSource.param("selection_bias"), bias_update_rate=self.bias_update_rate,
            ),
            experts=ExpertsSpec(  # gelu: one projection (`w_up`) in the gate slot; swiglu: silu(w_gate) * w_up
                num_experts=H * E, hidden_dim=h, ffn_dim=self.ffn_dim, activation=self.activation,  # type: ignore[arg-type]
                w_gate=TensorSource.param("w_gate" if gated else "w_up"),
                w_up=TensorSource.param("w_up") if gated else None,
                w_down=TensorSource.param("w_down"), container="",
            ),
            heads=HeadsSpec(num_heads=H, head_dim=h, model_dim=self.dim, w_in=TensorSource.param("w_in.weight"),
                            w_out=TensorSource.param("w_out.weight")),
        )
