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

import collections
import dataclasses
import logging
import re
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from moepass.canonical import MoEGraphModule
from moepass.errors import PlanError, nearest
from moepass.plan import Plan

log = logging.getLogger("moepass")

NAME = "moepass"
BACKEND_PASS = "backend"
OPTIONS = ("plan", "inner")
DEFAULT_INNER = "inductor"
MAX_REPORTS = 64

COUNTERS: collections.Counter[str] = collections.Counter()


# ----------------------------------------------------------------------------------------------
# What the backend did: one report per Dynamo graph.
# ----------------------------------------------------------------------------------------------


@dataclass
class Region:
    """One MoE block found in a Dynamo graph and what the backend did with it."""

    path: str  # module path from the compiled frame's root (e.g. "model.layers.0.mlp")
    module_type: str
    action: str  # "rewritten" | "kept" (already dialect) | "passthrough"
    reason: str = ""
    nodes_removed: int = 0
    nodes_added: int = 0


@dataclass
class BackendReport:
    graph: int  # running index of the graphs this process handed to the backend
    inner: str
    frame: str = ""  # type of the module whose forward Dynamo compiled (region paths are relative to it)
    nodes_before: int = 0
    nodes_after: int = 0
    regions: list[Region] = field(default_factory=list)
    diagnostics: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def count(self, action: str) -> int:
        return sum(r.action == action for r in self.regions)

    @property
    def rewritten(self) -> int:
        return self.count("rewritten")

    @property
    def changed(self) -> bool:
        return self.rewritten > 0

    def summary(self) -> str:
        frame = f" ({self.frame}.forward)" if self.frame else ""
        lines = [f"moepass backend, graph {self.graph}{frame}: {self.nodes_before} -> {self.nodes_after} nodes, "
                 f"{self.rewritten} region(s) rewritten, {self.count('kept')} kept, "
                 f"{self.count('passthrough')} passed through ({self.seconds * 1e3:.1f} ms, inner={self.inner})"]
        for r in self.regions:
            detail = f" (-{r.nodes_removed} +{r.nodes_added} nodes)" if r.action == "rewritten" else ""
            lines.append(f"  {r.path or '<root>'} ({r.module_type}): {r.action}{detail}"
                         + (f": {r.reason}" if r.reason else ""))
        lines += [f"  note: {d}" for d in self.diagnostics]
        return "\n".join(lines)


_REPORTS: collections.deque[BackendReport] = collections.deque(maxlen=MAX_REPORTS)
_GRAPHS = 0
_LAST_GRAPH: weakref.ref[fx.GraphModule] | None = None


def last_report() -> BackendReport | None:
    """What the backend did to the last graph it was given (None before the first)."""
    return _REPORTS[-1] if _REPORTS else None


def last_graph() -> fx.GraphModule | None:
    """The last graph the backend handed to its inner compiler (after the rewrite)."""
    return _LAST_GRAPH() if _LAST_GRAPH is not None else None


def reports() -> list[BackendReport]:
    """The reports of the last graphs (at most MAX_REPORTS), oldest first."""
    return list(_REPORTS)


def reset() -> None:
    """Forget reports and counters (the detection cache is per module and needs no reset)."""
    global _GRAPHS
    _REPORTS.clear()
    COUNTERS.clear()
    _GRAPHS = 0


def _count(name: str, n: int = 1) -> None:
    COUNTERS[name] += n
    from torch._dynamo.utils import counters

    counters[NAME][name] += n


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
# From nodes to the user's modules.
# ----------------------------------------------------------------------------------------------


