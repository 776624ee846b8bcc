"""The optimizer and the learning-rate schedule of the training recipe.

`build_optimizer` is the one place the recipe makes its optimizer. Parameters are grouped so that no group
mixes plain tensors with DTensors, or DTensors of different meshes (moepass's experts on ("dp", "ep"),
FSDP2's dense shards on the world): torch's multi-tensor (`foreach=True`, the CUDA default) kernels take a
group's tensors as one list and refuse a mix ("aten._foreach_add_.List: got mixed torch.Tensor and
DTensor"). 1-D parameters (norm weights, biases) get no weight decay.

`fill_missing_grads` gives every parameter without a gradient a zero one. A model whose experts are a
ModuleList and whose forward skips an expert no token chose (a loop with `if not rows: continue`, as
Hugging Face's Mixtral and Qwen-MoE write it) leaves that expert's gradient None; torch's optimizers skip a
None gradient entirely (no weight decay, no moment decay, the parameter's own step count stays), while every
moepass form holds the experts of a role in one tensor and hands such an expert a zero slice, which AdamW
does decay. Zero-filling makes the untouched model step as the forms do (the gradient is zero in both: the
math is the same, only torch's None-skipping differs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Parameter groups by (mesh, decays): one per plain/DTensor mesh and per weight-decay setting."""
    groups: dict[tuple[object, bool], dict] = {}  # keyed by the mesh itself (None: plain tensors), as grads.py does
    for p in model.parameters():
        if not p.requires_grad:
            continue
        mesh = p.device_mesh if isinstance(p, DTensor) else None
        decays = p.dim() >= 2
        group = groups.setdefault((mesh, decays), {"params": [], "weight_decay": weight_decay if decays else 0.0})
        group["params"].append(p)
    return list(groups.values())


def build_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
                    foreach: bool | None = None) -> torch.optim.Optimizer:
    """AdamW over `param_groups(model)`; `foreach` as torch's (None: its default for the device)."""
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, foreach=foreach)


def fill_missing_grads(params: Iterable[nn.Parameter]) -> int:
    """Give each trainable parameter whose `.grad` is None a zero gradient (module doc); returns how many."""
    filled = 0
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
            filled += 1
    return filled


def lr_at(step: int, lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to `min_ratio * lr` at step `total` (0-based)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
