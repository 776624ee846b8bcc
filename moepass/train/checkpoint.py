"""DCP checkpoints of a training run: model, optimizer, data position, RNG and FSEP placement tables.

One checkpoint is a directory `<dir>/step_<k>` written by `torch.distributed.checkpoint.save` on every
rank (each writes its own shards: moepass's expert DTensors, FSDP2's dense shards; replicated tensors
once), then a `COMPLETE` marker by rank 0 after a barrier, so a run killed while saving leaves no
checkpoint that `latest` would pick. The state, in the original model's layout, so a checkpoint loads
under another form or world size (EP at W=4, then FSEP at W=2; the single form, then EP):

- `model`: `moepass.logical_state_dict` (original names, full logical shapes; each rank its shards);
- `optim`: the optimizer's per-parameter state split and named the same way: each state tensor shaped as
  its parameter (AdamW's `exp_avg`, `exp_avg_sq`) under `optim/<key>/<original name>`, each scalar (`step`)
  under every original name its parameter holds (a stacked expert tensor: one per expert);
- `train`: the step (the data position: `moepass.train.data` derives batches from it), the world size, the
  FSEP blocks with their table sizes, and each optimizer param group's hyper-parameters (lr, betas, weight
  decay, ...: what an LR scheduler set), restored into an optimizer of as many groups;
- `rng`: every rank's torch (and CUDA) generator state, under its own key (restored at the same world size);
- `fsep`: each FSEP block's `FSEPPlacement.placement_state()` (the table in use, the next one planned,
  the count history), so placements continue exactly (restored when the same blocks with the same table
  sizes load it; otherwise the new form plans its own: placements move work, never the math);
- `extra`: whatever the caller adds (plain tensors and numbers, replicated).
The values are copied, never recomputed: a resume at the same form and world size continues bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import DefaultLoadPlanner

from moepass.checkpoint import load_logical_state_dict, logical_state_dict
from moepass.runtime.fsep import FSEPPlacement

MARKER = "COMPLETE"


def placements(model: nn.Module) -> dict[str, FSEPPlacement]:
    return {path: m for path, m in model.named_modules() if isinstance(m, FSEPPlacement)}


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def parameter_keys(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, nn.Parameter]]:
    """(state-dict key, parameter) of every parameter the optimizer steps; a clear error for one the model
    does not hold."""
    names = {id(p): key for key, p in model.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"moepass.train.checkpoint: the optimizer steps a parameter of shape {tuple(p.shape)} "
                                 f"that the model does not hold; build the optimizer over this model's parameters")
            out.append((names[id(p)], p))
    return out


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict]:
    """(the optimizer's state in the model's original layout (module doc), {state key: {parameter key: the
    tensor itself}} of the tensors shaped as their parameter (what a load writes into))."""
    tensors: dict[str, dict[str, Tensor]] = {}
    scalars: dict[str, dict[str, Tensor]] = {}
    for key, p in parameter_keys(model, optimizer):
        for name, value in optimizer.state.get(p, {}).items():
            if isinstance(value, Tensor) and value.shape == p.shape and value.dim() > 0:
                tensors.setdefault(name, {})[key] = value
            elif isinstance(value, Tensor) and value.dim() == 0:
                for original in logical_state_dict(model, values={key: p}):
                    scalars.setdefault(name, {})[original] = value
            else:
                raise ValueError(f"moepass.train.checkpoint: optimizer state {name!r} of {key!r} is a "
                                 f"{type(value).__name__} of shape {getattr(value, 'shape', None)}; only tensors "
                                 f"shaped as the parameter and scalars are checkpointed")
    state: dict[str, Any] = {name: logical_state_dict(model, values=values) for name, values in tensors.items()}
    state.update({f"scalar_{name}": values for name, values in scalars.items()})
    return state, tensors


def init_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily made per-parameter state (zeros), so a checkpoint can load into it."""
    if not optimizer.state:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        get_optimizer_state_dict(model, optimizer)  # steps once with zero gradients to create the state


def hyper_parameters(optimizer: torch.optim.Optimizer) -> str:
    """Each param group's hyper-parameters (numbers, flags, tuples, strings; a tensor lr as its number), JSON."""
    groups = []
    for group in optimizer.param_groups:
        kept = {}
        for name, value in group.items():
            value = value.item() if isinstance(value, Tensor) and value.numel() == 1 else value
            if name != "params" and isinstance(value, (int, float, bool, str, tuple, list, type(None))):
                kept[name] = value
        groups.append(kept)
    return json.dumps(groups)


