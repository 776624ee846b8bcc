"""The models `samples/train.py --model` trains besides the sample LM: a Hugging Face causal LM built from its
config (no weights), and a torchtitan Qwen3-MoE model, both tiny and on the byte vocabulary (256).

    --model hf:qwen3_moe            # a tiny config of samples/hf_models.py (mixtral, qwen2_moe, qwen3_moe, olmoe,
                                    # deepseek_v3), vocabulary set to 256
    --model hf:<hub id or folder>   # transformers.AutoConfig.from_pretrained (offline: a local folder or the
                                    # hub cache), vocabulary set to 256; built at the config's own sizes
    --model torchtitan              # torchtitan's Qwen3Model (0.3.0) with MoE layers from its public config
                                    # helpers: dim 64, 2 layers, 8 experts, top-2, softmax + route_norm,
                                    # causal SDPA attention

Both are built from `seed`, identical on every rank. torchtitan's `GroupedExperts` casts to bf16 for its grouped
GEMM; the experts here compute the same math in fp32 (`samples.torchtitan_models.FP32GroupedExperts`), so the
recipe's `--reference` compares in fp32.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

VOCAB = 256


def hf_lm(name: str, seed: int) -> nn.Module:
    """A Hugging Face causal LM of config `name` (module doc), random weights from `seed`."""
    import transformers

    from samples import hf_models

    if name in hf_models.CONFIGS and name != "switch":
        config = hf_models.CONFIGS[name]()
    else:
        try:
            config = transformers.AutoConfig.from_pretrained(name)
        except OSError as err:
            raise SystemExit(f"--model hf:{name}: no such tiny config ({', '.join(sorted(hf_models.CONFIGS))}) and "
                             f"transformers could not load it offline ({err}); pass a folder holding config.json "
                             f"or a hub id already in the cache") from err
    config.vocab_size = VOCAB
    torch.manual_seed(seed)
    try:
        return transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as err:
        raise SystemExit(f"--model hf:{name}: {type(config).__name__} is not a causal LM ({err}); pass a decoder "
                         f"config") from err


def torchtitan_lm(seed: int, dim: int = 64, layers: int = 2, heads: int = 4, experts: int = 8, top_k: int = 2,
                  ffn_dim: int = 128, seq: int = 512) -> nn.Module:
    """torchtitan's Qwen3Model with MoE layers (module doc), random weights from `seed`, experts in fp32."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common import config_utils as cfg
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3TransformerBlock

    from samples import torchtitan_models

    init = {"weight": functools.partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
    ones = {"weight": nn.init.ones_}
    head_dim = dim // heads

    def norm(width: int) -> Any:
        return RMSNorm.Config(normalized_shape=width, eps=1e-6, param_init=ones)

    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=seq, theta=1_000_000.0)
    blocks = [Qwen3TransformerBlock.Config(
        attention_norm=norm(dim), ffn_norm=norm(dim),
        attention=cfg.make_gqa_config(dim=dim, n_heads=heads, n_kv_heads=heads // 2, head_dim=head_dim,
                                      wqkv_param_init=init, wo_param_init=init,
                                      inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=True, rope=rope,
                                      qk_norm=norm(head_dim)),
        moe=cfg.make_moe_config(
            num_experts=experts, load_balance_coeff=None,
            router=cfg.make_router_config(dim=dim, num_experts=experts, gate_param_init=init, top_k=top_k,
                                          score_func="softmax", route_norm=True),
            routed_experts=cfg.make_routed_experts_config(
                dim=dim, hidden_dim=ffn_dim, num_experts=experts, top_k=top_k,
                param_init={"w1_EFD": init["weight"], "w2_EDF": init["weight"], "w3_EFD": init["weight"]},
                comm_backend="standard")))
        for _ in range(layers)]
    config = Qwen3Model.Config(vocab_size=VOCAB, dim=dim, norm=norm(dim),
                               tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                                               param_init=init),
                               lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=init),
                               layers=blocks)
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.__class__ = torchtitan_models.FP32GroupedExperts
    return CausalLM(model)


class CausalLM(nn.Module):
    """tokens [B, S] -> logits [B, S, V] of a torchtitan decoder: positions 0..S-1 per sequence (its attention
    is torchtitan's causal SDPA module: flex attention has no CPU backward, and every packed sequence here is
    one document)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        B, S = tokens.shape
        positions = torch.arange(S, device=tokens.device).expand(B, S)
        return self.model(tokens, positions, None)
