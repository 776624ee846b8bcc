"""Outlining: the MoE region of a module whose own forward also computes other things, as a block of its own.

Some layers route and run their experts inline, beside attention, norms and residuals (Gemma-4's decoder
layer calls `self.router` and `self.experts` itself): the smallest module holding the selection and the
experts is the whole layer, which no MoESpec describes. When detection rejects such a module (the host),
its forward is traced with torch.fx, every submodule a leaf (`HostTracer`: the host's own code, one level
deep), and run once on the call the model made to it (`Candidate.call`) to see which node selects over E
scores. Then, all from the graph (no name, no class):

    selection  S   the node during which a top-k / argmax / descending sort over E >= 2 scores runs
    experts    X   nodes after S that take an integer tensor computed from S and read parameters (a module
                   holding parameters, or a parameter indexed by expert id)
    input      h   the latest node both S and every X depend on: the tokens routing and experts share
    region         every node after h that S or an X depends on, and the X (router, selection, what feeds
                   the experts from h: a norm on their input); its values used outside are its outputs

The region must read nothing from the host's graph but h (and the host's tensors); it becomes an fx
GraphModule (`Outline.block_of`) holding the host's router and expert modules by reference, and the host's
graph calls it as the child `Outline.name`. That block goes through detection like any other; compile
(`Outline.apply`, on its copy of the model) registers it in the host and gives the host the traced forward
with the region replaced by the call. The host keeps its other children and attributes (its class, hooks
and `__call__` too: only its `forward` is the traced one), and keeps registering the modules the block
shares (router, experts), first: `named_parameters()` and `state_dict()` name every tensor as the user's
model does (the block's aliases are dropped from the state dict and filled from the original keys when
one is loaded). Under EP and FSEP the rewritten block's layout (`runtime.layout.expert_layouts`) is keyed by the
block's path while its sharded experts keep the host's names: `adopt` marks the rewritten block with its host
(`runtime.layout.OUTLINED_FROM`), and `runtime.layout.user_prefix` puts the layout's relative names under the host's
path, so `logical_grads`, `logical_state_dict`, DDP's ignore list and the replica gradient sums name them as the
user's model does. HP and locality are refused for an outlined block (`pipeline.refuse_distributed_outlines`,
naming the way out).
"""

from __future__ import annotations

import copy
import inspect
import operator
import types
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from moepass.detect.candidate import Candidate
from moepass.detect.candidates import ModuleTree, find_candidates, probe_value
from moepass.detect.capture import ARGMAX, SORT, TOPK, ModuleCall, downstream, upstream
from moepass.detect.check import probe_copy
from moepass.detect.graph_candidates import graph_blocks, record_model
from moepass.runtime.layout import OUTLINED_FROM

BLOCK_NAME = "moe"  # the outlined block's child name in its host ("moe_1", ... when taken)


class HostTracer(fx.Tracer):
    """Traces a module's own forward: every submodule is a leaf (called, not traced into)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


@dataclass
class Outline:
    """Where an outlined block comes from: its host (model path), its child name there, its graph (the region,
    with the host's names) and the host's graph calling it."""

    host: str
    name: str
    block_graph: fx.Graph
    host_graph: fx.Graph

    @property
    def path(self) -> str:
        return f"{self.host}.{self.name}" if self.host else self.name

    def rerooted(self, host: str) -> Outline:
        """The same outline for a structurally identical host at `host`."""
        return replace(self, host=host)

    def block_of(self, host: nn.Module) -> fx.GraphModule:
        """The outlined block on `host` (not registered in it): the region's graph over the host's own modules
        and tensors, by reference."""
        return fx.GraphModule(host, copy.deepcopy(self.block_graph), class_name="OutlinedMoE")

    def apply(self, host: nn.Module) -> fx.GraphModule:
        """Register the outlined block in `host` (a compile copy) and give `host` the forward that calls it."""
        block = self.block_of(host)
        host.add_module(self.name, block)
        traced = fx.GraphModule(host, copy.deepcopy(self.host_graph))
        host.forward = types.MethodType(type(traced).forward, host)  # type: ignore[method-assign]
        host.register_state_dict_post_hook(partial(_drop_aliases, name=self.name))
        host.register_load_state_dict_pre_hook(partial(_fill_aliases, name=self.name))
        return block

    def adopt(self, host: nn.Module, rewritten: nn.Module) -> None:
        """After the block's rewrite: the host's children the block shared are the rewritten block's (a form
        that replaced one, e.g. experts placed across ranks), or gone when the rewrite dropped them. The rewritten
        block records its host (`runtime.layout.OUTLINED_FROM`): its layout's relative names are the user's under
        the host's path (`runtime.layout.user_prefix`), for checkpoints and gradients."""
        setattr(rewritten, OUTLINED_FROM, self.host)
        for name in [n for n in self.block_of_names() if n in host._modules]:
            if name in rewritten._modules:
                host._modules[name] = rewritten._modules[name]
            else:
                del host._modules[name]

    def block_of_names(self) -> list[str]:
        """The host's children the block's graph calls or reads (first component of each target)."""
        return list(dict.fromkeys(str(n.target).split(".")[0] for n in self.block_graph.nodes
                                  if n.op in ("call_module", "get_attr")))


