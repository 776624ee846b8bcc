"""Checkpoints in the original layout: original parameter names and full logical shapes.

    sd = moepass.logical_state_dict(cm)            # every rank; DCP-ready
    torch.distributed.checkpoint.save(sd, checkpoint_id=path)
    ...
    sd = moepass.logical_state_dict(cm2)           # another EP degree / world size
    torch.distributed.checkpoint.load(sd, checkpoint_id=path)
    moepass.load_logical_state_dict(cm2, sd)
    ...
    original.load_state_dict(...)                  # or dcp.load(original.state_dict(), ...) in one process

What the values are (`full=False`, the default, no communication). Everything follows from the
expert parameter's placement (`moepass.rewrite.experts`: Shard(0) under EP, Shard(1) under FSEP), so
a checkpoint saved under one form and world size loads under another or into the original model:
- non-expert tensors: the model's own tensors, same names (replicated: DCP writes one copy);
- fused 3-D expert weights sharded in place: the DTensor parameter itself — original name, full
  logical shape [E, ...]; DCP saves each rank's shard and reshards on load;
- ModuleList experts (stacked into `<form>_<role>`): one entry per expert under its original name
  (`experts.3.w1.weight`), a view of this rank's shard. Sharded on the expert dim (EP), each rank
  lists only its own experts, as plain tensors; together the ranks list all of them, so DCP's global
  plan holds every expert once. Sharded inside the experts (FSEP), every rank lists every expert, as a
  DTensor of the expert's own shape sharded on its first dim.
With `full=True` every value is a plain full tensor (expert weights all-gathered: collective, every
rank must call it), e.g. for `original.load_state_dict(...)` in the same process.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from moepass.runtime.layout import ExpertLayout, expert_layouts, join, user_prefix
from moepass.runtime.topology import HeadEPGroups

Index = slice | tuple[slice, ...] | None  # where in the original tensor a local value lies


def _stacked_keys(model: nn.Module) -> dict[str, tuple[ExpertLayout, tuple[str, ...]]]:
    """cm state_dict key of each stacked parameter -> (layout, original per-expert keys)."""
    return {join(path, name): (layout, tuple(join(user_prefix(model, path), p) for p in paths))
            for path, layout in expert_layouts(model) for name, paths in layout.stacked.items()}


def _local(value: Tensor) -> Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _expert_entries(layout: ExpertLayout, local: Tensor) -> list[tuple[int, Tensor]]:
    """(expert, this rank's part of it) for the experts a stacked parameter's shard holds."""
    if layout.shard_dim == 0:
        first = layout.groups.ep_rank * local.shape[0]
        return [(first + i, local[i]) for i in range(local.shape[0])]
    return list(enumerate(local))


def _expert_value(layout: ExpertLayout, part: Tensor) -> Tensor:
    """A stacked expert's entry: its local part, or (sharded inside the expert) a DTensor of the expert."""
    if layout.shard_dim == 0:
        return part
    return DTensor.from_local(part, layout.groups.mesh, [Replicate(), Shard(layout.shard_dim - 1)], run_check=False)


def _shard_index(layout: ExpertLayout, local: Tensor, dim: int) -> Index:
    """Where this rank's shard (sharded on `dim`) lies in the full tensor."""
    lo = layout.groups.ep_rank * local.shape[dim]
    rows = slice(lo, lo + local.shape[dim])
    return rows if dim == 0 else (*(slice(None),) * dim, rows)


def _placed_index(param: DTensor, local: Tensor, dim: int) -> Index:
    """Where this rank's shard of `param` (evenly sharded on `dim`, over one mesh dim or several: HP with EP
    inside shards experts over "hp" then "ep", routers over "hp" only) lies in the full tensor."""
    mesh, index = param.device_mesh, 0
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "a rank outside the parameter's mesh has no shard"
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard) and placement.dim == dim:  # DTensor's order: left to right
            index = index * mesh.size(mesh_dim) + coordinate[mesh_dim]
    rows = slice(index * local.shape[dim], (index + 1) * local.shape[dim])
    return rows if dim == 0 else (*(slice(None),) * dim, rows)


def logical_state_dict(model: nn.Module, full: bool = False, values: dict[str, Tensor] | None = None
                       ) -> dict[str, Tensor]:
    """The state dict of `model` as the original (un-rewritten) model names it. See the module doc.
    `values`: tensors laid out as the model's state-dict entries of the same keys (e.g. an optimizer's
    `exp_avg` of each parameter), named and split as those entries would be, instead of the model's own."""
    stacked = _stacked_keys(model)
    out: dict[str, Tensor] = {}
    for key, value in (model.state_dict() if values is None else values).items():
        if key in stacked:
            layout, originals = stacked[key]
            if full:
                whole = value.full_tensor() if isinstance(value, DTensor) else value
                out.update({orig: whole[e] for e, orig in enumerate(originals)})
            else:
                out.update({originals[e]: _expert_value(layout, part) for e, part in _expert_entries(layout, _local(value))})
        elif full and isinstance(value, DTensor):
            out[key] = value.full_tensor()
        else:
            out[key] = value
    return out


