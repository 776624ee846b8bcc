"""Head parallel (HP) at run time: what the graphs of `moepass.rewrite.hp` and `moepass.rewrite.hp_ep` call —
the sub-token layout changes around the equal all-to-alls (`tokens_to_heads`, `heads_to_tokens`), the
selection-bias update over a head's replicas (`moe_hp.update_selection_bias_over_group`), and the layout
record (`HPLayout`).

Shape letters: `moepass.spec.SHAPES` (R = P*T received tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moepass import dialect
from moepass.runtime import collectives as comm
from moepass.runtime.layout import ExpertLayout


@dataclass
class HPLayout(ExpertLayout):
    """HP's layout: this rank computes heads [first_head, first_head + local_heads) (experts and routers)."""

    heads: int = 0
    local_heads: int = 0
    first_head: int = 0

    def describe(self, gm: nn.Module) -> list[str]:
        last = self.first_head + self.local_heads - 1
        return [*super().describe(gm), f"heads {self.first_head}..{last} of {self.heads} on this rank (routers, "
                f"selection bias and experts of those heads)"]


def tokens_to_heads(z_TQ: torch.Tensor, peers: int) -> torch.Tensor:
    """[T, Q] -> [P*T, Q/P]: block p holds this rank's tokens' sub-tokens for peer p's heads."""
    T, Q = z_TQ.shape
    return z_TQ.view(T, peers, Q // peers).transpose(0, 1).reshape(peers * T, Q // peers)


def heads_to_tokens(y_RQl: torch.Tensor, peers: int) -> torch.Tensor:
    """[P*T, Q/P] (block p: peer p's heads of this rank's tokens) -> [T, Q], heads in order."""
    R, Ql = y_RQl.shape
    return y_RQl.view(peers, R // peers, Ql).transpose(0, 1).reshape(R // peers, peers * Ql)


@torch.library.custom_op("moe_hp::update_selection_bias_over_group", mutates_args=("selection_bias",))
def update_selection_bias_over_group(selection_bias: Tensor, experts_GK: Tensor, rate: float, training: bool,
                                     group_name: str) -> None:
    """`moe.update_selection_bias` for heads whose sub-tokens are spread over the ranks of `group_name`:
    in train mode, the load is summed over the group (a blocking all-reduce of Hl*E counts, kind
    "bias_load") and compared with the group's mean, so every rank makes the single-device block's
    update on the concatenated batch; in eval mode nothing (no communication)."""
    if not training:
        return
    with torch.no_grad():
        Hl, E = selection_bias.shape
        rows, K = experts_GK.shape
        load_HE = dialect.head_load_ref(experts_GK, Hl, E)
        group = comm.process_group(group_name)
        peers = dist.get_world_size(group)
        comm.all_reduce_sum_(load_HE, group, kind="bias_load")
        mean = peers * (rows // Hl) * K / E
        selection_bias.copy_(selection_bias + rate * torch.sign(mean - load_HE.to(selection_bias.dtype)))


@update_selection_bias_over_group.register_fake
def _(selection_bias, experts_GK, rate, training, group_name):
    return None


UPDATE_SELECTION_BIAS_OVER_GROUP = torch.ops.moe_hp.update_selection_bias_over_group.default
