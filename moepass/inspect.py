"""Looking at rewritten graphs: `diff`, `draw`, `set_debug`.

    print(moepass.diff(block, cm.layers[0].mlp))     # original block (traced or recorded) vs its dialect graph
    moepass.draw(cm, "model.svg")                    # every rewritten block, nodes coloured by pass
    moepass.set_debug(True)                          # log each pass with its time and counts

Provenance: every node a pass makes carries `node.meta["moepass"] = {"pass": ..., "block": ...}`
(the backend adds `"via": "backend"`); `draw` colours nodes by that pass. Communication nodes
(functional collectives, `moe_comm::*`) are labelled with their bytes and predicted time when the
node records them (`meta["moepass"]["bytes"]`, `["predicted_s"]`) or when a function registered in
`COMM_ANNOTATORS` returns them (the cost model's hook).
"""

from __future__ import annotations

import difflib
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx, nn

from moepass import process_state
from moepass.detect.graph_candidates import record_model, synthesize_inputs
from moepass.envflags import flag
from moepass.spec import MoESpec

log = logging.getLogger("moepass")

# ----------------------------------------------------------------------------------------------
# Debug logging.
# ----------------------------------------------------------------------------------------------

def set_debug(enabled: bool = True) -> None:
    """Log every pass (name, block, time, counts) and every backend decision to stderr.

    The same as `MOEPASS_DEBUG=1` at import, but at any time; `set_debug(False)` undoes it.
    """
    if enabled:
        if process_state.DEBUG_HANDLER.value is None:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            log.addHandler(handler)
            process_state.DEBUG_HANDLER.set(handler)
        log.setLevel(logging.DEBUG)
    else:
        if process_state.DEBUG_HANDLER.value is not None:
            log.removeHandler(process_state.DEBUG_HANDLER.value)
            process_state.DEBUG_HANDLER.clear()
        log.setLevel(logging.NOTSET)


if flag("MOEPASS_DEBUG") and not log.handlers and not logging.getLogger().handlers:
    set_debug(True)

# ----------------------------------------------------------------------------------------------
# diff.
# ----------------------------------------------------------------------------------------------


def _target(node: fx.Node) -> str:
    if node.op == "call_function":
        return getattr(node.target, "__name__", None) if not isinstance(node.target, torch._ops.OpOverload) \
            else str(node.target)  # type: ignore[return-value]
    return str(node.target)


def _arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    return repr(a)


def node_line(node: fx.Node) -> str:
    """One readable line per node: `name = op target(args)` (placeholders and outputs shortened)."""
    if node.op == "placeholder":
        return f"input {node.name}"
    if node.op == "output":
        return f"return {_arg(node.args[0])}"
    if node.op == "get_attr":
        return f"{node.name} = self.{node.target}"
    args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
    prefix = {"call_method": ".", "call_module": "self."}.get(node.op, "")
    return f"{node.name} = {prefix}{_target(node)}({args})"


def _as_graph(obj: fx.GraphModule | fx.Graph | nn.Module, example_inputs: Iterable[Any] | None,
              other: object) -> tuple[fx.Graph, str | None]:
    """The graph of one side of `diff`, and how it was made when it had to be recorded (else None)."""
    if isinstance(obj, fx.Graph):
        return obj, None
    if isinstance(obj, fx.GraphModule):
        return obj.graph, None
    if not isinstance(obj, nn.Module):
        raise ValueError(f"moepass.diff: expected a GraphModule, fx.Graph or nn.Module, got {type(obj).__name__}")
    try:
        return fx.symbolic_trace(obj).graph, None
    except Exception:  # data-dependent control flow (a loop over experts), a Hugging Face block: recorded instead
        pass
    inputs, how = _inputs_for(obj, example_inputs, other)
    recorded = record_model(obj, inputs)
    if isinstance(recorded, str):
        raise ValueError(f"moepass.diff: {type(obj).__name__} does not trace with torch.fx and could not be recorded "
                         f"on {how}: {recorded}; pass example_inputs=(x,), the block's own arguments")
    return recorded.graph, f"recorded on {how}: the torch calls it made, loops unrolled for that input"


