"""Optimizer steps over a compiled model whose expert weights are DTensors.

The expert-parallel forms keep each expert weight a DTensor sharded over its expert group (DCP reshards
checkpoints across forms and world sizes from it); every other weight stays a plain tensor, replicated on
every rank. PyTorch's multi-tensor optimizer kernels (`foreach`, the default on CUDA) and fused kernels
refuse a tensor list that mixes the two ("aten._foreach_add_.List: got mixed torch.Tensor and DTensor"):
every `torch.optim.AdamW(model.parameters())` step on a GPU would fail (gradient clipping over the same mix:
`moepass.clip_grad_norm_`, runtime/grads.py).

- `enable_mixed_steps()` (called by `moepass.compile` when the model it returns holds DTensor parameters)
  registers one process-wide pair of optimizer step hooks: an optimizer one of whose parameter groups
  mixes DTensors and plain tensors steps with plain tensors taken as replicated DTensors
  (`torch.distributed.tensor.experimental.implicit_replication`), which is what they are. Other
  optimizers step as before. Registered once per process; `disable_mixed_steps()` removes the pair.

A replicated plain tensor taken as a `Replicate()` DTensor computes the same local update: the math is
unchanged (tests/test_optim.py: AdamW with foreach=True at W=2 against the untouched model).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from moepass.process_state import OPTIM_HOOKS, OPTIM_OPEN

__all__ = ["disable_mixed_steps", "enable_mixed_steps", "mixes_dtensors"]

# the registered hook pair (OPTIM_HOOKS) and the replication context a step entered (OPTIM_OPEN; one step runs at
# a time per process) are process-wide: moepass.process_state


def mixes_dtensors(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether `tensors` holds both DTensors and plain tensors."""
    kinds = {isinstance(t, DTensor) for t in tensors}
    return kinds == {True, False}


def _mixed(optimizer: torch.optim.Optimizer) -> bool:
    return any(mixes_dtensors(group["params"]) for group in optimizer.param_groups)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    while OPTIM_OPEN:  # a step that raised left its context open: close it first
        OPTIM_OPEN.pop().__exit__(None, None, None)
    if _mixed(optimizer):
        context = implicit_replication()
        context.__enter__()
        OPTIM_OPEN.append(context)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    while OPTIM_OPEN:
        OPTIM_OPEN.pop().__exit__(None, None, None)


def enable_mixed_steps() -> None:
    """Let every optimizer step over parameter groups that mix DTensors and plain tensors (module doc)."""
    if OPTIM_HOOKS:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    OPTIM_HOOKS.append(register_optimizer_step_pre_hook(_before_step))
    OPTIM_HOOKS.append(register_optimizer_step_post_hook(_after_step))


def disable_mixed_steps() -> None:
    """Remove the hooks `enable_mixed_steps` registered."""
    while OPTIM_HOOKS:
        OPTIM_HOOKS.pop().remove()

