"""The torch.compile backend "moepass": the same passes from inside Dynamo.

    torch.compile(model, backend="moepass", options={"plan": moepass.Plan(), "inner": "inductor"})

For each Dynamo graph:

    nodes ─nn_module_stack─► module objects ─detect (cached)─► MoE regions
        region of an MoESpec block ─compile_block─► dialect graph ─splice─► graph ─inner─► compiled fn

- **Which module a node belongs to**: Dynamo stamps every node with `meta["nn_module_stack"]`, a
  source expression per enclosing module (`L['self'].model.layers[0].mlp`). The backend evaluates
  those sources against the frame being compiled (`InstructionTranslator.current_tx().f_locals`),
  so it holds the user's real module objects, runs `moepass.detect` on them (the same recognisers
  and semantic check as `moepass.compile`; cached per module) and knows which nodes form each block.
- **Parameters are graph inputs** in a Dynamo graph: the canonical graph's `get_attr` reads of the
  block's tensors are mapped to the placeholders Dynamo made for those very tensors (matched by
  identity through `meta["grapharg"]`). Submodules the spec *calls* (a router module whose hooks
  record logits, shared experts) stay calls of the user's own submodule, registered on the graph
  module: AOT autograd lifts their parameters, so gradients land on the user's parameters.
- **Already compiled** (`moepass.compile`): the dialect and communication ops are opaque custom
  ops; their regions are kept as they are (their passes ran in `compile_block`).
- **Parallel forms** other than "single" need sharded parameters, which a backend cannot make
  (it sees parameters as inputs): asking for one on an unsharded model raises `PlanError`.
- Anything unrecognised — no MoE, a block split by graph breaks, outputs the spec does not
  describe — passes through unchanged, with the reason logged (logger "moepass") and recorded in
  `last_report()`.

Counters (`COUNTERS`, also in `torch._dynamo.utils.counters["moepass"]`): graphs, regions_rewritten,
regions_kept, regions_passthrough, nodes_removed, nodes_added.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import fx, nn

from moepass import determinism
from moepass.backend.regions import Modules, blocks_of, frame_scope
from moepass.backend.reports import (
    COUNTERS,
    MAX_REPORTS,
    NAME,
    BackendReport,
    Region,
    count,
    last_graph,
    last_report,
    new_report,
    reports,
    reset,
    set_last_graph,
)
from moepass.backend.splice import Decline, rewrite_region, tensor_inputs
from moepass.errors import PlanError, nearest
from moepass.plan import Plan

__all__ = ["COUNTERS", "MAX_REPORTS", "NAME", "BackendReport", "Region", "last_graph", "last_report", "moepass_backend",
           "register", "reports", "reset", "transform"]

log = logging.getLogger("moepass")
OPTIONS = ("plan", "inner")
DEFAULT_INNER = "inductor"

# ----------------------------------------------------------------------------------------------
# Options.
# ----------------------------------------------------------------------------------------------


def _options(options: dict[str, Any] | None) -> tuple[Plan, str]:
    options = dict(options or {})
    for key in options:
        if key not in OPTIONS:
            raise PlanError(f"torch.compile(backend='moepass', options={{{key!r}: ...}}) has an unknown key: "
                            f"valid keys are {list(OPTIONS)}.{nearest(key, OPTIONS)}")
    plan = options.get("plan")
    if plan is None:
        plan = Plan()
    elif isinstance(plan, dict):
        plan = Plan(**plan)
    elif not isinstance(plan, Plan):
        raise PlanError(f"options['plan']={plan!r} is invalid: pass a moepass.Plan(...) or a dict of its fields.")
    inner = options.get("inner", DEFAULT_INNER)
    if not callable(inner) and (not isinstance(inner, str) or inner == NAME):
        raise PlanError(f"options['inner']={inner!r} is invalid: use 'inductor', 'aot_eager', 'eager' or another "
                        f"registered torch.compile backend (not 'moepass' itself).")
    return plan, inner


def _inner_compile(inner: Any, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
    if inner == "eager":
        return gm.forward
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(inner)(gm, example_inputs)


# ----------------------------------------------------------------------------------------------
# The backend.
# ----------------------------------------------------------------------------------------------


def transform(gm: fx.GraphModule, plan: Plan, report: BackendReport, scope: dict[str, Any] | None = None) -> bool:
    """Rewrite the MoE regions of a Dynamo graph in place; True if anything changed."""
    report.nodes_before = report.nodes_after = len(gm.graph.nodes)
    modules = Modules(gm, scope)
    frame_self = scope["L"].get("self") if scope is not None else None
    frame_self = frame_self if isinstance(frame_self, nn.Module) else None
    report.frame = type(frame_self).__name__ if frame_self is not None else ""
    if scope is None:
        report.diagnostics.append("not called from a Dynamo compilation: module objects are unknown, graph "
                                  "passed through (use torch.compile(model, backend='moepass'))")
        return False
    blocks = blocks_of(gm, modules, frame_self, report)
    if not blocks:
        if not report.regions:
            report.diagnostics.append("no MoE block in this graph")
        return False
    changed = False
    for block in blocks:
        block_plan = plan.for_block(block.path)
        if block.spec is None:
            dialect_nodes = sum(isinstance(n.target, torch._ops.OpOverload) and n.target.namespace.startswith("moe")
                                for n in block.nodes)
            passes = [h["pass"] for h in getattr(block.module, "history", [])]
            report.regions.append(Region(block.path, type(block.module).__name__, "kept",
                                         f"already compiled by moepass.compile ({block.module.form}; passes "
                                         f"{passes}); {dialect_nodes} dialect/communication node(s) kept opaque"))
            continue
        if block_plan is None:
            report.regions.append(Region(block.path, type(block.module).__name__, "passthrough",
                                         "Plan.blocks leaves it alone"))
            continue
        if block_plan.form != "single":
            raise PlanError(
                f"Plan.form={block_plan.form!r} is invalid for torch.compile(backend='moepass') on the unsharded "
                f"block {block.path or '<root>'}: a backend sees parameters as graph inputs and cannot shard "
                f"experts. Use torch.compile(moepass.compile(model, moepass.Plan(form={block_plan.form!r}, ...)), "
                f"backend='moepass'), or form='single' here."
            )
        try:
            region = rewrite_region(gm, block, block_plan, tensor_inputs(gm))
        except Decline as why:
            region = Region(block.path, type(block.module).__name__, "passthrough", str(why))
        except Exception as err:  # the backend never raises on a model: the block runs as it is, the reason kept
            region = Region(block.path, type(block.module).__name__, "passthrough",
                            f"compiling the block failed: {type(err).__name__}: {err}")
        report.regions.append(region)
        changed |= region.action == "rewritten"
    if changed:
        gm.graph.lint()
        gm.recompile()
    report.nodes_after = len(gm.graph.nodes)
    return changed


def moepass_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None,
                    **kwargs: Any) -> Any:
    """torch.compile backend: rewrite MoE regions to the dialect, then hand the graph to `inner`."""
    if kwargs:
        options = {**(options or {}), **kwargs}
    plan, inner = _options(options)
    if plan.deterministic:  # the rewrite and the inner compile see the mode; the compiled graph runs under it
        with determinism.deterministic():
            compiled = _compile(gm, example_inputs, plan, inner)
        return determinism.scope().wrap(compiled)
    return _compile(gm, example_inputs, plan, inner)


def _compile(gm: fx.GraphModule, example_inputs: list[Any], plan: Plan, inner: Any) -> Any:
    start = time.perf_counter()
    report = new_report(inner if isinstance(inner, str) else repr(inner))
    count("graphs")
    transform(gm, plan, report, frame_scope())
    set_last_graph(gm)
    report.seconds = time.perf_counter() - start
    for action in ("rewritten", "kept", "passthrough"):
        count(f"regions_{action}", report.count(action))
    count("nodes_removed", sum(r.nodes_removed for r in report.regions))
    count("nodes_added", sum(r.nodes_added for r in report.regions))
    level = logging.INFO if report.changed else logging.DEBUG
    if any(r.action == "passthrough" for r in report.regions):
        level = logging.WARNING
    log.log(level, "%s", report.summary())
    return _inner_compile(inner, gm, example_inputs)


def register() -> None:
    """Register "moepass" with Dynamo (idempotent; defers to a pending entry point)."""
    from torch._dynamo.backends import registry

    if NAME in registry._COMPILER_FNS:
        return
    if registry._BACKENDS.get(NAME) is not None:  # the entry point is discovered: lookup_backend registers it
        return
    torch._dynamo.register_backend(moepass_backend, name=NAME)


register()
