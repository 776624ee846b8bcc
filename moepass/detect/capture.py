"""Capture: one probe forward of a module, recorded as an FX graph of the torch calls it makes.

Detection reads what a block *computes* from this graph, not what its attributes are called: which
call selects experts (a top-k or argmax over E scores, a descending sort whose first k indices are
kept, or a lookup of an integer table by token ids: hash routing), which parameters feed the scores (the router
weight, its bias, a selection-only bias), which submodule the selection happens in (a router module
to keep calling), what the expert function is (linear, activation, product, linear).

Why a recording (a `TorchFunctionMode` plus module hooks) rather than symbolic_trace, torch.export
or make_fx: hand-written MoE blocks are full of data-dependent Python control flow (`if
idx.numel() == 0: continue`, `int(experts_TK[t, k])`), where symbolic_trace and torch.export stop.
make_fx runs through it on real tensors, but records aten ops: parameters become anonymous
constants and module boundaries disappear, while detection needs both (which parameter is the router
weight, which submodule's hooks must keep firing). A torch-function mode sees every torch function
and Tensor method at the level the user wrote it, with the real Parameter objects as arguments; the
module hooks give the call tree. The graph is specialised to the probe (loops unrolled): detection
reads structure from it and never runs it.

Graph: the module's input is a placeholder, each of its parameters and buffers a `get_attr` node
named by its path, each recorded call a `call_function` node whose target is the torch function and
whose tensor arguments are the nodes that produced them (tuple results get `operator.getitem`
nodes). `node.meta["val"]` holds the value, `node.meta["stack"]` the module paths being run (outermost
first, "" the traced module itself).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

# The expert-selection calls: (functions, what their integer result is)
TOPK = (torch.topk, torch.Tensor.topk)
ARGMAX = (torch.argmax, torch.Tensor.argmax)
SORT = (torch.sort, torch.Tensor.sort, torch.argsort, torch.Tensor.argsort)  # descending, then the first k
MAX = (torch.max, torch.Tensor.max)  # over a dim: (values, indices), a top-1 selection (sparsemixer's rounds)
LINEAR = (torch.nn.functional.linear,)


@dataclass
class ModuleCall:
    """One call of a submodule during the capture (its inputs and outputs as recorded values)."""

    path: str
    parent: str  # the module that made the call ("" the traced module, and for the traced module itself)
    args: tuple
    kwargs: dict
    output: Any = None
    # with keyword arguments: every argument by position (the keywords folded in, in the forward's order), when
    # they are its positional parameters right after the ones given by position; else None
    positional: tuple | None = None


@dataclass
class Capture:
    """The graph of one recorded forward and the module calls made during it."""

    graph: fx.Graph
    output: Any
    calls: list[ModuleCall] = field(default_factory=list)
    input_node: fx.Node | None = None
    # module path -> the path of an earlier module of the same structure whose calls stand for its own: the
    # calls inside it ran but were not recorded (`capture(skip=)`); only its module calls were
    repeats: dict[str, str] = field(default_factory=dict)
    # names of the positional inputs passed as None (no placeholder: an optional mask the caller left out)
    absent: tuple[str, ...] = ()

    def nodes(self, targets: Iterable[Any]) -> list[fx.Node]:
        wanted = tuple(targets)
        return [n for n in self.graph.nodes if n.op == "call_function" and n.target in wanted]

    def calls_of(self, path: str) -> list[ModuleCall]:
        return [c for c in self.calls if c.path == path]


def _reachable(node: fx.Node, step) -> set[fx.Node]:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(step(n))
    return seen


def upstream(node: fx.Node) -> set[fx.Node]:
    """Every node `node` depends on (itself included)."""
    return _reachable(node, lambda n: n.all_input_nodes)


def downstream(node: fx.Node) -> set[fx.Node]:
    """Every node that depends on `node` (itself included)."""
    return _reachable(node, lambda n: n.users)


def attrs(nodes: Iterable[fx.Node]) -> list[fx.Node]:
    """The `get_attr` nodes (parameters and buffers) among `nodes`, in graph order."""
    return sorted((n for n in nodes if n.op == "get_attr"), key=lambda n: n.meta["order"])


def as_positional(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """`module(*args, **kwargs)` as one call by position, when each keyword names a positional parameter of its
    forward and together they fill the parameters right after `args` (defaults in between); else None."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(k not in {p.name for p in positional[len(args):]} for k in kwargs):
        return None
    last = max(i for i, p in enumerate(positional) if p.name in kwargs)
    filled = list(args)
    for p in positional[len(args):last + 1]:
        if p.name not in kwargs and p.default is p.empty:
            return None
        filled.append(kwargs.get(p.name, p.default))
    return tuple(filled)


def value(node: object) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


SKIP_DEPTH = 2  # module levels watched below a skipped module: its calls there are recorded (not its torch calls)


