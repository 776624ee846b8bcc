"""DCP checkpoints of a training run: model, optimizer, data position, RNG and FSEP placement tables.

One checkpoint is a directory `<dir>/step_<k>` written by `torch.distributed.checkpoint.save` on every
rank (each writes its own shards: moepass's expert DTensors, FSDP2's dense shards; replicated tensors
once), then a `COMPLETE` marker by rank 0 after a barrier, so a run killed while saving leaves no
checkpoint that `latest` would pick. The state:

- `model`, `optim`: `torch.distributed.checkpoint.state_dict.get_state_dict` (parameter names as the
  compiled model has them: resume at the same form and world size);
- `train`: the step (the data position: `moepass.train.data` derives batches from it);
- `rng`: every rank's torch (and CUDA) generator state, under its own key;
- `fsep`: each FSEP block's `FSEPPlacement.placement_state()` (the table in use, the next one planned,
  the count history), so placements continue exactly;
- `extra`: whatever the caller adds (plain tensors and numbers, replicated).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

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


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, extra: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    rank = dist.get_rank()
    return {"model": model_sd, "optim": optim_sd, "train": {"step": step}, "extra": extra,
            "rng": {f"rank{rank}": rng_state()},
            "fsep": {path: m.placement_state() for path, m in placements(model).items()}}


def save(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
         extra: dict[str, Any] | None = None) -> str:
    """Write the checkpoint after `step` steps to `<directory>/step_<step>`; returns its path. All ranks."""
    path = os.path.join(directory, f"step_{step:06d}")
    dcp.save(_state(model, optimizer, step, dict(extra or {})), checkpoint_id=path)
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
    """Load a checkpoint written by `save` into `model` and `optimizer` (same form and world size); restore this
    rank's RNG and every FSEP block's placements. Returns (step, extra). All ranks."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if not os.path.exists(os.path.join(path, MARKER)):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker): pass one that "
                                f"moepass.train.checkpoint.save finished, or the directory holding them")
    state = _state(model, optimizer, 0, dict(extra or {}))
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    set_rng_state(state["rng"][f"rank{dist.get_rank()}"])
    for block, m in placements(model).items():
        m.load_placement_state(state["fsep"][block])
    return int(state["train"]["step"]), state["extra"]