def _drop_aliases(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any,
                  name: str) -> None:
    """State-dict post-hook of a host: the block's entries that alias one of the host's (same tensor under the
    host's own name) are dropped, so the keys are the user's model's."""
    inner = f"{prefix}{name}."
    for key in [k for k in state_dict if k.startswith(inner)]:
        if f"{prefix}{key[len(inner):]}" in state_dict:
            del state_dict[key]


def _fill_aliases(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                  missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str], name: str) -> None:
    """Load-state-dict pre-hook of a host: the block's entries are filled from the user's keys they alias."""
    block = module._modules.get(name)
    if block is None:
        return
    for key in block.state_dict(keep_vars=True):
        original, aliased = f"{prefix}{key}", f"{prefix}{name}.{key}"
        if aliased not in state_dict and original in state_dict:
            state_dict[aliased] = state_dict[original]


class _SelectionSpy(TorchFunctionMode):
    """Counts top-k / argmax / descending sorts over the last dim of E floating scores."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.E, self.seen = num_experts, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        scores = args[0] if args else None
        if func in TOPK + ARGMAX + SORT and isinstance(scores, torch.Tensor) and scores.is_floating_point() \
                and scores.dim() >= 1 and scores.shape[-1] == self.E:
            self.seen += 1
        return func(*args, **kwargs)


class _Run(fx.Interpreter):
    """Runs the host's traced graph, keeping each node's value and whether it selected over E scores. A submodule
    call returns what the model's recorded forward saw it return (`calls`: its recorded calls by path relative to
    the host, in order), so nothing the host holds (attention, a cache) runs again; the host's own code runs."""

    def __init__(self, gm: fx.GraphModule, num_experts: int, calls: dict[str, list[Any]]):
        super().__init__(gm)
        self.E = num_experts
        self.calls = calls
        self.values: dict[fx.Node, Any] = {}
        self.selecting: list[fx.Node] = []

    def run_node(self, n: fx.Node) -> Any:
        recorded = self.calls.get(str(n.target)) if n.op == "call_module" else None
        if recorded:
            out = recorded.pop(0)
            if str(n.target) in self.selecting_modules:
                self.selecting.append(n)
        else:
            spy = _SelectionSpy(self.E)
            with spy:
                out = super().run_node(n)
            if spy.seen:
                self.selecting.append(n)
        self.values[n] = out
        return out

    selecting_modules: frozenset[str] = frozenset()  # the submodules (relative paths) the selection ran in


