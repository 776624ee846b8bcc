"""Candidates from the model's recorded forward: where a selection over expert scores drives per-expert work.

The module tree alone misses MoE blocks written other ways (expert weights stored flattened as [E·F, D],
experts spread over sibling modules, routers of any layout) and can anchor a block at the wrong module (a
fused-experts module holding an [E, F] bias looks like it holds its own router). The forward says what is
what: one recording of the model (`capture.capture`, a torch-function mode with module hooks, on the
user's example input or a synthesized one) gives every call with the module stack it ran in. Then:

    selection   a top-k / argmax / descending sort over the last dim of E >= 2 floating scores that read a
                parameter (the router's): `capture.TOPK + ARGMAX + SORT`
    expert work a call downstream of the selected indices that reads a parameter the scores do not read
                (an expert weight indexed by expert id, a grouped GEMM with offsets from the counts, a loop
                over expert modules, a view of a parameter as [E, ...])
    block       the smallest module, from the one the selection ran in outwards, whose calls include
                expert work: routing and experts meet there

Roles come from the data flow (which parameters feed the scores, which are read per expert), never from
names or classes. Each found block records the call the model made to it (`GraphBlock.call`): the probe
then calls it with the same arguments. A block that no recogniser describes is still reported, with the
expert tensors it reads: nothing that selects over E >= 2 scores and drives experts is left unsaid.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from moepass.detect.capture import ARGMAX, SORT, TOPK, Capture, ModuleCall, capture, downstream, upstream, value
from moepass.detect.structure import structural_key

INPUT_TOKENS = (2, 8)  # [B, S] of a synthesized example input


@dataclass
class GraphBlock:
    """A module the recorded forward shows selecting experts and computing them (see the module doc)."""

    path: str  # model path ("" the model itself)
    num_experts: int  # E: the last dim of its final selection's scores
    router_params: tuple[str, ...]  # model paths of the parameters its selection scores read
    expert_params: tuple[str, ...]  # model paths of the parameters read downstream of the selection, per expert
    call: ModuleCall | None = None  # the first call the model made to it (args, kwargs, output)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # the router and expert parameters' shapes
    calls: list[ModuleCall] = field(default_factory=list)  # the recorded calls of the modules below it, in order
    selected_in: tuple[str, ...] = ()  # the modules its selections ran in (each selection's innermost module)

    def describe_experts(self) -> str:
        """The expert tensors it reads (paths relative to the block), with how their shapes hold E (for a
        rejection's reason)."""
        E = self.num_experts
        cut = len(self.path) + 1 if self.path else 0
        if len(self.expert_params) >= E:  # e.g. a list of expert modules, a few tensors each
            return f"{len(self.expert_params)} tensors such as {', '.join(p[cut:] for p in self.expert_params[:3])} " \
                "(modules per expert)"
        parts = []
        for path in self.expert_params:
            shape = self.shapes.get(path, ())
            if shape and shape[0] == E:
                how = "[E, ...]"
            elif shape and shape[0] % E == 0 and shape[0] > E:
                how = f"flattened: [E·{shape[0] // E}, ...]"
            elif any(d == E for d in shape):
                how = "E on another dim"
            else:
                how = "one module per expert"
            parts.append(f"{path[cut:]} {list(shape)} ({how})")
        return ", ".join(parts[:6]) + (f" and {len(parts) - 6} more" if len(parts) > 6 else "")


def synthesize_inputs(model: nn.Module) -> tuple[tuple[Any, ...], str] | str:
    """An example input for `model` when the user gives none: token ids [2, 8] in [0, V) when its first
    module with parameters is an embedding of V rows, else hidden states [2, 8, D] with D the input width of
    its first linear layer. Returns (args, how it was made) or why none could be made."""
    gen = torch.Generator().manual_seed(0)  # the user's RNG streams are left alone
    for module in model.modules():
        weight = getattr(module, "weight", None)
        device = weight.device if isinstance(weight, torch.Tensor) and weight.device.type != "meta" else None
        if isinstance(module, nn.Embedding):
            ids = torch.randint(0, module.num_embeddings, INPUT_TOKENS, generator=gen)
            return (ids.to(device),), f"token ids {list(INPUT_TOKENS)} in [0, {module.num_embeddings})"
        if isinstance(module, nn.Linear):
            x = torch.randn(*INPUT_TOKENS, module.in_features, generator=gen)
            dtype = weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else None
            return (x.to(device=device, dtype=dtype),), f"hidden states {[*INPUT_TOKENS, module.in_features]}"
        if any(True for _ in module.parameters(recurse=False)):
            break
    return "no example input given and none could be synthesized (the model starts with neither an embedding " \
           "nor a linear layer): pass example_inputs"


@contextmanager
def _read_only(model: nn.Module) -> Iterator[None]:
    """Eval mode for the recording; afterwards the training flags as they were and every buffer's values
    restored (a forward may update a buffer even in eval mode)."""
    flags = {m: m.training for m in model.modules()}
    buffers = [(b, b.clone()) for b in model.buffers() if b.device.type != "meta"]
    model.eval()
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                if not torch.equal(b, saved):
                    b.copy_(saved)
        for m, flag in flags.items():
            m.training = flag


def record_model(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Capture | str:
    """The model's forward on (`args`, `kwargs`), recorded (`capture.capture`); or why it could not be: a
    model on the meta device, or a forward that fails (its exception named)."""
    if any(p.device.type == "meta" for p in model.parameters()):
        return "the model is on the meta device (no values to run a forward on)"
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    repeats = repeated_layers(model)
    try:  # the user's RNG streams are left as they were (a forward may draw: jitter, dropout)
        with _read_only(model), torch.random.fork_rng(devices=devices):
            cap = capture(model, *args, kwargs=kwargs or {}, skip=frozenset(repeats), lazy=True)
    except Exception as err:  # the user's forward: reported, never raised
        return f"the model's forward failed on the example input: {type(err).__name__}: {err}"
    cap.repeats = repeats
    return cap


def repeated_layers(model: nn.Module) -> dict[str, str]:
    """{path: the earlier sibling it repeats} for the entries of every ModuleList / ModuleDict whose structure
    (`structure.structural_key`) equals an earlier entry's: a deep model's layers, recorded once (their
    calls inside run unrecorded; `graph_blocks` re-roots what the first one shows)."""
    repeats: dict[str, str] = {}
    grouped: list[str] = []  # entries of a container already looked at: containers inside them are not
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict)) or len(container) < 2 \
                or any(path == g or path.startswith(g + ".") for g in grouped):
            continue
        # layers holding containers of their own (a list of experts): an expert list itself is recorded whole,
        # since an expert the synthesized tokens miss runs no call at all
        entries = [(f"{path}.{key}" if path else key, child) for key, child in container._modules.items()
                   if child is not None and any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) for m in child.modules())]
        grouped += [p for p, _ in entries]
        first: dict[object, str] = {}
        for child_path, child in entries:
            try:
                shape = structural_key(child)
            except Exception:  # no key: recorded on its own
                shape = None
            if shape is not None and shape in first:
                repeats[child_path] = first[shape]
            elif shape is not None:
                first[shape] = child_path
    return repeats