def _frame_scope() -> dict[str, Any] | None:
    """{"L": f_locals, "G": f_globals} of the frame Dynamo is compiling, or None outside Dynamo."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # not inside a Dynamo compilation (e.g. the backend called on a plain GraphModule)
        return None
    if tx is None:
        return None
    return {"L": tx.f_locals, "G": tx.f_globals}


_SOURCE = re.compile(r"^([LG])\[['\"]([^'\"]+)['\"]\](.*)$")


def _dotted(rest: str) -> str:
    """`._modules['mlp']`, `['mlp']`, `[0]`, `.mlp` -> `.mlp` / `.0` pieces, joined without the leading dot."""
    rest = re.sub(r"\._modules\[['\"]([^'\"]*)['\"]\]|\[['\"]([^'\"]*)['\"]\]|\[(\d+)\]",
                  lambda m: "." + next(g for g in m.groups() if g is not None), rest)
    return rest.lstrip(".")


def resolve_source(source: str, scope: dict[str, Any]) -> Any:
    """The object a Dynamo nn_module_stack source names (`L['self'].layers.0.mlp`) in the compiled frame."""
    match = _SOURCE.match(source)
    if match is None:
        raise ValueError(f"unsupported source {source!r}")
    obj = scope[match.group(1)][match.group(2)]
    path = _dotted(match.group(3))
    if not path:
        return obj
    if isinstance(obj, nn.Module):
        return obj.get_submodule(path)
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() and not hasattr(obj, part) else getattr(obj, part)
    return obj


def _display_path(source: str) -> str:
    """`L['self'].model.layers[0]._modules['mlp']` -> `model.layers.0.mlp` (for reports)."""
    match = _SOURCE.match(source)
    if match is None:
        return source
    path = _dotted(match.group(3))
    return path if match.group(2) == "self" else ".".join(p for p in (match.group(2), path) if p)


class _Modules:
    """The module objects behind a graph's nn_module_stack entries."""

    def __init__(self, gm: fx.GraphModule, scope: dict[str, Any] | None):
        self.by_id: dict[int, tuple[nn.Module, str]] = {}  # id -> (module, display path)
        self.node_modules: dict[fx.Node, set[int]] = {}
        self.outermost: list[int] = []  # first stack entry of some node, in graph order
        self.unresolved: set[str] = set()
        cache: dict[str, int | None] = {}
        self.ids_of_source = cache
        for node in gm.graph.nodes:
            ids: set[int] = set()
            for i, (source, _type) in enumerate((node.meta.get("nn_module_stack") or {}).values()):
                if source not in cache:
                    cache[source] = self._resolve(source, scope)
                key = cache[source]
                if key is None:
                    continue
                ids.add(key)
                if i == 0 and key not in self.outermost:
                    self.outermost.append(key)
            self.node_modules[node] = ids

    def _resolve(self, source: str, scope: dict[str, Any] | None) -> int | None:
        if scope is None:
            self.unresolved.add(source)
            return None
        try:
            module = resolve_source(source, scope)
        except Exception:
            self.unresolved.add(source)
            return None
        if not isinstance(module, nn.Module):
            return None
        self.by_id.setdefault(id(module), (module, _display_path(source)))
        return id(module)


# Detection per module object (weak: a module that goes away takes its report with it).
_DETECTED: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _detect(module: nn.Module) -> Any:
    report = _DETECTED.get(module)
    if report is None:
        from moepass.detect import detect

        report = _DETECTED[module] = detect(module)
        for detail in report.details:  # each accepted block, as seen from itself (another frame's root)
            if detail.accepted and detail.spec is not None and detail.path:
                block = module.get_submodule(detail.path)
                if block not in _DETECTED:
                    alone = dataclasses.replace(detail, path="", spec=detail.spec.replace(path=""))
                    _DETECTED[block] = type(report)(details=[alone])
    return report


@dataclass
class _Block:
    module: nn.Module
    path: str  # display path from the frame root
    spec: Any = None  # MoESpec (None: an MoEGraphModule, already in the dialect)
    nodes: list[fx.Node] = field(default_factory=list)
    stack: dict[str, Any] = field(default_factory=dict)  # nn_module_stack down to the block (for new nodes)


