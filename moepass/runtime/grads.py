"""Gradient helpers for EP training without DDP.

Expert parameters need nothing: their gradient hook already makes them the gradient of the mean of
the ranks' local losses (see `moepass.rewrite.ep`). Replicated (non-expert) parameters hold only the
local gradient until averaged — by DDP, or by `all_reduce_replicated_grads`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moepass.runtime import stats


def all_reduce_replicated_grads(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Average the gradients of every non-DTensor parameter over `group` (default: the world)."""
    size = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is None or isinstance(p, DTensor):
            continue
        stats.record("replicated_grad_allreduce", inter=2 * (size - 1) * p.grad.numel() * p.grad.element_size()
                     // max(size, 1))
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(size)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, **kwargs) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over a mix of DTensor (expert) and replicated plain parameters.

    torch's version refuses to stack DTensor and plain-tensor norms; inside DTensor's
    `implicit_replication()` the plain (replicated, already averaged) gradients count once and the
    sharded expert gradients contribute their global norm. Returns the global norm as a plain tensor.
    """
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication():
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, **kwargs)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