def _trace(host: nn.Module, call_args: tuple, call_kwargs: dict) -> tuple[fx.GraphModule, dict[str, Any]] | str:
    """The host's forward traced (submodules as leaves), with its inputs as named by its signature bound to the
    recorded call; or why it cannot be."""
    forward = type(host).forward
    try:
        signature = inspect.signature(forward)
        bound = signature.bind(host, *call_args, **call_kwargs)
    except (TypeError, ValueError) as err:
        return f"its recorded call does not bind to its forward: {err}"
    params = list(signature.parameters.values())[1:]
    names, given, defaults = [], {}, {}
    for p in params:
        if p.kind == p.VAR_POSITIONAL:
            if bound.arguments.get(p.name):
                return "the model passes it *args, which the traced forward cannot name"
            continue
        if p.kind == p.VAR_KEYWORD:
            for key, v in bound.arguments.get(p.name, {}).items():
                names.append(key)
                given[key] = v
            continue
        names.append(p.name)
        given[p.name] = bound.arguments.get(p.name, p.default)
        if p.default is not p.empty:
            defaults[p.name] = p.default
    scope: dict[str, Any] = {"_forward": forward, **{f"_default_{n}": v for n, v in defaults.items()}}
    header = ", ".join(f"{n}=_default_{n}" if n in defaults else n for n in names)
    passed = ", ".join(f"{n}={n}" for n in names)
    # a forward of the recorded call's names (what the host graph's placeholders are called)
    exec(compile(f"def forward(self, {header}):\n    return _forward(self, {passed})\n", "<moepass outline>", "exec"),
         scope)
    shell_type = type(type(host).__name__, (type(host),), {"forward": scope["forward"]})
    shell: nn.Module = nn.Module.__new__(shell_type)
    shell.__dict__.update(host.__dict__)  # the host's state, shared (read only): tracing changes nothing
    tracer = HostTracer()
    try:
        graph = tracer.trace(shell)
    except Exception as err:  # the host's own code is not traceable (data-dependent control flow)
        return f"its forward cannot be traced with torch.fx: {type(err).__name__}: {' '.join(str(err).split())[:200]}"
    return fx.GraphModule(host, graph), given