def _reroot(path: str, old: str, new: str) -> str | None:
    """`path` below `old` moved below `new`, or None when it is not below `old`."""
    if path == old:
        return new
    return new + path[len(old):] if path.startswith(old + ".") else None


def selections(cap: Capture) -> Iterator[tuple[fx.Node, fx.Node, int]]:
    """(selection call, its indices node, E) for every top-k / argmax / descending sort over the last dim of
    E >= 2 floating scores."""
    for node in cap.nodes(TOPK + ARGMAX + SORT):
        scores = node.args[0] if node.args else None
        val = value(scores)
        if not isinstance(scores, fx.Node) or not isinstance(val, torch.Tensor) or not val.is_floating_point() \
                or val.dim() < 1 or val.shape[-1] < 2:
            continue
        args = list(node.args) + [None] * 4
        if node.target in TOPK:
            dim, largest = node.kwargs.get("dim", args[2] if args[2] is not None else -1), \
                node.kwargs.get("largest", True if args[3] is None else args[3])
            ok = largest and dim in (-1, val.dim() - 1)
        elif node.target in ARGMAX:
            ok = node.kwargs.get("dim", args[1]) in (-1, val.dim() - 1)
        else:
            dim = node.kwargs.get("dim", args[1] if args[1] is not None else -1)
            ok = bool(node.kwargs.get("descending", args[2] or False)) and dim in (-1, val.dim() - 1)
        if not ok:
            continue
        tuple_out = node.target in TOPK or node.target in SORT[:2]
        indices = next((u for u in node.users if u.target is operator.getitem and u.args[1] == 1), None) \
            if tuple_out else node
        if indices is not None:
            yield node, indices, int(val.shape[-1])


def _is_param(node: fx.Node, params: set[str]) -> bool:
    return node.op == "get_attr" and str(node.target) in params


def _is_weight(node: fx.Node, params: set[str]) -> bool:
    """A parameter of >= 2 dims: an expert's weight (a 1-D [E] one read by expert id scales the routing weights,
    `ExpertsSpec.output_scale`, and is no expert work by itself)."""
    val = value(node)
    return _is_param(node, params) and isinstance(val, torch.Tensor) and val.dim() >= 2


def _params_in(node: fx.Node, after: set[fx.Node], path: str, params: set[str]) -> list[fx.Node]:
    """The parameters `node` reads through inputs that do not depend on the selection: directly, or through
    calls inside the module at `path` (a weight transposed, viewed as [E, F, D], indexed, cast)."""
    found, seen, todo = [], set(), [a for a in node.all_input_nodes if a not in after]
    while todo:
        a = todo.pop()
        if a in seen:
            continue
        seen.add(a)
        if _is_weight(a, params):
            found.append(a)
        elif a.op == "call_function" and path in a.meta["stack"]:
            todo.extend(a.all_input_nodes)
    return found


