"""Expert parameters under a distributed form (EP, FSEP): one way to shard, recorded in the block's
`moepass.runtime.layout.ExpertLayout`.

Both forms keep each expert weight as a DTensor on the ("dp", "ep") mesh with placements
(Replicate(), Shard(d)) of the canonical `[E, ...]` tensor, so names and logical shapes are the
original ones and `clip_grad_norm_`, optimizer state dicts and DCP work as for any DTensor:

- EP shards the expert dim (d = 0): rank p keeps experts [p*L, (p+1)*L), whole.
- FSEP shards the first dim inside each expert (d = 1): rank p keeps slice p of every expert; a row-major
  flattening of that dim gives exactly the (E, P, S/P) view of the technique, [:, p, :].

Fused 3-D weights are sharded in place (their original names). ModuleList experts (one tensor per
expert) are stacked into one parameter per role, `<form>_<role>`, owned by the block; their per-expert
originals are removed; `moepass.logical_state_dict` names them back. Everything is declared as
`moepass.passes.Effects`, applied by the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from moepass.canonical import MoEGraphModule
from moepass.errors import PlanError
from moepass.passes import Effects
from moepass.runtime import collectives as comm
from moepass.runtime.layout import ExpertLayout, expert_parameter_names, local_part
from moepass.runtime.topology import EPGroups
from moepass.spec import MoESpec


def local_shard(param: Tensor) -> Tensor:
    """Graph node: this rank's shard of an expert parameter (`moepass.runtime.layout.local_part`)."""
    return local_part(param)


def as_dtensor(local: Tensor, groups: EPGroups, shard_dim: int, requires_grad: bool) -> nn.Parameter:
    dt = DTensor.from_local(local, groups.mesh, groups.placements(shard_dim), run_check=False)
    return nn.Parameter(dt, requires_grad=requires_grad)


def _check_divisible(spec: MoESpec, form: str, what: str, shape: tuple[int, ...], dim: int, parts: int) -> None:
    if len(shape) <= dim or shape[dim] % parts:
        size = shape[dim] if len(shape) > dim else None
        raise PlanError(
            f"Plan.form={form!r} cannot shard block {spec.path or '<root>'}: expert weight {what} has shape {shape}; "
            f"dim {dim} ({size}) must split evenly over the {parts} ranks of the group. Use an ep_size dividing "
            f"{size}, or leave this block alone with Plan(blocks={{{spec.path!r}: None}}).")


