"""Splicing a block's compiled dialect graph into the Dynamo graph in place of the block's nodes."""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
from torch import fx, nn

from moepass.backend.regions import Block
from moepass.backend.reports import Region
from moepass.plan import Plan

BACKEND_PASS = "backend"


class Decline(Exception):
    """A region cannot be rewritten; the message is the reason (the graph stays unchanged)."""


def tensor_inputs(gm: fx.GraphModule) -> dict[int, fx.Node]:
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
                value = operator.attrgetter(node.target)(gm)
            except AttributeError:
                continue
            if isinstance(value, torch.Tensor):
                found.setdefault(id(value), node)
    return found


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


SIZES = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool, torch.Size)


def _meta_value(node: fx.Node) -> Any:
    """The example value Dynamo (or shape propagation) recorded for `node`."""
    return node.meta.get("example_value", node.meta.get("val"))


def _is_size(node: fx.Node) -> bool:
    """A node computing a (symbolic) size or scalar, not a tensor: `sym_size`, `s0 * s1`, `x.size()`."""
    return isinstance(_meta_value(node), SIZES)


def shared_sizes(nodes: list[fx.Node]) -> set[fx.Node]:
    """The size arithmetic among a block's nodes that reads nothing the block computes: Dynamo computes a
    symbolic size once (`mul = s0 * s1` of the block's input) and later layers read it too. It stays in the
    graph; the dialect graph computes its own sizes from its tensors."""
    inside, shared = set(nodes), set()
    for node in nodes:  # graph order: a size read from shared sizes only is shared too
        if _is_size(node) and all(a not in inside or a in shared for a in node.all_input_nodes):
            shared.add(node)
    return shared


def _is_tensor_node(node: fx.Node) -> bool:
    return isinstance(_meta_value(node), torch.Tensor)


def _shape_of(node: fx.Node) -> tuple[Any, ...] | None:
    value = _meta_value(node)
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


def rewrite_region(gm: fx.GraphModule, block: Block, plan: Plan, tensors: dict[int, fx.Node]) -> Region:
    """Replace the nodes of `block` by its compiled dialect graph. Raises Decline (graph untouched)."""
    from moepass.pipeline import compile_block

    spec = block.spec.replace(path=block.path)
    sizes = shared_sizes(block.nodes)
    nodes = [n for n in block.nodes if n not in sizes]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    # Which tensors the block reads: every one must reach this graph (else the block is split).
    dialect = compile_block(spec, block.module, plan, traced=True)
    reads: dict[str, fx.Node] = {}
    for node in dialect.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(dialect)
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
    inputs = [n for n in inputs if _is_tensor_node(n) or n.op != "placeholder" and not _is_size(n)]
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
                env[node] = reads[node.target] if node.target in reads else operator.attrgetter(node.target)(dialect)
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