def load_hyper_parameters(optimizer: torch.optim.Optimizer, saved: str) -> None:
    """Put saved hyper-parameters back into the optimizer's groups (as many groups as saved; else a warning)."""
    groups = json.loads(saved) if saved else []
    if len(groups) != len(optimizer.param_groups):
        warnings.warn(f"moepass.train.checkpoint.load: the checkpoint has {len(groups)} optimizer param group(s), "
                      f"the optimizer {len(optimizer.param_groups)}: their hyper-parameters (lr, ...) are not "
                      f"restored; set them as the run had them", UserWarning, stacklevel=3)
        return
    for group, values in zip(optimizer.param_groups, groups):
        for name, value in values.items():
            if name not in group:
                continue
            if isinstance(group[name], Tensor):
                group[name].fill_(value)
            else:
                group[name] = tuple(value) if isinstance(group[name], tuple) else value


def layout_of(model: nn.Module) -> str:
    """The world size and the FSEP blocks with their table sizes, as a JSON string (one saved object)."""
    return json.dumps({"world": dist.get_world_size(),
                       "fsep": {path: list(m.slot_expert.shape) for path, m in placements(model).items()}},
                      sort_keys=True)


def save(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
         extra: dict[str, Any] | None = None) -> str:
    """Write the checkpoint after `step` steps to `<directory>/step_<step>`; returns its path. All ranks."""
    path = os.path.join(directory, f"step_{step:06d}")
    optim, _ = optimizer_state(model, optimizer)
    state = {"model": logical_state_dict(model), "optim": optim, "extra": dict(extra or {}),
             "train": {"step": step, "layout": layout_of(model), "groups": hyper_parameters(optimizer)},
             "rng": {f"rank{dist.get_rank()}": rng_state()},
             "fsep": {block: m.placement_state() for block, m in placements(model).items()}}
    dcp.save(state, checkpoint_id=path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(path, MARKER), "w") as f:
            f.write(f"{step}\n")
    dist.barrier()
    return path


def latest(directory: str) -> str | None:
    """The newest complete checkpoint under `directory`, or None."""
    if not os.path.isdir(directory):
        return None
    found = sorted(d for d in os.listdir(directory)
                   if re.fullmatch(r"step_\d+", d) and os.path.exists(os.path.join(directory, d, MARKER)))
    return os.path.join(directory, found[-1]) if found else None


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """Load a checkpoint written by `save` into `model` and `optimizer` (any form and world size: module doc);
    restore this rank's RNG and every FSEP block's placements when the checkpoint's layout has them.
    Returns (step, extra). All ranks."""
    if not os.path.exists(os.path.join(path, MARKER)):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker): pass one that "
                                f"moepass.train.checkpoint.save finished, or the directory holding them")
    head: dict[str, Any] = {"train": {"step": 0, "layout": "", "groups": ""}}
    dcp.load(head, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))  # groups: newer
    saved, here = json.loads(head["train"]["layout"]), json.loads(layout_of(model))
    same_world = saved["world"] == here["world"]
    same_fsep = bool(saved["fsep"]) and saved == here
    init_optimizer_state(model, optimizer)
    optim, targets = optimizer_state(model, optimizer)
    state: dict[str, Any] = {"model": logical_state_dict(model), "optim": optim, "extra": dict(extra or {})}
    if same_world:
        state["rng"] = {f"rank{dist.get_rank()}": rng_state()}
    if same_fsep:
        state["fsep"] = {block: m.placement_state() for block, m in placements(model).items()}
    dcp.load(state, checkpoint_id=path)
    with torch.no_grad():
        load_logical_state_dict(model, state["model"])
        for name, values in targets.items():
            load_logical_state_dict(model, state["optim"][name], targets=values)
        for key, p in parameter_keys(model, optimizer):  # a stacked tensor's scalars: its first expert's
            for name, value in optimizer.state[p].items():
                if isinstance(value, Tensor) and value.dim() == 0:
                    first = next(iter(logical_state_dict(model, values={key: p})))
                    loaded = state["optim"][f"scalar_{name}"][first]
                    if loaded is not value:
                        value.copy_(loaded)
    if same_world:
        set_rng_state(state["rng"][f"rank{dist.get_rank()}"])
    if same_fsep:
        for block, m in placements(model).items():
            m.load_placement_state(state["fsep"][block])
    if head["train"]["groups"]:
        load_hyper_parameters(optimizer, head["train"]["groups"])
    return int(head["train"]["step"]), state["extra"]