def _integer(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool


def _reads_parameters(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_module":
        return any(True for _ in gm.get_submodule(str(node.target)).parameters())
    return any(a.op == "get_attr" and isinstance(operator.attrgetter(str(a.target))(gm), nn.Parameter)
               for a in node.all_input_nodes)


def find_outline(host: nn.Module, host_path: str, call_args: tuple, call_kwargs: dict, num_experts: int,
                 calls: dict[str, list[Any]], selecting: frozenset[str]) -> tuple[Outline, Any] | str:
    """The outline of `host`'s MoE region (see the module doc) and the region input's value on the recorded call;
    or why there is none. `calls`: what its submodules returned on that call, by relative path, in order;
    `selecting`: the submodules whose recorded forward selected over E scores."""
    traced = _trace(host, call_args, call_kwargs)
    if isinstance(traced, str):
        return traced
    gm, given = traced
    run = _Run(gm, num_experts, calls)
    run.selecting_modules = selecting
    try:
        with torch.no_grad():
            run.run(*given.values())
    except Exception as err:
        return f"its traced forward fails on the recorded call: {type(err).__name__}: {err}"
    if not run.selecting:
        return f"no node of its own forward selects over E={num_experts} scores"
    selection = run.selecting[-1]
    after = downstream(selection)
    ids = {n for n in after if _integer(run.values.get(n))}
    experts = [n for n in gm.graph.nodes if n in after and n not in ids and n is not selection
               and any(a in ids for a in n.all_input_nodes) and _reads_parameters(n, gm)]
    if not experts:
        return "no node after its selection runs experts at its own level (a module or a parameter read by expert id)"
    shared = upstream(selection)
    for x in experts:  # what the experts read beside the selection (their tokens)
        for a in x.all_input_nodes:
            if a not in after:
                shared &= upstream(a)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    tokens = [n for n in shared if n.op != "get_attr" and n is not selection and isinstance(run.values.get(n),
                                                                                        torch.Tensor)]
    if not tokens:
        return "its selection and experts share no input"
    h = max(tokens, key=order.__getitem__)
    feeding: set[fx.Node] = set()
    for x in experts:
        feeding |= upstream(x)
    region = [n for n in gm.graph.nodes if n in feeding and n in downstream(h) and n is not h]
    inside = set(region)
    for n in region:
        other = [a for a in n.all_input_nodes if a not in inside and a is not h and a.op != "get_attr"]
        if other:
            return (f"its MoE region (from {h.name} to {', '.join(x.name for x in experts)}) also reads {other[0].name}, "
                    f"computed elsewhere in its forward: a block of one input cannot be outlined")
    for n in region:  # an item of a region value nobody reads (`_, w, i = router(x)`): gone with the region
        for u in [u for u in n.users if u not in inside and u.target is operator.getitem and not u.users]:
            gm.graph.erase_node(u)
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    name, i = BLOCK_NAME, 0
    while hasattr(host, name):
        i += 1
        name = f"{BLOCK_NAME}_{i}"
    return Outline(host_path, name, _block_graph(region, h, outputs), _host_graph(gm, region, h, outputs, name)), \
        run.values[h]


def _block_graph(region: list[fx.Node], h: fx.Node, outputs: list[fx.Node]) -> fx.Graph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {h: graph.placeholder("hidden_states")}

    def arg(a: fx.Node) -> fx.Node:
        if a not in env:  # a tensor of the host's, read inside the region
            env[a] = graph.get_attr(str(a.target))
        return env[a]

    for n in region:
        for a in n.all_input_nodes:
            arg(a)
        env[n] = graph.node_copy(n, arg)
    graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    graph.lint()
    return graph


def _host_graph(gm: fx.GraphModule, region: list[fx.Node], h: fx.Node, outputs: list[fx.Node], name: str
                ) -> fx.Graph:
    graph = gm.graph  # traced for this outline alone: edited in place
    gm.add_module(name, nn.Module())  # what the call names (the block, once outlined)
    inside = set(region)
    with graph.inserting_after(h):
        call = graph.call_module(name, (h,))
    results = [call] if len(outputs) == 1 else []
    for i in range(len(outputs) if len(outputs) > 1 else 0):
        with graph.inserting_after(results[-1] if results else call):
            results.append(graph.call_function(operator.getitem, (call, i)))
    for out, new in zip(outputs, results):
        out.replace_all_uses_with(new, delete_user_cb=lambda user: user not in inside)
    for n in reversed(region):
        graph.erase_node(n)
    graph.lint()
    return graph


def outline_candidate(c: Candidate) -> tuple[Candidate, Outline] | str:
    """A host candidate the model called (`Candidate.call`), outlined: the candidate of its MoE region's block
    (on the user's host, by reference; at the path `Outline.path`, probed on [T, D] tokens as the host feeds it)
    and the outline; or why it cannot be outlined."""
    if c.call is None:
        return "its call was not recorded (no model forward): nothing to trace its forward on"
    found_block = c.graph_block
    assert found_block is not None  # the caller's condition
    args, kwargs = tree_map(probe_value, (tuple(c.call.args), dict(c.call.kwargs)))
    cut = len(c.path) + 1 if c.path else 0
    calls: dict[str, list[Any]] = {}
    for call in found_block.calls:
        calls.setdefault(call.path[cut:], []).append(tree_map(probe_value, call.output))
    selecting = frozenset(p[cut:] for p in found_block.selected_in if p != c.path)
    with torch.random.fork_rng(devices=[]):
        found = find_outline(probe_copy(c.module), c.path, args, kwargs, c.num_experts, calls, selecting)
    if isinstance(found, str):
        return found
    outline, h = found
    block = outline.block_of(c.module)
    cap = record_model(block, (h,))
    if isinstance(cap, str):
        return f"its outlined region {cap.removeprefix('the model')}"
    candidates = [k for k in find_candidates(block, ModuleTree(block), graph_blocks(cap, block)) if k.path == ""]
    if not candidates:
        return "its outlined region shows no selection driving experts"
    inner = candidates[0]
    inner.path = outline.path
    if isinstance(h, torch.Tensor):
        inner.probe_shape = tuple(h.shape)
    if inner.call is None:
        inner.call = ModuleCall(outline.path, c.path, (h,), {})
    return inner, outline


def block_in(model: nn.Module, path: str, outlines: dict[str, Outline]) -> nn.Module:
    """The block at `path` of `model`: its submodule, or an outlined block not registered there (on its host in
    `model`, by reference: `Outline.block_of`)."""
    how = outlines.get(path)
    if how is not None and how.name not in (model.get_submodule(how.host) if how.host else model)._modules:
        return how.block_of(model.get_submodule(how.host) if how.host else model)
    return model.get_submodule(path) if path else model
