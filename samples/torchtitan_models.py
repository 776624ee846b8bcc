"""Tiny torchtitan MoE layers (torchtitan 0.3.0, `torchtitan.models.common.moe.MoE`), random-initialised.

    from samples import torchtitan_models as TT
    block = TT.moe_block(TT.VARIANTS["softmax"])

torchtitan is an optional dependency (installed `--no-deps` beside the pinned torch; see
`.ci/run`). Its `GroupedExperts` casts activations and weights to bf16 for `torch._grouped_mm` (moepass
reproduces that: `ExpertsSpec.compute_dtype`, `moe_block(v, bf16_experts=True)`); to compare in fp32 too, the
experts here run the same math without the cast by default (`FP32GroupedExperts`).

Shape letters as moepass's (`moepass.spec.SHAPES`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

try:  # torchtitan chooses its device type at import: the tests build on CPU
    import torchtitan.distributed.parallel_dims as _parallel_dims
    import torchtitan.tools.utils as _tt_utils
    from torchtitan.models.common import config_utils as _cfg
    from torchtitan.models.common import linear as _linear
    from torchtitan.models.common import moe as _moe
    from torchtitan.models.common.feed_forward import FeedForward

    if not torch.cuda.is_available():
        _parallel_dims.device_type = "cpu"
        _tt_utils.device_type = "cpu"
    AVAILABLE, WHY_NOT = True, ""
except ImportError as err:  # pragma: no cover - depends on the environment
    AVAILABLE, WHY_NOT = False, f"torchtitan is not importable: {err}"


@dataclass(frozen=True)
class Variant:
    score_func: str = "softmax"
    route_norm: bool = False
    load_balance_coeff: float | None = None  # set: the expert-bias buffer (aux-loss-free balancing)
    shared_experts: bool = False
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    route_scale: float = 1.0
    dim: int = 32
    hidden_dim: int = 48
    num_experts: int = 8
    top_k: int = 2


VARIANTS = {
    "softmax": Variant("softmax"),
    "sigmoid": Variant("sigmoid"),
    "sigmoid_route_norm": Variant("sigmoid", route_norm=True),
    "softmax_route_norm": Variant("softmax", route_norm=True),
    "expert_bias": Variant("sigmoid", route_norm=True, load_balance_coeff=1e-3),
    "shared_experts": Variant("softmax", shared_experts=True),
    "group_limited": Variant("sigmoid", route_norm=True, load_balance_coeff=1e-3, num_expert_groups=4,
                             num_limited_groups=2, route_scale=2.5),
}


if AVAILABLE:

    class FP32GroupedExperts(_moe.GroupedExperts):
        """torchtitan's GroupedExperts with the same grouped-GEMM math in the input's dtype (no bf16 cast)."""

        def forward(self, x_ND: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            w1, w2, w3 = self.w1_EFD, self.w2_EDF, self.w3_EFD
            h_NF = F.silu(self._grouped_mm(A=x_ND, B_t=w1.transpose(-2, -1), offs=offsets_E))
            h_NF = h_NF * self._grouped_mm(A=x_ND, B_t=w3.transpose(-2, -1), offs=offsets_E)
            return self._grouped_mm(A=h_NF, B_t=w2.transpose(-2, -1), offs=offsets_E).type_as(x_ND)


def config(v: Variant):
    """torchtitan's MoE.Config for the variant (its own `make_*_config` helpers)."""
    if not AVAILABLE:
        raise RuntimeError(WHY_NOT)
    init = {"weight": lambda w: nn.init.normal_(w, std=0.02)}
    router = _cfg.make_router_config(dim=v.dim, num_experts=v.num_experts, gate_param_init=init, top_k=v.top_k,
                                     score_func=v.score_func, route_norm=v.route_norm, route_scale=v.route_scale,
                                     num_expert_groups=v.num_expert_groups, num_limited_groups=v.num_limited_groups)
    experts = _moe.RoutedExperts.Config(
        inner_experts=_moe.GroupedExperts.Config(dim=v.dim, hidden_dim=v.hidden_dim, num_experts=v.num_experts),
        token_dispatcher=_cfg.make_token_dispatcher_config(num_experts=v.num_experts, top_k=v.top_k,
                                                           comm_backend="standard"))
    shared = None
    if v.shared_experts:
        linear = _linear.Linear.Config
        shared = FeedForward.Config(w1=linear(in_features=v.dim, out_features=v.hidden_dim),
                                    w2=linear(in_features=v.hidden_dim, out_features=v.dim),
                                    w3=linear(in_features=v.dim, out_features=v.hidden_dim))
    return _cfg.make_moe_config(num_experts=v.num_experts, router=router, routed_experts=experts,
                                shared_experts=shared, load_balance_coeff=v.load_balance_coeff)


def moe_block(v: Variant, seed: int = 0, bf16_experts: bool = False) -> nn.Module:
    """A torchtitan MoE layer with random weights (fp32, CPU), its experts computing in fp32, or with
    `bf16_experts` as torchtitan ships them: in bf16 (x and the fp32 weights cast, the result cast back)."""
    block = config(v).build()
    if not bf16_experts:
        block.routed_experts.inner_experts.__class__ = FP32GroupedExperts
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() < 3 else p.shape[-1] ** -0.5))
        if getattr(block, "expert_bias_E", None) is not None:
            block.expert_bias_E.copy_(torch.randn(v.num_experts, generator=gen) * 0.05)
    return block
