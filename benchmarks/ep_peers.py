"""The expert-parallel peers of moepass, each in its fastest configuration, built on a loaded Hugging Face
Mixtral MoE block (issue 32): what `ep_layer.py` and `ep_step.py` time against `moepass.compile(block,
Plan(form="ep"))`.

  transformers_a2a  transformers' own EP without FSDP: `transformers.distributed.expert_parallel.
                    apply_expert_parallelism(block, mesh["ep"], mesh["tp"], {"experts.gate_up_proj":
                    "grouped_gemm", "experts.down_proj": "grouped_gemm", "experts": "ep_dispatch_experts"},
                    ep_implementation="all_to_all")` on the block, its experts run by `_experts_implementation=
                    "grouped_mm"` (one `torch._grouped_mm` per projection); mesh (ep=W, tp=1).
  torchtitan_ep     torchtitan 0.3.0's `MoE` (softmax router, route_norm: Mixtral's routing) holding the same
                    weights (w1 / w3 = the gate / up halves of `gate_up_proj`, w2 = `down_proj`), its sharding
                    config set by `set_moe_sharding_config(enable_ep=True)` and `MoE.parallelize(ParallelDims(
                    dp_shard=W, ep=W, spmd_backend="partial_dtensor"))`: all-to-all token dispatcher ("standard"),
                    `GroupedExperts` with the same grouped-GEMM math in fp32 (torchtitan casts to bf16; the cast is
                    left out so every system computes in fp32, as `samples/torchtitan_models.py` does).
  moepass           `moepass.compile(block, Plan(form="ep", topology=Topology(1, W)))`, nothing else.

None of them synchronises the replicated router gradient (E x D floats; the same all-reduce for every system).
Each builder takes the block (modified in place or copied) and returns the module whose forward takes
x [B, L, D] and returns y of the same shape (or a tuple whose first element is y).
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn

PEERS = ("transformers_a2a", "torchtitan_ep")
TRANSFORMERS_PLAN = {"experts.gate_up_proj": "grouped_gemm", "experts.down_proj": "grouped_gemm",
                     "experts": "ep_dispatch_experts"}


def moepass_ep(block: nn.Module, world: int) -> nn.Module:
    import moepass

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return moepass.compile(block, moepass.Plan(form="ep", topology=moepass.Topology(1, world)))


def transformers_a2a(block: nn.Module, world: int) -> nn.Module:
    """The block with transformers' all-to-all EP applied in place (experts sharded, grouped_mm experts)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    block.experts.config._experts_implementation = "grouped_mm"  # (a deep copy's own config)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "tp"))
    apply_expert_parallelism(block, mesh["ep"], mesh["tp"], TRANSFORMERS_PLAN, ep_implementation="all_to_all")
    return block


def _fp32_grouped_experts(base: type) -> type:
    """torchtitan's GroupedExperts computing in the input's dtype (no bf16 cast), local shards under EP."""
    from torch.distributed.tensor import DTensor

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h_RF = F.silu(self._grouped_mm(A=x_RD, B_t=w1.transpose(-2, -1), offs=offs))
        h_RF = h_RF * self._grouped_mm(A=x_RD, B_t=w3.transpose(-2, -1), offs=offs)
        return self._grouped_mm(A=h_RF, B_t=w2.transpose(-2, -1), offs=offs).type_as(x_RD)

    return type("FP32GroupedExperts", (base,), {"forward": forward})


def torchtitan_ep(block: nn.Module, world: int) -> nn.Module:
    """torchtitan's MoE with the block's weights, expert-parallel over the `world` ranks."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tt_utils
    from torch.distributed.tensor import Shard
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common import config_utils as cfg
    from torchtitan.models.common import moe
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    if not torch.cuda.is_available():  # torchtitan picks its device type at import
        parallel_dims.device_type = tt_utils.device_type = "cpu"
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    E, F2, D = gate_up.shape
    K = block.gate.top_k
    router = cfg.make_router_config(dim=D, num_experts=E, gate_param_init={"weight": nn.init.zeros_}, top_k=K,
                                    score_func="softmax", route_norm=True, route_scale=1.0,
                                    num_expert_groups=None, num_limited_groups=None)
    experts = moe.RoutedExperts.Config(
        inner_experts=moe.GroupedExperts.Config(dim=D, hidden_dim=F2 // 2, num_experts=E),
        token_dispatcher=cfg.make_token_dispatcher_config(num_experts=E, top_k=K, comm_backend="standard"))
    config = cfg.make_moe_config(num_experts=E, router=router, routed_experts=experts, shared_experts=None,
                                 load_balance_coeff=None)
    set_moe_sharding_config(config, enable_ep=True, enable_sp=False,
                            expert_param_layout={"w1_EFD": Shard(1), "w2_EDF": Shard(2), "w3_EFD": Shard(1)})
    layer = config.build()
    inner = layer.routed_experts.inner_experts
    inner.__class__ = _fp32_grouped_experts(type(inner))
    with torch.no_grad():
        layer.router.gate.weight.copy_(block.gate.weight)
        inner.w1_EFD.copy_(gate_up[:, :F2 // 2])
        inner.w3_EFD.copy_(gate_up[:, F2 // 2:])
        inner.w2_EDF.copy_(down)
    set_spmd_backend("partial_dtensor")
    layer.parallelize(parallel_dims.ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=world,
                                                 world_size=world, spmd_backend="partial_dtensor"))
    layer.train()
    return layer


BUILDERS = {"moepass": moepass_ep, "transformers_a2a": transformers_a2a, "torchtitan_ep": torchtitan_ep}


def build(system: str, block: nn.Module, world: int, copy_block: bool = True) -> nn.Module:
    """`system`'s module for `block` at `world` ranks (on a deep copy of the block unless copy_block=False)."""
    return BUILDERS[system](copy.deepcopy(block) if copy_block else block, world)


def replace_blocks(model: nn.Module, system: str, world: int) -> nn.Module:
    """Every decoder layer's MoE block (`model.model.layers[i].mlp`) replaced by `system`'s module, in place."""
    for layer in model.model.layers:
        layer.mlp = build(system, layer.mlp, world, copy_block=False)
    return model


DESCRIPTIONS = {
    "moepass": "moepass.compile(block, Plan(form='ep', topology=Topology(1, W))), no DDP",
    "transformers_a2a": "transformers apply_expert_parallelism(block, mesh['ep'], mesh['tp'], "
                        + repr(TRANSFORMERS_PLAN) + ", ep_implementation='all_to_all'), experts grouped_mm, no FSDP",
    "torchtitan_ep": "torchtitan 0.3.0 MoE (same weights) set_moe_sharding_config(enable_ep=True) + "
                     "MoE.parallelize(ParallelDims(dp_shard=W, ep=W, spmd_backend='partial_dtensor')), "
                     "GroupedExperts in fp32 (no bf16 cast), standard all-to-all dispatcher",
}
