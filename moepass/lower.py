"""The lower pass: replace eligible dialect nodes by the generated Triton kernels of `lowering/`.

    moe.route                      -> moe_lowered.route               family "gating"
    moe.permute                    -> moe_lowered.permute             family "permute"
    moe.expert_ffn                 -> moe_lowered.expert_ffn          family "grouped_gemm"
    moe.unpermute -> moe.combine   -> moe_lowered.unpermute_combine   family "combine" (the unpermute
                                                                      must have no other user)

What gets lowered follows `Plan.lowering`:
  "torch"   nothing: the dialect's torch references run.
  "auto"    on CUDA, every eligible node; elsewhere nothing (the reason is recorded).
  "triton"  every eligible node; the kernels must be able to launch on the block's device (CUDA, or
            CPU with TRITON_INTERPRET=1 set before `lowering` is imported), otherwise PlanError.

Eligibility is decided per node by the family's `Lowering.eligible` on the nodes' fake values
(`node.meta["val"]`, refreshed first by FakeTensorProp from a small input in the block's parameter
dtype and device: values left by earlier passes or the verifier may be stale or in another dtype). A declined node keeps its
dialect op and the reason is recorded. Counters (`PassResult.stats`, asserted by tests):
    {"mode": ..., "lowered": {family: nodes replaced}, "declined": {family: reason}}

A replacement node is named after the node it replaces plus "_lowered" (`route` -> `route_lowered`;
FX never frees a used name) and records `meta["moepass"] = {"pass": "lower", "family": ..., "replaces": [...]}`.

`lowering` is imported only when something may be lowered, so `import moepass` never imports Triton.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from lowering import FAMILIES  # the family list only: importing `lowering` imports no kernel (no Triton)
from moepass.canonical import MoEGraphModule
from moepass.errors import PlanError
from moepass.passes import PassResult
from moepass.plan import Plan

PASS_NAME = "lower"


def lower_pass(gm: MoEGraphModule, plan: Plan) -> PassResult:
    """Replace the eligible dialect nodes of `gm` by lowered ops, as `plan.lowering` says."""
    stats: dict[str, Any] = {"mode": plan.lowering, "lowered": dict.fromkeys(FAMILIES, 0), "declined": {}}
    device = _device(gm)
    if plan.lowering == "torch":
        stats["declined"]["*"] = "Plan.lowering='torch': the torch references run"
        return PassResult(gm, changed=False, stats=stats)
    if plan.lowering == "auto" and device.type != "cuda":
        stats["declined"]["*"] = (f"Plan.lowering='auto' keeps the torch references on {device.type} (Triton runs "
                                  "on CUDA); use lowering='triton' with TRITON_INTERPRET=1 to run the kernels "
                                  "interpreted")
        return PassResult(gm, changed=False, stats=stats)

    registry = _registry(gm, plan, device)
    if registry is None:  # auto on CUDA without a usable Triton
        stats["declined"]["*"] = "Plan.lowering='auto': triton cannot launch here; the torch references run"
        return PassResult(gm, changed=False, stats=stats)
    by_op = {rec.dialect_op: rec for rec in registry}
    matches = [(node, by_op[node.target]) for node in gm.graph.nodes
               if node.op == "call_function" and node.target in by_op]
    propagate_fake_values(gm)  # current values in the block's own dtype/device (earlier ones may be stale)

    for node, rec in matches:
        pattern = _pattern(node, rec)
        if pattern is None:
            _decline(stats, rec.family, _unfused_reason(node, rec))
            continue
        args = _lowered_args(pattern)
        fake_args = fx.node.map_arg(args, lambda n: n.meta["val"])
        reason = rec.eligible(*fake_args)
        if reason is not None:
            _decline(stats, rec.family, f"{node.name}: {reason}")
            continue
        _replace(gm, pattern, rec, args)
        stats["lowered"][rec.family] = stats["lowered"].get(rec.family, 0) + 1

    changed = any(stats["lowered"].values())
    if changed:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, changed=changed, stats=stats)


def sources(gm: MoEGraphModule) -> list[tuple[str, str, str]]:
    """(node name, family, generated Triton source) for every lowered node of `gm` (for explain)."""
    from lowering import registry

    by_op = {rec.lowered_op: rec for rec in registry()}
    if any("val" not in arg.meta for n in gm.graph.nodes if n.op == "call_function" and n.target in by_op
           for arg in _inputs(n)):
        propagate_fake_values(gm)
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in by_op:
            rec = by_op[node.target]
            out.append((node.name, rec.family, rec.source(*fx.node.map_arg(node.args, lambda n: n.meta["val"]))))
    return out


def example_inputs(gm: MoEGraphModule) -> list[torch.Tensor]:
    """A small hidden-states input (B=2, S=3) in the block's parameter dtype and device."""
    spec = gm.spec
    param = next((p for p in gm.parameters() if p.is_floating_point()), None)
    dtype = param.dtype if param is not None else torch.get_default_dtype()
    device = param.device if param is not None else torch.device("cpu")
    return [torch.empty(2, 3, spec.model_dim, dtype=dtype, device=device)]


