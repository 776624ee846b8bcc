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


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for EP models: the global norm over a mix of plain replicated
    parameters (DDP), DTensor experts on the ("dp", "ep") mesh and FSDP2 DTensors on another mesh.

    torch's version stacks the per-tensor norms in one list, which fails for plain + DTensor (and for
    DTensors on different meshes). Here the norm is taken per mesh (plain tensors count once, as the
    replicas agree), each reduced to a plain tensor (`full_tensor`), then combined; every group is then
    scaled with torch's `clip_grads_with_norm_`. Returns the global norm as a plain tensor.
    """
    from torch.distributed.tensor.experimental import implicit_replication

    groups: dict[object, list[torch.Tensor]] = {}
    for p in [parameters] if isinstance(parameters, torch.Tensor) else parameters:
        if p.grad is not None:
            groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    if not groups:
        return torch.tensor(0.0)
    with implicit_replication():
        norms = []
        for params in groups.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], norm_type, error_if_nonfinite, foreach)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        first = norms[0].device
        total = torch.nn.utils.get_total_norm([n.to(first) for n in norms], norm_type, error_if_nonfinite, foreach)
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total