def shard_experts(gm: MoEGraphModule, spec: MoESpec, layout: ExpertLayout, form: str,
                  effects: Effects, replica_hooks: bool = True) -> dict[str, str]:
    """Declare the sharded expert parameters (see module doc) in `effects`; record them in `layout`.
    `replica_hooks`: replicas of the same shards (dp_size > 1) sum their gradients in a blocking gradient
    hook; False when the priority scheduler sums them as micro-ops (`Plan(grad_sync="scheduler")`).

    Returns role -> the parameter name the rewritten graph reads (a stacked tensor is read once for
    every role that uses it).
    """
    E, groups, d = spec.num_experts, layout.groups, layout.shard_dim
    P, p = groups.ep_size, groups.ep_rank
    check_generic(gm, spec, form)
    if spec.weights_on != "output":
        raise PlanError(f"Plan.form={form!r} cannot rewrite block {spec.path or '<root>'}: its routing weights multiply "
                        f"each expert's input (MoESpec.weights_on={spec.weights_on!r}), which the distributed forms do "
                        f"not send in this build; use form='single', or leave this block alone with "
                        f"Plan(blocks={{{spec.path!r}: None}}).")
    names: dict[str, str] = {}
    by_paths: dict[tuple[str, ...], str] = {}
    for role, source in spec.experts.sources().items():
        if source.paths in by_paths:
            names[role] = by_paths[source.paths]
            continue
        if not source.stacked:
            path = source.paths[0]
            param = gm.get_parameter(path)
            if source.unflatten is not None:  # stored [E·n, ...]: whole experts are contiguous rows, any other dim is not
                if d != 0 or param.dim() == 0 or param.shape[0] != E * source.unflatten:
                    raise PlanError(
                        f"Plan.form={form!r} cannot shard block {spec.path or '<root>'}: expert weight {path!r} is "
                        f"stored flattened as [E·{source.unflatten}, ...] = {tuple(param.shape)}, which this form would "
                        f"split inside each expert (dim {d} of [E, {source.unflatten}, ...]); use form='ep' or "
                        f"'single', or leave this block alone with Plan(blocks={{{spec.path!r}: None}}).")
                _check_divisible(spec, form, repr(path), (E, *param.shape[1:]), 0, P)
            elif param.dim() == 0 or param.shape[0] != E:
                raise PlanError(
                    f"Plan.form={form!r} cannot shard block {spec.path or '<root>'}: expert weight {path!r} has "
                    f"shape {tuple(param.shape)}, expected a leading expert dim of {E}; leave this block alone "
                    f"with Plan(blocks={{{spec.path!r}: None}}).")
            _check_divisible(spec, form, repr(path), tuple(param.shape), d, P)
            local = param.detach().chunk(P, d)[p].clone()
            effects.parameters[path] = as_dtensor(local, groups, d, param.requires_grad)
            layout.sharded.append(path)
            name = path
        else:
            params = [gm.get_parameter(q) for q in source.paths]
            if len(params) != E:
                raise PlanError(f"Plan.form={form!r}: block {spec.path or '<root>'} stacks {len(params)} tensors for "
                                f"{role}, expected one per expert ({E}).")
            _check_divisible(spec, form, f"{source.paths[0]!r} (stacked)", (E, *params[0].shape), d, P)
            frozen = [q for q, t in zip(source.paths, params) if not t.requires_grad]
            if frozen and len(frozen) < len(params):  # one stacked tensor has one requires_grad
                raise PlanError(
                    f"Plan.form={form!r}: block {spec.path or '<root>'} has frozen experts beside trainable ones "
                    f"({', '.join(frozen[:3])}{' ...' if len(frozen) > 3 else ''} requires_grad=False): {form} stacks "
                    f"each role's expert weights into one tensor, which trains or not as a whole. Freeze all of a "
                    f"block's experts or none, use form='single' (it keeps per-expert weights), or leave the block "
                    f"alone with Plan(blocks={{{spec.path!r}: None}}).")
            if d == 0:
                local = torch.stack([q.detach() for q in params[p * E // P:(p + 1) * E // P]])
            else:
                local = torch.stack([q.detach().chunk(P, d - 1)[p] for q in params])
            name = f"{form}_{role}"
            effects.parameters[name] = as_dtensor(local, groups, d, params[0].requires_grad)  # stack: a new tensor
            effects.removed += source.paths
            layout.stacked[name] = source.paths
        by_paths[source.paths] = name
        names[role] = name
    if layout.stacked and spec.experts.container:
        effects.emptied.append(spec.experts.container)
    if groups.dp_size > 1 and replica_hooks:  # replicas of the same shards sum their gradients
        effects.grad_hooks += [(n, expert_grad_hook(groups)) for n in layout.expert_param_names()]
    return names


def check_generic(gm: nn.Module, spec: MoESpec, form: str) -> None:
    """Generic experts (`ExpertsSpec.kind="generic"`) are sharded like stacked FFN weights (EP: whole experts;
    FSEP: dim 1 of every tensor, restored before the compute) and must hold parameters only; a PlanError
    naming the block and the buffers otherwise."""
    x = spec.experts
    buffers = dict(gm.named_buffers())
    held = [path for _, source in x.tensors for path in source.paths[:1] if path in buffers]
    if x.kind == "generic" and held:
        raise PlanError(f"Plan.form={form!r} cannot rewrite block {spec.path or '<root>'}: its generic experts (module "
                        f"{x.template_class} run as traced) hold buffers {held}, which distributed forms do not shard "
                        f"in this build; use form='single', or leave this block alone with "
                        f"Plan(blocks={{{spec.path!r}: None}}).")


def expert_grad_hook(groups: EPGroups) -> Callable[[Tensor], Tensor]:
    """Expert gradient := its sum over DP replicas (the 1/W is already in it: `exchange.grad_scale`)."""

    def hook(grad: Tensor) -> Tensor:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local = local.clone()  # a hook must not modify its argument
        comm.all_reduce_sum_(local, groups.dp_group)
        if isinstance(grad, DTensor):
            return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)
        return local

    return hook


def finalize_model(model: nn.Module) -> None:
    """Model-level set-up after all blocks are rewritten: DDP ignores the expert parameters and every
    sharded buffer (HP's selection bias): DDP would broadcast them as plain tensors."""
    names = expert_parameter_names(model) + [n for n, b in model.named_buffers() if isinstance(b, DTensor)]
    if names:
        from torch.nn.parallel import DistributedDataParallel as DDP

        DDP._set_params_and_buffers_to_ignore_for_model(model, names)