def _part_for(target: DTensor, value: Tensor, key: str) -> Tensor:
    """This rank's part of `value` (a full tensor or a DTensor) in `target`'s placement, without communication
    for a full tensor."""
    if isinstance(value, DTensor):
        return value.redistribute(target.device_mesh, target.placements).to_local()
    if value.shape != target.shape:
        raise ValueError(f"load_logical_state_dict: {key!r} has shape {tuple(value.shape)}, the model needs the full "
                         f"logical shape {tuple(target.shape)}: a checkpoint of another model or plan (a form='hp' "
                         f"checkpoint loads only into the same model under the same heads)")
    return distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None).to_local()


@torch.no_grad()
def load_logical_state_dict(model: nn.Module, state_dict: dict[str, Tensor], strict: bool = True,
                            targets: dict[str, Tensor] | None = None) -> None:
    """Load an original-layout state dict (full tensors, DTensors or this rank's expert entries) into a
    rewritten model, keeping only this rank's shards. `strict`: every tensor of the model must be
    covered (for ModuleList experts sharded on the expert dim: this rank's experts). `targets`: tensors
    laid out as the model's state-dict entries of the same keys to load into instead of the model's own
    (see `logical_state_dict`'s `values`). Keys the model does not have are an error too under `strict`; with
    strict=False what was not loaded, either way, is warned about."""
    stacked = _stacked_keys(model)
    missing: list[str] = []
    known: set[str] = set()  # the model's logical keys (every expert's, whichever this rank holds)
    for key, target in (model.state_dict() if targets is None else targets).items():
        if key in stacked:
            layout, originals = stacked[key]
            known.update(originals)
            for e, part in _expert_entries(layout, _local(target)):
                if originals[e] not in state_dict:
                    missing.append(originals[e])
                    continue
                value = state_dict[originals[e]]
                if layout.shard_dim == 0:
                    part.copy_(value.full_tensor() if isinstance(value, DTensor) else value)
                elif _local(value) is not part and _local(value).data_ptr() != part.data_ptr():
                    part.copy_(_part_for(_expert_value(layout, part), value, originals[e]))  # type: ignore[arg-type]
            continue
        known.add(key)
        if key not in state_dict:
            missing.append(key)
            continue
        value = state_dict[key]
        if value is target:
            continue
        if isinstance(target, DTensor):
            target.to_local().copy_(_part_for(target, value, key))
        else:
            if value.shape != target.shape:
                raise ValueError(f"load_logical_state_dict: {key!r} has shape {tuple(value.shape)}, expected "
                                 f"{tuple(target.shape)}")
            target.copy_(value)
    unexpected = [key for key in state_dict if key not in known]
    if not (missing or unexpected):
        return
    found = "; ".join(f"{what} keys {keys[:8]}{' ...' if len(keys) > 8 else ''}" for what, keys in
                      (("missing", missing), ("unexpected", unexpected)) if keys)
    if strict:
        raise KeyError(f"load_logical_state_dict: {found}: a checkpoint of another model or plan (one of form='hp' "
                       f"loads only into the same model under the same plan)? pass strict=False to load the keys both "
                       f"have (the others are then warned about, not loaded).")
    warnings.warn(f"load_logical_state_dict(strict=False) did not load everything: {found}.", UserWarning,
                  stacklevel=2)


def logical_grads(model: nn.Module) -> dict[str, tuple[Tensor, Index]]:
    """This rank's gradients under the original model's names: {name: (gradient, index)}.

    `index` says where in the original tensor the gradient lies on this rank: a slice of its leading
    (expert) dim (EP-sharded fused weight), a tuple of slices (sharded inside the experts: FSEP), or
    None for the whole tensor (replicated parameters; each ModuleList expert under EP). Parameters
    without a gradient are left out. Compare with a reference as `ref_grads[name][index or slice(None)]`.
    """
    stacked = _stacked_keys(model)
    experts = {name: layout for path, layout in expert_layouts(model) for name in
               (join(user_prefix(model, path), n) for n in layout.sharded)}
    out: dict[str, tuple[Tensor, Index]] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grad = _local(p.grad)
        if name in stacked:
            layout, originals = stacked[name]
            index = None if layout.shard_dim == 0 else _shard_index(layout, grad[0], layout.shard_dim - 1)
            out.update({originals[e]: (part, index) for e, part in _expert_entries(layout, grad)})
        elif name in experts:
            layout = experts[name]
            # sharded over more than one mesh dim (HP with EP inside): from the placements; else the layout's rank
            if isinstance(p, DTensor) and (sum(isinstance(q, Shard) for q in p.placements) != 1
                                           or isinstance(layout.groups, HeadEPGroups)):
                out[name] = (grad, _placed_index(p, grad, layout.shard_dim))
            else:
                out[name] = (grad, _shard_index(layout, grad, layout.shard_dim))
        else:
            out[name] = (grad, None)
    return out