def _inputs_for(module: nn.Module, example_inputs: Iterable[Any] | None, other: object) -> tuple[tuple[Any, ...], str]:
    """The arguments to record `module` on: `example_inputs`; else hidden states [2, 8, D] when the other side is a
    rewritten block (D: its spec's model width), in the module's dtype and device; else what detection would
    synthesize for it."""
    if example_inputs is not None:
        return tuple(example_inputs), "example_inputs"
    spec = getattr(other, "spec", None)
    if isinstance(spec, MoESpec):
        weight = next((p for p in module.parameters() if p.is_floating_point()), None)
        x = torch.randn(2, 8, spec.model_dim, generator=torch.Generator().manual_seed(0))
        if weight is not None and weight.device.type != "meta":
            x = x.to(device=weight.device, dtype=weight.dtype)
        return (x,), f"hidden states [2, 8, {spec.model_dim}] (the rewritten block's width)"
    synthesized = synthesize_inputs(module)
    if isinstance(synthesized, str):
        raise ValueError(f"moepass.diff: {type(module).__name__} does not trace with torch.fx and {synthesized}")
    return synthesized


def diff(before: fx.GraphModule | fx.Graph | nn.Module, after: fx.GraphModule | fx.Graph | nn.Module,
         example_inputs: Iterable[Any] | None = None, context: int = 2) -> str:
    """A readable unified diff of two graphs, one node per line, with a summary of ops added/removed.

    `before`/`after` may be GraphModules, fx Graphs, or modules: a module is traced with torch.fx, or, where
    fx cannot trace it (Hugging Face blocks, loops over experts), its forward is recorded as detection records
    it (`moepass.detect.capture`: every torch call, with parameters by their paths) on `example_inputs`, or
    without them on hidden states of the rewritten block's width (`diff(block, cm_block)`).
    """
    made = [_as_graph(g, example_inputs, other) for g, other in ((before, after), (after, before))]
    graphs = [graph for graph, _ in made]
    old, new = ([node_line(n) for n in g.nodes] for g in graphs)
    old_ops, new_ops = (_op_counts(g) for g in graphs)
    removed = {k: v - new_ops.get(k, 0) for k, v in old_ops.items() if v > new_ops.get(k, 0)}
    added = {k: v - old_ops.get(k, 0) for k, v in new_ops.items() if v > old_ops.get(k, 0)}
    lines = [f"graph diff: {len(old)} -> {len(new)} nodes",
             "  removed: " + (", ".join(f"{k} x{v}" for k, v in sorted(removed.items())) or "nothing"),
             "  added:   " + (", ".join(f"{k} x{v}" for k, v in sorted(added.items())) or "nothing")]
    lines += [f"  note: {side} {how}" for side, (_, how) in zip(("before", "after"), made) if how]
    body = list(difflib.unified_diff(old, new, "before", "after", n=context, lineterm=""))
    return "\n".join(lines + (body or ["(same nodes)"]))


def _op_counts(graph: fx.Graph) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            key = _target(node) if node.op != "call_module" else f"module {node.target}"
            counts[key] = counts.get(key, 0) + 1
    return counts


# ----------------------------------------------------------------------------------------------
# draw.
# ----------------------------------------------------------------------------------------------

PASS_COLOURS = {  # fill colour per pass that made a node; other passes get a colour from PALETTE
    None: "white",  # the user's own nodes (not made by moepass)
    "canonical": "#cfe2f3",
    "rewrite:ep": "#d9ead3",
    "schedule": "#fff2cc",
    "lower": "#f4cccc",
}
PALETTE = ("#d9d2e9", "#fce5cd", "#d0e0e3", "#ead1dc", "#c9daf8", "#b6d7a8")
COMM_NAMESPACES = ("_c10d_functional", "c10d_functional", "moe_comm")

# A communication node's extra label, e.g. from the cost model: node -> (bytes, predicted seconds) or None.
CommAnnotator = Callable[[fx.Node], "tuple[int | None, float | None] | None"]
COMM_ANNOTATORS: list[CommAnnotator] = process_state.COMM_ANNOTATORS  # the process's list: append to add one


def pass_of(node: fx.Node) -> str | None:
    return (node.meta.get("moepass") or {}).get("pass")