class _Recorder(TorchFunctionMode):
    """Builds the graph call by call (see the module doc)."""

    def __init__(self, module: nn.Module, skip: frozenset[str] = frozenset(), lazy: bool = False):
        super().__init__()
        self.skip = skip  # module paths whose inner calls run unrecorded
        self.paused = 0  # > 0 while one of them runs
        self.graph = fx.Graph()
        self.producer: dict[int, fx.Node] = {}
        self.keep: list[Any] = []  # values stay alive: ids are never reused during the capture
        self.stack: list[str] = []
        self.calls: list[ModuleCall] = []
        self.order = 0
        self.unread: dict[int, tuple[str, torch.Tensor]] = {}  # lazy: tensors whose get_attr node waits for a use
        for name, tensor in [*module.named_parameters(remove_duplicate=False),
                             *module.named_buffers(remove_duplicate=False)]:
            if id(tensor) in self.producer or id(tensor) in self.unread:
                continue
            if lazy:
                self.unread[id(tensor)] = (name, tensor)
            else:
                self._register(tensor, self._node("get_attr", name, (), {}, tensor))

    def _node(self, op: str, target: Any, args: tuple, kwargs: dict, val: Any) -> fx.Node:
        node = self.graph.create_node(op, target, args, kwargs)
        node.meta.update(val=val, stack=tuple(self.stack), order=self.order)
        self.order += 1
        return node

    def _register(self, tensor: torch.Tensor, node: fx.Node) -> None:
        self.producer[id(tensor)] = node
        self.keep.append(tensor)

    def placeholder(self, name: str, tensor: torch.Tensor) -> fx.Node:
        node = self._node("placeholder", name, (), {}, tensor)
        self._register(tensor, node)
        return node

    def _arg(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            if id(a) in self.unread:  # a parameter or buffer read for the first time
                name, tensor = self.unread.pop(id(a))
                self._register(tensor, self._node("get_attr", name, (), {}, tensor))
            return self.producer.get(id(a), a)  # a tensor made outside the recording: a constant
        return a

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        if not any(isinstance(v, torch.Tensor) for v in tree_flatten(out)[0]):
            return out  # sizes, dtypes, Python numbers: constants of the graph
        node = self._node("call_function", func, tree_map(self._arg, tuple(args)), tree_map(self._arg, kwargs), out)
        if isinstance(out, torch.Tensor):
            self._register(out, node)
        elif isinstance(out, (tuple, list)):
            self.keep.append(out)
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    self._register(item, self._node("call_function", operator.getitem, (node, i), {}, item))
        return out

    def hooks(self, module: nn.Module) -> list[Any]:
        """Call-recording hooks on every module, except deep inside a skipped one (`skip`): there only its
        first SKIP_DEPTH levels are watched (a layer's MoE block, its router and experts), since a hook costs
        its registration on each of a large model's many modules."""
        handles = []
        for path, sub in module.named_modules():
            if self.skip and any(path.startswith(r + ".") and path[len(r) + 1:].count(".") >= SKIP_DEPTH
                                 for r in self.skip):
                continue

            def pre(_m, args, kwargs, path=path):
                self.calls.append(ModuleCall(path, self.stack[-1] if self.stack else "", args, kwargs,
                                             positional=as_positional(_m, args, kwargs) if kwargs else None))
                self.stack.append(path)
                self.paused += path in self.skip
                return None

            def post(_m, args, kwargs, output, path=path):
                self.paused -= path in self.skip
                self.stack.pop()
                call = next(c for c in reversed(self.calls) if c.path == path and c.output is None)
                call.output = output
                self.keep.append(output)
                return None

            handles.append(sub.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(sub.register_forward_hook(post, with_kwargs=True))
        return handles


def capture(module: nn.Module, *inputs: Any, names: tuple[str, ...] = (), kwargs: dict[str, Any] | None = None,
            skip: frozenset[str] = frozenset(), lazy: bool = False) -> Capture:
    """Run `module(*inputs, **kwargs)` under no_grad, recording its graph. `module` should be a probe copy (or
    a model in eval mode whose state the caller restores): hooks are added for the call and removed after it,
    nothing else is changed. `names`: the positional inputs' placeholder names (default `input_<i>`); a
    tensor keyword argument's placeholder is its name; other arguments are constants of the graph. `skip`:
    module paths whose inner calls run without being recorded (their module calls still are); `lazy`: a
    parameter's or buffer's `get_attr` node is made at its first use (a whole model holds many more tensors
    than one forward of its first layers reads), else all of them first, in the module's order."""
    kwargs = kwargs or {}
    recorder = _Recorder(module, skip, lazy)
    placeholders = [recorder.placeholder(names[i] if i < len(names) else f"input_{i}", x)
                    for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
    placeholders += [recorder.placeholder(name, x) for name, x in kwargs.items() if isinstance(x, torch.Tensor)]
    handles = recorder.hooks(module)
    try:
        with torch.no_grad(), recorder:
            out = module(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    outs = tree_map(recorder._arg, out if isinstance(out, tuple) else (out,))
    recorder.graph.output(outs)
    absent = tuple(names[i] for i, x in enumerate(inputs) if x is None and i < len(names))
    return Capture(recorder.graph, out, recorder.calls, placeholders[0] if placeholders else None, absent=absent)


@dataclass
class Selection:
    """The expert-selection call of a captured block: a top-k (or argmax, k = 1, or a descending sort
    whose first k indices are kept) over E scores."""

    node: fx.Node  # the topk / argmax / sort call, or the lookup
    scores: fx.Node | None  # its input: [..., E] scores (None for a lookup by token ids)
    k: int
    indices: torch.Tensor  # [T, k] selected experts (as recorded)
    values: fx.Node | None  # topk's values node (None for argmax)


def _leading(node: fx.Node, full: torch.Tensor) -> fx.Node | None:
    """The user of `node` (whose value is `full`, [..., E]) that keeps its first k < E entries on the last dim."""
    for user in node.users:
        val = value(user)
        if user.target is torch.Tensor.__getitem__ and isinstance(val, torch.Tensor) and val.dim() == full.dim() \
                and val.shape[:-1] == full.shape[:-1] and 0 < val.shape[-1] < full.shape[-1] \
                and torch.equal(val, full[..., :val.shape[-1]]):
            return user
    return None


def _sort_selection(node: fx.Node, scores: fx.Node, val: torch.Tensor) -> Selection | None:
    """A descending sort / argsort over the last dim whose first k indices are kept (`sorted[..., :k]`)."""
    args = list(node.args) + [None] * 3
    dim = node.kwargs.get("dim", args[1] if args[1] is not None else -1)
    if not node.kwargs.get("descending", args[2] or False) or dim not in (-1, val.dim() - 1):
        return None
    items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    indices, values = (items.get(1), items.get(0)) if node.target in SORT[:2] else (node, None)
    kept = None if indices is None else _leading(indices, value(indices))
    if kept is None:
        return None
    k = value(kept).shape[-1]
    kept_values = None if values is None else _leading(values, value(values))
    return Selection(node, scores, k, value(kept).reshape(-1, k), kept_values)


def lookup_selection(cap: Capture, num_experts: int) -> Selection | None:
    """The last lookup of experts by token ids (hash routing): a call reading an integer table of the block
    with indices computed from a block input other than the hidden states, whose result ([T, k] or [T])
    holds expert ids in [0, E)."""
    found = None
    ids = [n for n in cap.graph.nodes if n.op == "placeholder" and n is not cap.input_node]
    for node in cap.graph.nodes:
        val = value(node)
        if node.op != "call_function" or not isinstance(val, torch.Tensor) or val.is_floating_point() \
                or val.dtype == torch.bool or val.dim() not in (1, 2) or not val.numel():
            continue
        table = node.args[0] if node.args else None
        tval = value(table)
        if not isinstance(table, fx.Node) or table.op != "get_attr" or not isinstance(tval, torch.Tensor) \
                or tval.is_floating_point() or not any(i in upstream(node) for i in ids):
            continue
        if int(val.min()) >= 0 and int(val.max()) < num_experts:
            k = val.shape[-1] if val.dim() == 2 else 1
            found = Selection(node, None, k, val.reshape(-1, k), None)
    return found


def selection(cap: Capture, num_experts: int) -> Selection | None:
    """The last top-k / argmax / max / sort-then-slice over the last dim of E scores (the block's final selection),
    or else a lookup by token ids (`lookup_selection`), or None."""
    found = None
    for node in cap.nodes(TOPK + ARGMAX + SORT + MAX):
        scores = node.args[0] if node.args else None
        val = value(scores)
        if not isinstance(scores, fx.Node) or not isinstance(val, torch.Tensor) or val.dim() < 1 \
                or val.shape[-1] != num_experts or not val.is_floating_point():
            continue
        if node.target in MAX:
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
            if isinstance(dim, int) and dim in (-1, val.dim() - 1) and 1 in items:
                found = Selection(node, scores, 1, value(node)[1].reshape(-1, 1), items.get(0))
        elif node.target in SORT:
            found = _sort_selection(node, scores, val) or found
        elif node.target in TOPK:
            k = node.args[1] if len(node.args) > 1 else node.kwargs.get("k")
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
            largest = node.args[3] if len(node.args) > 3 else node.kwargs.get("largest", True)
            if not isinstance(k, int) or dim not in (-1, val.dim() - 1) or not largest:
                continue
            items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
            found = Selection(node, scores, k, value(node)[1].reshape(-1, k), items.get(0))
        else:
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            if dim not in (-1, val.dim() - 1):
                continue
            found = Selection(node, scores, 1, value(node).reshape(-1, 1), None)
    return found or lookup_selection(cap, num_experts)


def expert_choice(cap: Capture, num_experts: int) -> int | None:
    """C of a top-k over tokens in [E, T] scores (each of the E experts picking its C tokens: expert-choice
    routing), or None."""
    for node in cap.nodes(TOPK):
        val = value(node.args[0] if node.args else None)
        k = node.args[1] if len(node.args) > 1 else node.kwargs.get("k")
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
        if isinstance(val, torch.Tensor) and val.dim() >= 2 and isinstance(k, int) and dim in (-1, val.dim() - 1) \
                and val.shape[-2] == num_experts and val.shape[-1] != num_experts:
            return k
    return None


def slice_attrs(node: fx.Node) -> list[fx.Node]:
    """The parameters and buffers `node` depends on."""
    return attrs(upstream(node))