def propagate_fake_values(gm: MoEGraphModule, inputs: list[torch.Tensor] | None = None) -> None:
    """Fill `node.meta["val"]` on every node by FakeTensorProp from a small example input."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(x) for x in (inputs or example_inputs(gm))])


# ----------------------------------------------------------------------------------------------
# Helpers.
# ----------------------------------------------------------------------------------------------


def _device(gm: fx.GraphModule) -> torch.device:
    tensor: torch.Tensor | None = next(iter(gm.parameters()), None)
    if tensor is None:
        tensor = next(iter(gm.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _registry(gm: MoEGraphModule, plan: Plan, device: torch.device) -> list | None:
    """The lowering records, after checking that the kernels can launch on `device`.

    Plan.lowering='triton' raises PlanError when they cannot; 'auto' returns None.
    """
    from lowering import codegen as cg
    from lowering import registry

    blocker = cg.launch_blocker(device)
    if blocker is None:
        return registry()
    if plan.lowering == "auto":
        return None
    block = gm.spec.path or "<root>"
    fix = ("set TRITON_INTERPRET=1 in the environment before importing moepass/lowering (kernels then run "
           "interpreted on CPU), or use lowering='torch' / 'auto'") if device.type == "cpu" else (
           "use lowering='auto' or 'torch'")
    raise PlanError(f"Plan.lowering='triton' cannot run the Triton kernels for block {block!r} on {device}: "
                    f"{blocker} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '<unset>')!s}); {fix}.")


def _pattern(node: fx.Node, rec) -> list[fx.Node] | None:
    """The nodes a lowering replaces, first to last, or None when the fused chain is not there.

    A fused pattern is a chain through first arguments: each fused op feeds the next op's first
    argument and has no other user (e.g. unpermute -> combine).
    """
    chain = [node]
    for op in reversed(rec.fuses):
        src = chain[0].args[0]
        if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target is op and len(src.users) == 1):
            return None
        chain.insert(0, src)
    return chain


def _unfused_reason(node: fx.Node, rec) -> str:
    src = node.args[0]
    wanted = " -> ".join(_op_name(op) for op in (*rec.fuses, rec.dialect_op))
    if isinstance(src, fx.Node) and src.op == "call_function" and src.target in rec.fuses:
        others = sorted(u.name for u in src.users if u is not node)
        return f"{node.name}: its input {src.name} has other users {others}; the fused {wanted} needs it alone"
    return f"{node.name}: its input {getattr(src, 'name', src)!r} is not made by {wanted.split(' -> ')[-2]}"


def _lowered_args(pattern: list[fx.Node]) -> tuple:
    """The lowered op's arguments: the first op's, then each later op's after its chained first one."""
    args = tuple(pattern[0].args)
    for node in pattern[1:]:
        args += tuple(node.args[1:])
    return args


def _replace(gm: fx.GraphModule, pattern: list[fx.Node], rec, args: tuple) -> fx.Node:
    last = pattern[-1]
    with gm.graph.inserting_before(last):
        new = gm.graph.create_node("call_function", rec.lowered_op, args, name=f"{last.name}_lowered")
    new.meta.update({k: v for k, v in last.meta.items() if k != "moepass"})
    block = (last.meta.get("moepass") or {}).get("block", getattr(getattr(gm, "spec", None), "path", ""))
    new.meta["moepass"] = {"pass": PASS_NAME, "block": block, "family": rec.family,
                           "replaces": [f"{n.name} ({_op_name(n.target)})" for n in pattern]}
    last.replace_all_uses_with(new)
    for old in reversed(pattern):
        gm.graph.erase_node(old)
    return new


def _inputs(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def _decline(stats: dict[str, Any], family: str, reason: str) -> None:
    stats["declined"].setdefault(family, reason)


def _op_name(op: Any) -> str:
    return str(getattr(op, "_name", op)).replace("::", ".")


__all__ = ["PASS_NAME", "example_inputs", "lower_pass", "propagate_fake_values", "sources"]