def is_comm(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.namespace in COMM_NAMESPACES


def _comm_label(node: fx.Node, annotate: CommAnnotator | None) -> str:
    meta = node.meta.get("moepass") or {}
    sent, seconds = meta.get("bytes"), meta.get("predicted_s")
    for fn in ([annotate] if annotate else []) + COMM_ANNOTATORS:
        found = fn(node)
        if found:
            sent, seconds = sent if found[0] is None else found[0], seconds if found[1] is None else found[1]
    parts = [f"{sent / 2**20:.2f} MiB" if isinstance(sent, (int, float)) else "bytes: run-time",
             f"{seconds * 1e3:.3f} ms predicted" if isinstance(seconds, (int, float)) else ""]
    return " | ".join(p for p in parts if p)


def _graphs_of(obj: nn.Module | fx.GraphModule) -> list[tuple[str, fx.GraphModule]]:
    if isinstance(obj, fx.GraphModule):
        return [("", obj)]
    found = [(path, m) for path, m in obj.named_modules() if isinstance(m, fx.GraphModule)]
    if not found:
        raise ValueError(f"moepass.draw: {type(obj).__name__} holds no graph; pass a GraphModule or a model "
                         f"returned by moepass.compile (its MoE blocks are graph modules)")
    return found


def to_dot(obj: nn.Module | fx.GraphModule, annotate: CommAnnotator | None = None) -> Any:
    """A pydot graph: one cluster per graph module, nodes coloured by the pass that made them."""
    try:
        import pydot
    except ImportError:
        raise ImportError("moepass.draw needs pydot, which is not installed: pip install pydot (or pip install "
                          "'moepass[draw]'); rendering .svg/.png also needs graphviz's `dot` (apt-get install "
                          "graphviz), a .dot file does not") from None

    dot = pydot.Dot("moepass", graph_type="digraph", rankdir="TB", fontname="Helvetica")
    colours = dict(PASS_COLOURS)
    used: dict[str | None, str] = {}
    for index, (path, gm) in enumerate(_graphs_of(obj)):
        cluster = pydot.Cluster(f"g{index}", label=f'"{path or type(gm).__name__}"', style="rounded")
        ids = {}
        for node in gm.graph.nodes:
            made_by = pass_of(node)
            if made_by not in colours:
                colours[made_by] = PALETTE[(len(colours) - len(PASS_COLOURS)) % len(PALETTE)]
            used[made_by] = colours[made_by]
            label = f"{node.name}\\n{_target(node) if node.op != 'placeholder' else 'input'}"
            shape = "box"
            if is_comm(node):
                label += "\\n" + _comm_label(node, annotate)
                shape = "hexagon"
            ids[node] = f"g{index}_{node.name}"
            cluster.add_node(pydot.Node(ids[node], label=f'"{label}"', shape=shape, style="filled",
                                        fillcolor=colours[made_by], fontname="Helvetica", fontsize="10",
                                        tooltip=f'"{made_by or "user"}"'))
        for node in gm.graph.nodes:
            for arg in node.all_input_nodes:
                cluster.add_edge(pydot.Edge(ids[arg], ids[node]))
        dot.add_subgraph(cluster)  # type: ignore[arg-type]
    legend = pydot.Cluster("legend", label='"made by pass"', style="dashed")
    for i, (name, colour) in enumerate(used.items()):
        legend.add_node(pydot.Node(f"legend{i}", label=f'"{name or "user / Dynamo"}"', shape="box", style="filled",
                                   fillcolor=colour, fontname="Helvetica", fontsize="10"))
    dot.add_subgraph(legend)  # type: ignore[arg-type]
    return dot


def draw(obj: nn.Module | fx.GraphModule, path: str, annotate: CommAnnotator | None = None) -> str:
    """Write the graph(s) of `obj` to `path`; the format comes from the suffix (.svg, .png, .pdf, .dot).

    Needs pydot (`pip install pydot`, or the `moepass[draw]` extra); rendering needs graphviz's `dot` (Debian:
    `apt-get install graphviz`), `.dot` is written without it. Returns the path written.
    """
    dot = to_dot(obj, annotate)
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "svg"
    if fmt in ("dot", "gv"):
        dot.write_raw(path)
        return path
    if shutil.which("dot") is None:
        raise RuntimeError(f"moepass.draw: rendering {path!r} needs graphviz's `dot` executable, which is not "
                           f"installed (apt-get install graphviz); write a .dot file instead")
    dot.write(path, format=fmt)
    return path