def _blocks(gm: fx.GraphModule, modules: _Modules, frame_self: nn.Module | None,
            report: BackendReport) -> list[_Block]:
    """Every MoE block whose nodes are in `gm`: rewritten ones (MoEGraphModule) and detected ones."""
    roots: list[tuple[nn.Module, str]] = []
    if frame_self is not None:
        roots.append((frame_self, ""))
    else:
        roots += [modules.by_id[i] for i in modules.outermost]
    blocks: list[_Block] = []
    for root, root_path in roots:
        prefix = root_path + "." if root_path else ""
        compiled = [(p, m) for p, m in root.named_modules() if isinstance(m, MoEGraphModule)]
        if compiled:  # moepass.compile ran: its blocks are dialect already; nothing else is searched
            blocks += [_Block(m, prefix + p) for p, m in compiled]
            continue
        try:
            detection = _detect(root)
        except Exception as err:  # detection never breaks compilation
            report.diagnostics.append(f"detection failed on {root_path or '<root>'}: {type(err).__name__}: {err}")
            continue
        for path, reason in detection.rejected:
            report.regions.append(Region(prefix + path, type(root.get_submodule(path)).__name__, "passthrough",
                                         f"not rewritten: detection rejected it ({reason})"))
        blocks += [_Block(root.get_submodule(s.path), prefix + s.path, s) for s in detection.blocks]
    all_nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    for block in blocks:
        if block.module is frame_self:  # the frame is the block's own forward: the whole graph
            block.nodes = all_nodes
        else:
            block.nodes = [n for n in all_nodes if id(block.module) in modules.node_modules[n]]
        if block.nodes:
            entries = list((block.nodes[0].meta.get("nn_module_stack") or {}).items())
            ids = [modules.ids_of_source.get(source) for _key, (source, _type) in entries]
            cut = ids.index(id(block.module)) + 1 if id(block.module) in ids else 0
            block.stack = dict(entries[:cut])
    for block in blocks:
        if not block.nodes and block.spec is not None:
            report.regions.append(Region(
                block.path, type(block.module).__name__, "passthrough",
                "none of its nodes is in this graph: Dynamo broke the graph at or inside the block (graph "
                "break), so it runs outside this graph; use torch.compile(moepass.compile(model, plan)) for "
                "one graph"))
    return [b for b in blocks if b.nodes]


# ----------------------------------------------------------------------------------------------
# Splicing a block's dialect graph into the Dynamo graph.
# ----------------------------------------------------------------------------------------------


class Decline(Exception):
    """A region cannot be rewritten; the message is the reason (the graph stays unchanged)."""


def _tensor_inputs(gm: fx.GraphModule) -> dict[int, fx.Node]:
    """id(tensor) -> the node that carries that real tensor into the graph (placeholder or get_attr)."""
    found: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            arg = node.meta.get("grapharg")
            example = getattr(arg, "example", None) if arg is not None else None
            if isinstance(example, torch.Tensor):
                found.setdefault(id(example), node)
        elif node.op == "get_attr":
            try:
                value = getattr_path(gm, node.target)
            except AttributeError:
                continue
            if isinstance(value, torch.Tensor):
                found.setdefault(id(value), node)
    return found