def graph_blocks(cap: Capture, model: nn.Module) -> list[GraphBlock]:
    """The MoE blocks the recorded forward shows (see the module doc), in the order they ran; a block whose
    selection ran several times (a module reused) is reported once, with its first call."""
    named = list(model.named_parameters(remove_duplicate=False))
    params = {name for name, p in named if p.is_floating_point()}
    shapes = {name: tuple(p.shape) for name, p in named}
    first_call: dict[str, ModuleCall] = {}  # each module's first call, in the order the modules ran
    for call in cap.calls:
        first_call.setdefault(call.path, call)
    found: dict[str, GraphBlock] = {}
    scored_from: dict[str, set[fx.Node]] = {}  # a block's path -> what its selections' scores are computed from
    for node, indices, E in selections(cap):
        scores = node.args[0]
        assert isinstance(scores, fx.Node)
        before = upstream(scores)
        read_by_router = {str(n.target) for n in before if _is_param(n, params)}
        if not read_by_router:  # scores that read no parameter (e.g. a sampling step over given logits)
            continue
        after = downstream(indices)
        for path in reversed(node.meta["stack"]):  # the module the selection ran in, then outwards
            work = [a for n in after if n.op == "call_function" and path in n.meta["stack"]
                    for a in _params_in(n, after, path, params) if str(a.target) not in read_by_router]
            if not work:
                continue
            experts = tuple(dict.fromkeys(str(a.target) for a in sorted(work, key=lambda a: a.meta["order"])))
            router = {str(a.target) for n in before if n.op == "call_function" and path in n.meta["stack"]
                      for a in n.all_input_nodes if _is_param(a, params)}  # read inside the block
            scored_from.setdefault(path, set()).update(before)
            block = found.get(path)
            if block is None:
                found[path] = GraphBlock(path, E, tuple(sorted(router)), experts, first_call.get(path),
                                         {p: shapes[p] for p in (*experts, *router) if p in shapes},
                                         selected_in=node.meta["stack"][-1:])
            else:  # a later selection of the same block (group-limited: groups first, then experts)
                block.num_experts = E
                block.router_params = tuple(sorted(set(block.router_params) | router))
                block.expert_params = tuple(dict.fromkeys(block.expert_params + experts))
                block.shapes.update({p: shapes[p] for p in (*experts, *router) if p in shapes})
                block.selected_in = tuple(dict.fromkeys(block.selected_in + node.meta["stack"][-1:]))
            break
    for repeat, first in cap.repeats.items():  # a repeated layer: what its first shows, at its own paths
        for block in list(found.values()):
            path = _reroot(block.path, first, repeat)
            if path is None or path in found:
                continue
            moved = {p: _reroot(p, first, repeat) or p for p in (*block.router_params, *block.expert_params)}
            found[path] = GraphBlock(path, block.num_experts, tuple(moved[p] for p in block.router_params),
                                     tuple(moved[p] for p in block.expert_params),
                                     first_call.get(path),
                                     {moved.get(p, p): s for p, s in block.shapes.items()},
                                     selected_in=tuple(_reroot(p, first, repeat) or p for p in block.selected_in))
    for block in found.values():  # what its submodules were called with and returned (`detect.outline` reads them)
        block.calls = [call for call in cap.calls if call.path != block.path
                       and (block.path == "" or call.path.startswith(block.path + "."))]
    order = {path: i for i, path in enumerate(first_call)}  # the order the blocks ran in
    blocks = sorted(found.values(), key=lambda b: order.get(b.path, len(order)))

    def inside(b: GraphBlock, o: GraphBlock) -> bool:
        return o.path != b.path and (o.path == "" or b.path.startswith(o.path + "."))

    # a selection over scores that blocks inside it computed (an auxiliary load-balancing loss over their router
    # logits, as a Hugging Face model's forward computes with output_router_logits) is no block: those are
    blocks = [o for o in blocks if not any(inside(b, o) and any(b.path in n.meta["stack"] for n in
                                                                 scored_from.get(o.path, ())) for b in blocks)]
    # a block inside another found block is the same MoE seen from a submodule that also selects (nested
    # routing): keep the outermost
    return [b for b in blocks if not any(inside(b, o) for o in blocks)]


def router_weight(block: GraphBlock) -> str | None:
    """The router's weight among the parameters the selection scores read: a 2-D one with E rows (or columns:
    a transposed layout) when there is one, else the largest."""
    E, shape = block.num_experts, lambda p: block.shapes.get(p, ())
    shaped = [p for p in block.router_params if len(shape(p)) == 2 and E in shape(p)]
    if shaped:
        return min(shaped, key=lambda p: shape(p)[0] != E)
    return max(block.router_params, key=lambda p: math.prod(shape(p)), default=None)
