"""Checkpoints in the original layout: original parameter names and full logical shapes.

    sd = moepass.logical_state_dict(cm)            # every rank; DCP-ready
    torch.distributed.checkpoint.save(sd, checkpoint_id=path)
    ...
    sd = moepass.logical_state_dict(cm2)           # another EP degree / world size
    torch.distributed.checkpoint.load(sd, checkpoint_id=path)
    moepass.load_logical_state_dict(cm2, sd)
    ...
    original.load_state_dict(...)                  # or dcp.load(original.state_dict(), ...) in one process

What the values are (`full=False`, the default, no communication):
- non-expert tensors: the model's own tensors, same names (replicated: DCP writes one copy);
- fused 3-D expert weights sharded in place: the DTensor parameter itself — original name, full
  logical shape [E, ...]; DCP saves each rank's rows and reshards on load;
- ModuleList experts (stacked into `ep_<role>` by the EP pass): one entry per *local* expert under
  its original name (`experts.3.w1.weight`), a view of this rank's shard. Each rank lists only its
  own experts; together the ranks list all of them, so DCP's global plan holds every expert once.
With `full=True` every value is a plain full tensor (expert weights all-gathered: collective, every
rank must call it), e.g. for `original.load_state_dict(...)` in the same process.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moepass.canonical import MoEGraphModule
from moepass.rewrite.ep import EPLayout, expert_parameter_names


def _ep_blocks(model: nn.Module) -> Iterator[tuple[str, EPLayout]]:
    for path, module in model.named_modules():
        layout = module.layout if isinstance(module, MoEGraphModule) else None
        if isinstance(layout, EPLayout):
            yield path, layout


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _stacked_keys(model: nn.Module) -> dict[str, tuple[EPLayout, tuple[str, ...], str]]:
    """cm state_dict key of each stacked parameter -> (layout, original per-expert keys, block path)."""
    out = {}
    for path, layout in _ep_blocks(model):
        for name, paths in layout.stacked.items():
            out[_join(path, name)] = (layout, tuple(_join(path, p) for p in paths), path)
    return out


def logical_state_dict(model: nn.Module, full: bool = False) -> dict[str, Tensor]:
    """The state dict of `model` as the original (un-rewritten) model names it. See the module doc."""
    stacked = _stacked_keys(model)
    out: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        if key in stacked:
            layout, originals, _ = stacked[key]
            if full:
                whole = value.full_tensor() if isinstance(value, DTensor) else value
                out.update({orig: whole[e] for e, orig in enumerate(originals)})
            else:
                local = value.to_local() if isinstance(value, DTensor) else value
                lo = layout.first_expert
                out.update({originals[lo + i]: local[i] for i in range(layout.local_experts)})
        elif full and isinstance(value, DTensor):
            out[key] = value.full_tensor()
        else:
            out[key] = value
    return out


@torch.no_grad()
def load_logical_state_dict(model: nn.Module, state_dict: dict[str, Tensor], strict: bool = True) -> None:
    """Load an original-layout state dict (full tensors, DTensors or this rank's expert entries) into a
    rewritten model, keeping only each rank's experts. `strict`: every tensor of the model must be
    covered (for ModuleList experts: this rank's experts)."""
    stacked = _stacked_keys(model)
    experts = set(expert_parameter_names(model))
    missing: list[str] = []
    own = model.state_dict()
    for key, target in own.items():
        if key in stacked:
            layout, originals, _ = stacked[key]
            local = target.to_local() if isinstance(target, DTensor) else target
            for i in range(layout.local_experts):
                orig = originals[layout.first_expert + i]
                if orig in state_dict:
                    local[i].copy_(_plain(state_dict[orig]))
                else:
                    missing.append(orig)
            continue
        if key not in state_dict:
            missing.append(key)
            continue
        value = state_dict[key]
        if isinstance(target, DTensor):
            if isinstance(value, DTensor):
                if value is not target:
                    target.copy_(value.redistribute(target.device_mesh, target.placements))
                continue
            if key not in experts:  # a DTensor of another wrapper (FSDP2): distribute the full value
                target.copy_(distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements))
                continue
            local = target.to_local()
            rows = local.shape[0]
            start = _block_layout(model, key).first_expert
            if value.shape != target.shape:
                raise ValueError(f"load_logical_state_dict: {key!r} has shape {tuple(value.shape)}, the model needs "
                                 f"the full logical shape {tuple(target.shape)}")
            local.copy_(value[start:start + rows])
        elif value is not target:
            if value.shape != target.shape:
                raise ValueError(f"load_logical_state_dict: {key!r} has shape {tuple(value.shape)}, expected "
                                 f"{tuple(target.shape)}")
            target.copy_(value)
    if strict and missing:
        raise KeyError(f"load_logical_state_dict: missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
                       f"pass strict=False to load a partial state dict.")


def logical_grads(model: nn.Module) -> dict[str, tuple[Tensor, slice | None]]:
    """This rank's gradients under the original model's names: {name: (gradient, rows)}.

    `rows` is the slice of the original tensor's leading (expert) dim the gradient covers on this
    rank (an EP-sharded fused weight), or None when it is the whole tensor (replicated parameters,
    and each ModuleList expert's own parameter). Parameters without a gradient are left out.
    Compare with a reference as `ref_grads[name][rows or slice(None)]`.
    """
    stacked = _stacked_keys(model)
    experts = set(expert_parameter_names(model))
    out: dict[str, tuple[Tensor, slice | None]] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if name in stacked:
            layout, originals, _ = stacked[name]
            for i in range(layout.local_experts):
                out[originals[layout.first_expert + i]] = (grad[i], None)
        elif name in experts:
            layout = _block_layout(model, name)
            out[name] = (grad, slice(layout.first_expert, layout.first_expert + layout.local_experts))
        else:
            out[name] = (grad, None)
    return out


def _plain(value: Tensor) -> Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _block_layout(model: nn.Module, key: str) -> EPLayout:
    for path, layout in _ep_blocks(model):
        if any(_join(path, n) == key for n in layout.sharded):
            return layout
    raise KeyError(f"{key!r} is a DTensor but no EP block owns it")
