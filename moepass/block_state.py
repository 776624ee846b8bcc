"""The tensors of a block that becomes a canonical graph module: the state it adopts, the checks on its input,
and the per-expert parameters laid one after another in one buffer per role (`stack_experts`, in
`moepass.canonical`, reads such a role as one `[E, ...]` view without a copy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from moepass.spec import MoESpec


def check_block_input(gm: nn.Module, args: tuple[Any, ...]) -> None:
    """Run first by every rewritten block's forward (`eager.install`; not a forward pre-hook, which would send
    every call down nn.Module's slower hook path): its hidden states are floating point and D wide (a wrong
    width whose size D divides would otherwise be re-cut silently into rows of D by the graph's reshape)
    and, under `torch.autograd.detect_anomaly()` (PyTorch's NaN-hunting switch; no host sync otherwise),
    finite (eagerly: under torch.compile the finiteness check is skipped, it would break the graph). Raises
    ValueError naming the block, the value and the fix."""
    spec = gm.__dict__.get("spec")  # `copy.deepcopy` of a GraphModule keeps its graph, not its other attributes
    if spec is None or not args or not isinstance(args[0], torch.Tensor):
        return
    x, D = args[0], spec.model_dim
    where = f"MoE block {spec.path or '<root>'!r}"
    if not x.is_floating_point():
        raise ValueError(f"{where} got hidden states of dtype {x.dtype}: pass floating-point hidden states [..., {D}] "
                         f"(e.g. the embedding's output, not token ids).")
    if x.dim() == 0 or x.shape[-1] != D:
        raise ValueError(f"{where} got hidden states of shape {tuple(x.shape)}: its router and experts take width "
                         f"D={D}; pass [..., {D}].")
    if not torch.compiler.is_compiling() and torch.is_anomaly_enabled() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{where} got {bad} non-finite hidden-state values (NaN/inf) of {x.numel()}: they come from "
                         f"the layers before it; fix the source (learning rate, loss scaling, input data).")


def adopt_state(gm: nn.Module, block: nn.Module) -> None:
    """Make `gm` hold exactly the block's children, parameters and buffers (same objects, same names), and
    its plain public attributes (its configuration: `top_k`, `load_balance_coeff`, ...) where `gm` has none of
    that name, so code that reads them off the block (a framework's hooks) reads the same.

    GraphModule copies only what the graph references, as stub modules; adopting the originals keeps
    every parameter (used by the graph or not) and the state_dict layout of the user's block.
    """
    gm._modules.clear()
    gm._modules.update(block._modules)
    gm._parameters.clear()
    gm._parameters.update(block._parameters)
    gm._buffers.clear()
    gm._buffers.update(block._buffers)
    gm._non_persistent_buffers_set = set(block._non_persistent_buffers_set)
    gm.training = block.training  # the children keep their own flags (`train()` would reset them all)
    for name, value in vars(block).items():
        if not name.startswith("_") and name not in vars(gm) and not hasattr(type(gm), name):
            gm.__dict__[name] = value  # as the block holds it (never registered as state)


def adjacent_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The `[E, ...]` tensor that E same-shaped contiguous tensors already form when they lie one after
    another in one storage (see `relayout_stacked`), as a view; None otherwise (or for fake tensors)."""
    first = tensors[0]
    try:
        base = first.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # fake / functional tensors have no data
        return None
    n = first.numel()
    for e, t in enumerate(tensors):
        if (t.shape != first.shape or t.dtype != first.dtype or t.device != first.device or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != base or t.storage_offset() != first.storage_offset() + e * n):
            return None
    return first.detach().as_strided((len(tensors), *first.shape), (n, *first.stride()), first.storage_offset())


def stacked_parameters(block: nn.Module, spec: MoESpec) -> list[list[nn.Parameter]]:
    """The per-expert parameters of each stacked TensorSource of `spec` in `block`, in expert order: the
    groups `relayout_stacked` lays into one buffer each. A role whose tensors differ in shape, dtype or
    device, or that holds one tensor twice (tied), is left out (its tensors stay apart; `stack_experts` stacks
    them each step)."""
    groups = []
    for source in spec.experts.sources().values():
        found = [parameter_at(block, path) for path in source.paths] if source.stacked else []
        params = [p for p in found if p is not None]
        if not params or len(params) < len(found) or len({id(p) for p in params}) < len(params):
            continue  # fused tensors; a generic expert's buffers (stacked each step); tied experts
        if len({(p.shape, p.dtype, p.device) for p in params}) == 1:
            groups.append(params)
    return groups


def parameter_at(module: nn.Module, path: str) -> nn.Parameter | None:
    """The parameter at dotted `path` below `module`; None when there is none (a buffer, a missing name)."""
    prefix, _, name = path.rpartition(".")
    try:
        owner = module.get_submodule(prefix) if prefix else module
    except AttributeError:
        return None
    return owner._parameters.get(name)


def stacked_buffer(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new contiguous `[E, ...]` buffer holding the values of `params` (no autograd history)."""
    with torch.no_grad():
        return torch.stack([p.detach() for p in params])


def stacked_relayout(gm: nn.Module, spec: MoESpec) -> dict[str, torch.Tensor]:
    """Where each per-expert parameter of every stacked TensorSource would lie in one contiguous buffer per
    role: parameter name -> its slice of the new buffer (values equal). Parameters that already lie so
    (`adjacent_view`, e.g. made by `stacked_copies`) are not listed."""
    names = {id(p): name for name, p in gm.named_parameters()}
    slices: dict[str, torch.Tensor] = {}
    for params in stacked_parameters(gm, spec):
        if adjacent_view(params) is not None:
            continue
        buffer = stacked_buffer(params)
        slices.update((names[id(p)], buffer[e]) for e, p in enumerate(params))
    return slices


def relayout_stacked(gm: nn.Module, spec: MoESpec) -> int:
    """`stacked_relayout` done: each moved Parameter object keeps its name and value, `p.data` becomes its
    slice of the buffer. Returns how many parameters moved."""
    slices = stacked_relayout(gm, spec)
    for name, storage in slices.items():
        gm.get_parameter(name).data = storage
    return len(slices)


def stacked_copies(block: nn.Module, spec: MoESpec, memo: dict[int, Any]) -> int:
    """For a deep copy of the model holding `block`: each stacked role's parameters copied once, straight
    into one contiguous buffer, and registered in the deepcopy `memo` (id of the original -> a Parameter of
    the same type and `requires_grad` viewing its slice, as `Parameter.__deepcopy__` would make it), so
    that `copy.deepcopy(model, memo)` adopts them instead of cloning each one, and `relayout_stacked` finds
    them laid out already (one copy of the expert weights, not two). The originals are not touched.
    Returns how many parameters were copied."""
    copied = 0
    for params in stacked_parameters(block, spec):
        ids = {id(p) for p in params}
        if len(ids) != len(params) or not ids.isdisjoint(memo) or any(type(p) is not nn.Parameter for p in params):
            continue  # tied or already copied tensors, Parameter subclasses: copied the way deepcopy copies them
        buffer = stacked_buffer(params)
        for e, p in enumerate(params):
            memo[id(p)] = nn.Parameter(buffer[e], requires_grad=p.requires_grad)
        copied += len(params)
    return copied
