"""`moepass.fully_shard`: FSDP2 over a model moepass compiled, the experts left to their own mesh.

A distributed form keeps each expert weight as a DTensor on its ("dp", "ep") mesh (see
`moepass.rewrite.experts`). torch's `fully_shard` takes every DTensor parameter it manages for a
tensor-parallel one and joins its mesh to the FSDP mesh (`DeviceMesh._concatenate`), which fails on
moepass's mesh (`TypeError: Invariant encountered: value was None when it should not be`) and would be
wrong if it did not: the experts are already sharded and their gradients already reduced by the form.
So FSDP must ignore them; this function passes them as `ignored_params`, for any module of the
compiled model (a layer, the root), and leaves everything else to torch:

    for layer in cm.layers:
        moepass.fully_shard(layer)              # attention, router, shared experts: sharded by FSDP2
    moepass.fully_shard(cm)                     # the rest; experts stay EP/FSEP/HP DTensors
    moepass.runtime.grad_sync.schedule_fsdp(cm) # optional: FSDP's collectives under the priority rule

Dense parameters are replicated on every rank of the world, so the FSDP mesh is the whole world by
default (torch's default), whatever the form's ep_size.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

from moepass.runtime.layout import expert_layouts, expert_parameter_names


def moepass_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The parameters of `module` a distributed form placed: every expert weight a layout names, and
    every DTensor parameter on one of those layouts' meshes (HP's sharded routers)."""
    names = set(expert_parameter_names(module))
    meshes = [layout.groups.mesh for _, layout in expert_layouts(module)]
    return {p for n, p in module.named_parameters()
            if n in names or (isinstance(p, DTensor) and any(p.device_mesh is m for m in meshes))}


def fully_shard(module: nn.Module, mesh: Any = None, **kwargs: Any) -> Any:
    """`torch.distributed.fsdp.fully_shard(module, mesh=mesh, **kwargs)` with moepass's expert parameters
    (`moepass_parameters`) added to `ignored_params`; returns torch's result (the module, now an FSDPModule).
    Call it where you would call torch's, on every rank."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    ignored = set(kwargs.pop("ignored_params", None) or ()) | moepass_parameters(module)
    return torch_fully_shard(module, mesh=mesh, ignored_params=ignored or None, **kwargs)
