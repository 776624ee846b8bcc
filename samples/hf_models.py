"""Tiny random-init Hugging Face transformers 5.x MoE models, built from configs (no weights are
downloaded), shared by the tests and the demos.

Each builder returns `(model, batch)` where `batch` holds the keyword inputs of one training step
(`input_ids`, `labels`, and for the encoder-decoder Switch model `decoder_input_ids`). Sizes are
tiny: hidden 32, 2-3 layers, E 4-8, vocab 64, sequence 8. `MOE_BLOCKS[family]` is the number of MoE
blocks each model has (DeepSeek-V3's first layer is dense).
"""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, SEQ, BATCH = 64, 8, 2

COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, attn_implementation="eager")


def _config(name: str, **kw):
    import transformers

    return getattr(transformers, name)(**kw)


def mixtral(jitter: float = 0.0):
    return _config("MixtralConfig", **COMMON, intermediate_size=48, num_hidden_layers=2, num_local_experts=4,
                   num_experts_per_tok=2, router_jitter_noise=jitter)


def qwen2_moe():
    return _config("Qwen2MoeConfig", **COMMON, intermediate_size=48, moe_intermediate_size=24,
                   shared_expert_intermediate_size=40, num_hidden_layers=2, num_experts=6, num_experts_per_tok=2,
                   norm_topk_prob=False)


def qwen3_moe():
    return _config("Qwen3MoeConfig", **COMMON, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
                   num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, head_dim=8)


def olmoe():
    return _config("OlmoeConfig", **COMMON, intermediate_size=24, num_hidden_layers=2, num_experts=8,
                   num_experts_per_tok=2, norm_topk_prob=False)


def deepseek_v3():
    return _config("DeepseekV3Config", **{**COMMON, "num_key_value_heads": 4}, intermediate_size=48,
                   moe_intermediate_size=16, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8,
                   num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                   norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                   v_head_dim=8)


def switch(jitter: float = 0.0, dropout: float = 0.0, expert_capacity: int = 3):
    return _config("SwitchTransformersConfig", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_heads=4,
                   num_layers=2, num_decoder_layers=2, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                   encoder_sparse_step=2, decoder_sparse_step=2, num_experts=4, expert_capacity=expert_capacity,
                   router_jitter_noise=jitter, dropout_rate=dropout, decoder_start_token_id=0, pad_token_id=0,
                   attn_implementation="eager")


CONFIGS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "olmoe": olmoe,
           "deepseek_v3": deepseek_v3, "switch": switch}
MOE_BLOCKS = {"mixtral": 2, "qwen2_moe": 2, "qwen3_moe": 2, "olmoe": 2, "deepseek_v3": 2, "switch": 2}
DENSE_BLOCKS = {"deepseek_v3": ["model.layers.0.mlp"]}


def build(family: str, seed: int = 0, **config_kw) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The tiny random-init model of `family` (fp32, train mode) and one training batch."""
    import transformers

    config = CONFIGS[family](**config_kw)
    torch.manual_seed(seed)
    if family == "switch":
        model = transformers.SwitchTransformersForConditionalGeneration(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    batch = {"input_ids": ids, "labels": torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)}
    if family == "switch":
        batch["decoder_input_ids"] = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    return model, batch