def getattr_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _region_io(gm: fx.GraphModule, nodes: list[fx.Node], params: set[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    inside = set(nodes)
    inputs: list[fx.Node] = []
    outputs: list[fx.Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in params and arg not in inputs:
                inputs.append(arg)
        if any(user not in inside for user in node.users):
            outputs.append(node)
    return inputs, outputs


def _is_tensor_node(node: fx.Node) -> bool:
    value = node.meta.get("example_value", node.meta.get("val"))
    return isinstance(value, torch.Tensor)


def _shape_of(node: fx.Node) -> tuple[Any, ...] | None:
    value = node.meta.get("example_value", node.meta.get("val"))
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _slug(path: str) -> str:
    return re.sub(r"\W", "_", path) or "root"


def _functional_caller(module: nn.Module, path: str, tensors: dict[int, fx.Node]) -> tuple[Any, list[fx.Node]]:
    """A function calling `module` with its parameters and buffers taken from graph inputs.

    Dynamo hands parameters to the backend as placeholders and AOT autograd expects no others, so a
    submodule the spec calls runs through `torch.func.functional_call` on those placeholders (its
    forward and hooks run as the user wrote them; gradients reach the user's parameters).
    """
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    missing = [name for name, t in named if id(t) not in tensors]
    if missing:
        raise Decline(f"the tensors {missing} of its submodule {path!r} are not inputs of this graph")
    names = [name for name, _ in named]

    def call(*args: Any, **kwargs: Any) -> Any:
        split = len(args) - len(names)
        return torch.func.functional_call(module, dict(zip(names, args[split:])), args[:split], kwargs)

    call.__name__ = call.__qualname__ = "call_" + _slug(path)
    return call, [tensors[id(t)] for _name, t in named]


def rewrite_region(gm: fx.GraphModule, block: _Block, plan: Plan, tensors: dict[int, fx.Node]) -> Region:
    """Replace the nodes of `block` by its compiled dialect graph. Raises Decline (graph untouched)."""
    from moepass.pipeline import compile_block

    spec = block.spec.replace(path=block.path)
    nodes = block.nodes
    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    # Which tensors the block reads: every one must reach this graph (else the block is split).
    dialect = compile_block(spec, block.module, plan)
    reads: dict[str, fx.Node] = {}
    for node in dialect.graph.nodes:
        if node.op == "get_attr":
            value = getattr_path(dialect, node.target)
            if isinstance(value, torch.Tensor):
                if id(value) not in tensors:
                    raise Decline(f"its tensor {node.target!r} is not an input of this graph (the block is split "
                                  f"by a graph break?): compile it with moepass.compile(model) first")
                reads[node.target] = tensors[id(value)]
    owned = [t for t in [*block.module.parameters(), *block.module.buffers()] if id(t) in tensors]
    params = set(reads.values()) | {tensors[id(t)] for t in owned}  # the block's tensors in this graph
    if not any(n in params for node in nodes for n in node.all_input_nodes):
        raise Decline("none of its expert weights is read by this graph (the block is split by a graph break): "
                      "use torch.compile(moepass.compile(model, plan)) for one graph")
    inputs, outputs = _region_io(gm, nodes, params | {n for n in gm.graph.nodes if n.op == "placeholder"
                                                      and not _is_tensor_node(n)})
    inputs = [n for n in inputs if _is_tensor_node(n) or n.op != "placeholder"]
    placeholders = [n for n in dialect.graph.nodes if n.op == "placeholder"]
    if len(inputs) != len(placeholders):
        raise Decline(f"its nodes read {len(inputs)} graph value(s) besides its weights "
                      f"({[n.name for n in inputs]}); the spec takes {[n.target for n in placeholders]}")
    last = max(nodes, key=order.__getitem__)
    for out in outputs:
        for user in out.users:
            if user not in nodes and order[user] < order[last]:
                raise Decline(f"{user.name} uses the block's value {out.name} before the block ends")

    # Map the dialect graph's outputs onto the region's outputs.
    (result,) = [n.args[0] for n in dialect.graph.nodes if n.op == "output"]
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    if len(results) != len(outputs):
        raise Decline(f"{len(outputs)} of its values are used after it ({[n.name for n in outputs]}), the spec "
                      f"returns {len(results)}")
    if len(outputs) > 1:  # hidden states (the input's shape) first, then the side output (router logits)
        hidden = [o for o in outputs if _shape_of(o) is not None and _shape_of(o) == _shape_of(inputs[0])]
        if len(outputs) > 2 or len(hidden) != 1:
            raise Decline(f"its values used after it ({[n.name for n in outputs]}) cannot be told apart by shape")
        outputs = hidden + [o for o in outputs if o is not hidden[0]]

    # Submodules the spec calls run on the graph's inputs (checked before the graph is touched).
    callers = {node: _functional_caller(dialect.get_submodule(node.target),
                                        f"{block.path}.{node.target}".lstrip("."), tensors)
               for node in dialect.graph.nodes if node.op == "call_module"}

    # Splice, after the block's last node.
    env: dict[fx.Node, Any] = dict(zip(placeholders, inputs))
    added = 0
    new_results: list[Any] = []
    with gm.graph.inserting_before(last.next):
        for node in dialect.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                new_results = [env[r] for r in results]
                continue
            if node.op == "get_attr":  # a weight: its placeholder; anything else (e.g. `training`): its value
                env[node] = reads[node.target] if node.target in reads else getattr_path(dialect, node.target)
                continue
            args = fx.map_arg(node.args, env.__getitem__)
            kwargs = fx.map_arg(node.kwargs, env.__getitem__)
            if node.op == "call_module":  # the user's submodule (router, shared expert), on the graph's inputs
                caller, weights = callers[node]
                new = gm.graph.call_function(caller, (*args, *weights), kwargs)
            else:
                new = gm.graph.create_node(node.op, node.target, args, kwargs, name=node.name)
            new.meta = {**node.meta, "nn_module_stack": dict(block.stack),
                        "moepass": {**node.meta.get("moepass", {}), "via": BACKEND_PASS}}
            env[node] = new
            added += 1
    for old, new in zip(outputs, new_results):
        old.replace_all_uses_with(new)
    removed = 0
    for node in reversed(sorted(nodes, key=order.__getitem__)):
        if node.users:
            raise AssertionError(f"moepass backend: {node.name} of {block.path} still has users after the rewrite")
        gm.graph.erase_node(node)
        removed += 1
    return Region(block.path, type(block.module).__name__, "rewritten", "", removed, added)


# ----------------------------------------------------------------------------------------------
# The backend.
# ----------------------------------------------------------------------------------------------


def transform(gm: fx.GraphModule, plan: Plan, report: BackendReport, scope: dict[str, Any] | None = None) -> bool:
    """Rewrite the MoE regions of a Dynamo graph in place; True if anything changed."""
    report.nodes_before = report.nodes_after = len(gm.graph.nodes)
    modules = _Modules(gm, scope)
    frame_self = scope["L"].get("self") if scope is not None else None
    frame_self = frame_self if isinstance(frame_self, nn.Module) else None
    report.frame = type(frame_self).__name__ if frame_self is not None else ""
    if scope is None:
        report.diagnostics.append("not called from a Dynamo compilation: module objects are unknown, graph "
                                  "passed through (use torch.compile(model, backend='moepass'))")
        return False
    blocks = _blocks(gm, modules, frame_self, report)
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
            region = rewrite_region(gm, block, block_plan, _tensor_inputs(gm))
        except Decline as why:
            region = Region(block.path, type(block.module).__name__, "passthrough", str(why))
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
    global _GRAPHS, _LAST_GRAPH
    if kwargs:
        options = {**(options or {}), **kwargs}
    plan, inner = _options(options)
    start = time.perf_counter()
    report = BackendReport(graph=_GRAPHS, inner=inner if isinstance(inner, str) else repr(inner))
    _GRAPHS += 1
    _REPORTS.append(report)
    _count("graphs")
    transform(gm, plan, report, _frame_scope())
    _LAST_GRAPH = weakref.ref(gm)
    report.seconds = time.perf_counter() - start
    for action in ("rewritten", "kept", "passthrough"):
        _count(f"regions_{action}", report.count(action))
    _count("nodes_removed", sum(r.nodes_removed for r in report.regions))
    _count("nodes_added", sum(r.nodes_added for r in report.regions))
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
