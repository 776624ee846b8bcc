"""From the nodes of a Dynamo graph to the user's module objects and their MoE blocks (detection cached per module)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

from moepass.backend.reports import BackendReport, Region
from moepass.canonical import MoEGraphModule
from moepass.process_state import DETECTED


def frame_scope() -> dict[str, Any] | None:
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


class Modules:
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


@contextlib.contextmanager
def own_forward(module: nn.Module) -> Iterator[None]:
    """While detection runs `module`: its own forward where the user replaced it by a compiled one (Hugging
    Face's recipe `model.forward = torch.compile(model.forward, backend="moepass")`), so that recording the
    model does not enter Dynamo again (it would trace detection's own spies); restored on the way out."""
    compiled = module.__dict__.get("forward")
    original = getattr(compiled, "_torchdynamo_orig_callable", None)
    if original is None:
        yield
        return
    module.__dict__["forward"] = original
    try:
        yield
    finally:
        module.__dict__["forward"] = compiled


def _detect(module: nn.Module) -> Any:
    """The detection report of `module`, kept per module object (`moepass.process_state.DETECTED`: weak, a module
    that goes away takes its report with it)."""
    report = DETECTED.get(module)
    if report is None:
        from moepass.detect import detect

        with own_forward(module):
            report = DETECTED[module] = detect(module)
        for detail in report.details:  # each accepted block, as seen from itself (another frame's root)
            if detail.accepted and detail.spec is not None and detail.path and detail.path not in report.outlines:
                block = module.get_submodule(detail.path)
                if block not in DETECTED:
                    alone = dataclasses.replace(detail, path="", spec=detail.spec.replace(path=""))
                    DETECTED[block] = type(report)(details=[alone])
    return report


@dataclass
class Block:
    module: nn.Module
    path: str  # display path from the frame root
    spec: Any = None  # MoESpec (None: an MoEGraphModule, already in the dialect)
    nodes: list[fx.Node] = field(default_factory=list)
    stack: dict[str, Any] = field(default_factory=dict)  # nn_module_stack down to the block (for new nodes)


def blocks_of(gm: fx.GraphModule, modules: Modules, frame_self: nn.Module | None,
            report: BackendReport) -> list[Block]:
    """Every MoE block whose nodes are in `gm`: rewritten ones (MoEGraphModule) and detected ones."""
    roots: list[tuple[nn.Module, str]] = []
    if frame_self is not None:
        roots.append((frame_self, ""))
    else:
        roots += [modules.by_id[i] for i in modules.outermost]
    blocks: list[Block] = []
    for root, root_path in roots:
        prefix = root_path + "." if root_path else ""
        compiled = [(p, m) for p, m in root.named_modules() if isinstance(m, MoEGraphModule)]
        if compiled:  # moepass.compile ran: its blocks are dialect already; nothing else is searched
            blocks += [Block(m, prefix + p) for p, m in compiled]
            continue
        try:
            detection = _detect(root)
        except Exception as err:  # detection never breaks compilation
            report.diagnostics.append(f"detection failed on {root_path or '<root>'}: {type(err).__name__}: {err}")
            continue
        for path, reason in detection.rejected:
            report.regions.append(Region(prefix + path, type(root.get_submodule(path)).__name__, "passthrough",
                                         f"not rewritten: detection rejected it ({reason})"))
        for s in detection.blocks:
            if s.path in detection.outlines:  # not a module of the frame: its host's forward would need rewriting
                report.regions.append(Region(prefix + s.path, "outlined", "passthrough",
                                             "not rewritten: an MoE region outlined from its host's forward "
                                             "(moepass.detect.outline), which this backend does not splice; use "
                                             "torch.compile(moepass.compile(model, plan))"))
                continue
            blocks.append(Block(root.get_submodule(s.path), prefix + s.path, s))
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

