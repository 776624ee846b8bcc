"""MoE blocks written for moepass: plain PyTorch modules that describe themselves (`moepass_spec`).

- `MultiHeadLatentMoE`: Multi-Head LatentMoE (arXiv 2602.04870), per-head routers and experts over
  latent sub-tokens, with aux-loss-free selection-bias balancing.
"""

from moepass.nn.latent_moe import MultiHeadLatentMoE

__all__ = ["MultiHeadLatentMoE"]
