"""The router, read from the captured graph of a block (`moepass.detect.capture`).

The selection call (the block's last top-k / argmax over E scores) is found in the graph; what feeds
it says the rest, whatever the attributes are called:

    weight          the [E, D] parameter its scores depend on (at any depth in the block)
    bias            a [E] tensor the same linear / matmul adds (part of the logits)
    selection_bias  a [E] tensor added to the scores before the selection only (through a dtype cast too)
    groups          a top-k over G < E group scores before it (group-limited selection)
    module          the submodule the selection ran in (below the block), if any; when that module
                    returns the selected experts itself, the router region calls it as it is
                    (`RouterSpec.logits_from="selection"`): an unknown router rule is legal

Which known rule the scores follow (softmax before / after the top-k, sigmoid, renormalised or not,
a constant scale) is a set of hypotheses, ordered by the calls seen between the logits and the
combination; the semantic check keeps the first that reproduces the block.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from moepass.detect.capture import Capture, Selection, attrs, downstream, upstream, value
from moepass.dialect import route_ref
from moepass.spec import GROUP_SCORES, Constant, RouterSpec, TensorSource

SOFTMAX = (torch.softmax, torch.Tensor.softmax, F.softmax)
SIGMOID = (torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid)
SUM = (torch.sum, torch.Tensor.sum)
MUL = (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, operator.mul)
ADD = (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, operator.add)

# (label, RouterSpec fields), in default prior order
RULES: list[tuple[str, dict[str, Any]]] = [
    ("softmax, top-k, renormalise", dict(score_func="softmax", softmax_before_topk=True, renormalize=True)),
    ("softmax, top-k", dict(score_func="softmax", softmax_before_topk=True, renormalize=False)),
    ("top-k logits, softmax", dict(score_func="softmax", softmax_before_topk=False, renormalize=False)),
    ("sigmoid, top-k, renormalise", dict(score_func="sigmoid", renormalize=True)),
    ("sigmoid, top-k", dict(score_func="sigmoid", renormalize=False)),
]


@dataclass
class RouterFacts:
    """What the captured graph says about a block's router (see the module doc)."""

    num_experts: int
    top_k: int
    weight: str | None = None
    weight_transposed: bool = False  # the weight is stored [D, E] (scores = x @ weight): read as its transpose
    bias: str | None = None
    selection_bias: str | None = None
    groups: tuple[int, int] | None = None  # (n_group, topk_group)
    module: str | None = None  # the block's submodule the selection ran in
    selection_outputs: tuple[int, int] | None = None  # the module returns (weights, experts) at these indices
    module_input: str = "hidden"
    module_args: tuple[str | Constant, ...] = ()
    why_not_module: str = ""  # why the router module cannot be called as the block calls it
    # constants the weights are multiplied by; then those multiplying the combined output (the same, by linearity)
    scales: list[float] = field(default_factory=list)
    sigmoid: bool = False
    softmax_after: bool = False  # a softmax over the top-k values
    renormalized: bool = False  # a sum over the K weights
    logits_fp32: bool = False  # the router linear's input is cast to fp32 first (`RouterSpec.dtype`)
    # tensors of the block the selection scores also read, beyond the weight, bias and selection bias (e.g. a
    # learnable temperature): no known rule reads them, so an inline router using them is not reproduced
    unknown_tensors: tuple[str, ...] = ()
    selection: Selection | None = field(default=None, repr=False)  # the selection call these facts are of
    why_not_traced: str = ""  # why the block's router code up to the logits cannot run as traced (`traced_logits`)
    # the module's returned ids hold no selection of the block's: they are the ids the block dispatches by
    # (`_dispatch_ids`); its module router is then tried after the known rules, not instead of them
    dispatch_ids: bool = False
    module_k: int = 0  # with `dispatch_ids`: how many ids per token the module returns (its router's top_k)


def _is_vector(node: fx.Node, E: int) -> bool:
    val = value(node)
    return isinstance(val, torch.Tensor) and val.dim() == 1 and val.shape[0] == E and val.is_floating_point()


def _casts_to_fp32(node: fx.Node) -> bool:
    """`x.float()`, `x.to(torch.float32)`, `x.type(torch.float32)` (no-ops on fp32 probes, yet in the graph)."""
    if node.op != "call_function":
        return False
    if node.target is torch.Tensor.float:
        return True
    return node.target in (torch.Tensor.to, torch.Tensor.type) and torch.float32 in (*node.args[1:],
                                                                                    *node.kwargs.values())


def _uncast(node: fx.Node) -> fx.Node:
    """The tensor a dtype cast reads (`b.to(scores.dtype)`, `b.float()`), else the node itself."""
    while node.op == "call_function" and (node.target is torch.Tensor.float or node.target in (
            torch.Tensor.to, torch.Tensor.type)) and node.args and isinstance(node.args[0], fx.Node):
        val, src = value(node), value(node.args[0])
        if not isinstance(val, torch.Tensor) or not isinstance(src, torch.Tensor) or val.shape != src.shape:
            break
        node = node.args[0]
    return node


def _linear_of(weight: fx.Node, scores_slice: set[fx.Node]) -> fx.Node | None:
    return next((u for u in weight.users if u in scores_slice), None)


def _tensor_arg(cap: Capture, arg: Any, block_input: torch.Tensor) -> str | None:
    """How the block passes `arg` to a submodule: "hidden" (its input), "tokens" (its input as [T, D]),
    a parameter / buffer path, a further block input as given (its name: token ids), or None (something
    else)."""
    if not isinstance(arg, torch.Tensor):
        return None
    if arg is block_input:
        return "hidden"
    for node in cap.graph.nodes:
        if value(node) is arg:
            if node.op in ("get_attr", "placeholder"):
                return str(node.target)
            if arg.dim() == 2 and arg.shape == (block_input.numel() // block_input.shape[-1], block_input.shape[-1]) \
                    and torch.equal(arg, block_input.reshape(arg.shape)):
                return "tokens"
    return None


def _module_selection(cap: Capture, facts: RouterFacts, sel: Selection) -> None:
    """Fill the router module facts: the outermost submodule the selection ran in, and whether it returns
    the selection itself (and how the block calls it)."""
    stack = [p for p in sel.node.meta["stack"] if p]
    if not stack:
        return
    facts.module = stack[0]
    call = next((c for c in reversed(cap.calls) if c.path == facts.module), None)
    out = call.output if call is not None else None
    if call is None or not isinstance(out, (tuple, list)):
        return
    T = sel.indices.shape[0]

    def holds_selection(v: Any) -> bool:
        """[T, k >= K] expert ids holding every token's selected experts: the selection itself, or the union of
        several rounds (a router that selects one expert per round, e.g. sparsemixer's)."""
        if not isinstance(v, torch.Tensor) or v.is_floating_point() or v.dtype == torch.bool or not v.numel() \
                or v.numel() % T or v.numel() // T < sel.k:
            return False
        rows = v.reshape(T, -1)
        return bool((rows.unsqueeze(-1) == sel.indices.unsqueeze(1)).any(1).all())

    experts = next((i for i, v in enumerate(out) if holds_selection(v)), None)
    if experts is None:  # no output holds the selection: the ids the block dispatches by, read as they are
        experts = _dispatch_ids(cap, facts, out, T)
        facts.dispatch_ids = experts is not None
    K = out[experts].numel() // T if experts is not None else facts.top_k
    weights = next((i for i, v in enumerate(out) if isinstance(v, torch.Tensor) and v.is_floating_point()
                    and v.numel() == T * K), None)
    if experts is None or weights is None:
        return
    if facts.dispatch_ids:  # the module's k ids per token; the block's own top-k stays what the rules read
        facts.module_k = K
    else:
        facts.top_k = K
    found = module_call(cap, facts.module)
    if isinstance(found, str):
        facts.why_not_module = found
        return
    facts.selection_outputs = (weights, experts)
    facts.module_input, facts.module_args = found


def _dispatch_ids(cap: Capture, facts: RouterFacts, out: tuple | list, T: int) -> int | None:
    """The router module's output the block dispatches tokens by, when none holds the selection itself (a
    router whose rule moepass does not know, e.g. one returning a mask whose values pick the experts): an
    integer [T, k] tensor of expert ids in [0, E) that the block reads after the call, with a floating output
    of the same size beside it (the weights). Read as the selection as it is: k choices per token, whatever
    the rule (`RouterSpec.logits_from="selection"`); the semantic check decides."""
    read_after = {id(value(n)) for n in cap.graph.nodes for u in n.users
                  if facts.module not in u.meta.get("stack", ()) and value(n) is not None}
    for i, v in enumerate(out):
        if not isinstance(v, torch.Tensor) or v.is_floating_point() or v.dtype == torch.bool or not v.numel() \
                or v.numel() % T or id(v) not in read_after:
            continue
        if int(v.min()) < 0 or int(v.max()) >= facts.num_experts:
            continue
        if any(isinstance(w, torch.Tensor) and w.is_floating_point() and w.numel() == v.numel() for w in out):
            return i
    return None


CONSTANTS = (type(None), bool, int, float, str)  # passed to a router module as they are (`spec.Constant`)


def module_call(cap: Capture, path: str) -> tuple[str, tuple[str | Constant, ...]] | str:
    """How the block calls its submodule `path` (its last call): ("hidden" | "tokens", what it passes after
    that: the block's tensors by path, its further inputs by name, constants such as an absent expert bias),
    or why the router region cannot call it the same way."""
    call = next((c for c in reversed(cap.calls) if c.path == path), None)
    if call is None:
        return f"the block does not call {path}"
    block_input = value(cap.input_node)
    args = call.positional if call.kwargs and call.positional is not None else call.args
    kwargs = {} if args is not call.args else call.kwargs
    first = _tensor_arg(cap, args[0], block_input) if args else None
    if first not in ("hidden", "tokens"):
        return f"router module {path} is not called on the block's input (as given, or as [T, D] tokens)"
    rest: list[str | Constant] = []
    # the block's further inputs the model passed as None (an optional mask left out): a None the router gets is
    # taken to be that input, passed on as the block passes it (a tensor there later reaches the router too)
    absent = cap.absent
    for i, arg in enumerate(args[1:], start=1):
        if arg is None and len(absent) == 1:
            rest.append(absent[0])
            continue
        if isinstance(arg, CONSTANTS):
            rest.append(Constant(arg))
            continue
        found = _tensor_arg(cap, arg, block_input)
        if found in (None, "hidden", "tokens"):
            return (f"router module {path} is called with argument {i} ({type(arg).__name__}) computed inside the "
                    f"block: only the block's input, its own tensors, its further inputs and constants can be "
                    f"passed as the block passes them")
        rest.append(str(found))
    if kwargs:
        return (f"router module {path} is called with keyword arguments {sorted(kwargs)}: pass them "
                f"positionally for moepass to call it as the block does")
    return str(first), tuple(rest)


def read_router(cap: Capture, sel: Selection, num_experts: int) -> RouterFacts:
    """The router facts of a captured block whose selection is `sel` (see the module doc)."""
    E = num_experts
    facts = RouterFacts(num_experts=E, top_k=sel.k, selection=sel)
    scores_slice = set() if sel.scores is None else upstream(sel.scores)
    for node in sorted(attrs(scores_slice), key=lambda n: value(n).shape[0] != E if value(n).dim() == 2 else True):
        val = value(node)
        if facts.weight is None and isinstance(val, nn.Parameter | torch.Tensor) and val.dim() == 2 \
                and E in val.shape and val.is_floating_point():
            facts.weight = str(node.target)
            facts.weight_transposed = val.shape[0] != E  # stored [D, E]: read as its transpose
            linear = _linear_of(node, scores_slice)
            if linear is not None:
                facts.bias = next((str(a.target) for a in linear.all_input_nodes
                                   if a.op == "get_attr" and _is_vector(a, E)), None)
                facts.logits_fp32 = any(_casts_to_fp32(n) for n in upstream(linear) if n is not node)
    for node in sorted(scores_slice, key=lambda n: n.meta["order"]):
        if node.op == "call_function" and node.target in ADD:
            vectors = [a for a in map(_uncast, node.all_input_nodes) if a.op == "get_attr" and _is_vector(a, E)
                       and str(a.target) != facts.bias]
            scored = any(n.op == "call_function" and n.target in SOFTMAX + SIGMOID for n in upstream(node))
            if vectors and scored:  # added to the scores: for the selection only
                facts.selection_bias = str(vectors[0].target)
            elif vectors and facts.bias is None:  # added to the logits (`x @ w.T + b`): the router's bias
                facts.bias = str(vectors[0].target)
        if node.op == "call_function" and node.target in SIGMOID:
            facts.sigmoid = True
        if node is not sel.node and node.op == "call_function" and node.target is sel.node.target:
            G = value(node.args[0]).shape[-1] if isinstance(node.args[0], fx.Node) else 0
            k = node.args[1] if len(node.args) > 1 else node.kwargs.get("k")
            if 1 < G < E and E % G == 0 and isinstance(k, int):
                facts.groups = (G, k)
    after = downstream(sel.node) - {sel.node}
    output_scales: list[float] = []
    for node in sorted(after, key=lambda n: n.meta.get("order", len(cap.graph.nodes))):  # the output: last
        if node.op != "call_function":
            continue
        if node.target in SOFTMAX and sel.values is not None and sel.values in node.all_input_nodes:
            facts.softmax_after = True
        val, first = value(node), value(node.args[0]) if node.args else None
        TK = sel.indices.numel()
        if node.target in SUM and isinstance(first, torch.Tensor) and first.numel() == TK \
                and isinstance(val, torch.Tensor) and val.numel() == TK // sel.k:
            facts.renormalized = True  # a sum over each token's K weights
        if node.target in MUL and isinstance(val, torch.Tensor) and val.numel() == TK:
            facts.scales += [float(a) for a in node.args if isinstance(a, float | int) and not isinstance(a, bool)
                             and a != 1]
        elif node.target in MUL and isinstance(val, torch.Tensor) and val.dim() >= 1 and val.numel() > TK \
                and val.numel() % (TK // sel.k) == 0:  # a constant scaling the combined [T, D] output instead
            output_scales += [float(a) for a in node.args if isinstance(a, float | int) and not isinstance(a, bool)
                              and a != 1]
    facts.scales += [s for s in output_scales if s not in facts.scales]  # hypotheses after the weights' own
    _module_selection(cap, facts, sel)
    if facts.weight is None and facts.module is not None and facts.selection_outputs is not None:
        facts.weight = _weights_weight(cap, facts)
    known = {facts.weight, facts.bias, facts.selection_bias}
    facts.unknown_tensors = tuple(sorted({str(n.target) for n in attrs(scores_slice)} - known))
    return facts


def _weights_weight(cap: Capture, facts: RouterFacts) -> str | None:
    """The [E, D] parameter the router module's returned weights depend on (a selection without scores:
    a lookup by token ids, weighted by the module's own logits), if any."""
    call = next((c for c in reversed(cap.calls) if c.path == facts.module), None)
    weights = None if call is None or facts.selection_outputs is None else call.output[facts.selection_outputs[0]]
    node = next((n for n in cap.graph.nodes if value(n) is weights), None)
    if node is None:
        return None
    found = [a for a in attrs(upstream(node)) if isinstance(value(a), torch.Tensor) and value(a).dim() == 2
             and value(a).shape[0] == facts.num_experts and value(a).is_floating_point()]
    return str(found[0].target) if found else None


def _attr_value(cap: Capture, path: str | None) -> torch.Tensor | None:
    node = next((n for n in cap.graph.nodes if n.op == "get_attr" and n.target == path), None)
    return None if node is None else value(node)


def known_rule(cap: Capture, facts: RouterFacts) -> dict[str, Any] | None:
    """The known rule (RULES, the graph's scales, its selection bias) that the router module's own
    selection matches on the captured probe (same experts, same weights), as RouterSpec fields; or None."""
    call = next((c for c in reversed(cap.calls) if c.path == facts.module), None)
    weight = _attr_value(cap, facts.weight)
    if call is None or weight is None or facts.selection_outputs is None:
        return None
    bias, selection_bias = _attr_value(cap, facts.bias), _attr_value(cap, facts.selection_bias)
    weight = weight.T if facts.weight_transposed else weight
    x_TD = call.args[0].reshape(-1, weight.shape[1])
    logits_TE = F.linear(x_TD.float(), weight.float(), None if bias is None else bias.float())
    K = facts.module_k or facts.top_k
    w_TK, e_TK = (call.output[i].reshape(-1, K) for i in facts.selection_outputs)
    order = e_TK.argsort(-1)
    want_e, want_w = e_TK.gather(1, order), w_TK.float().gather(1, order)
    for scale in dict.fromkeys([*facts.scales, 1.0]):
        for _label, fields in RULES:
            sb = selection_bias.float() if selection_bias is not None else None
            w, e = route_ref(logits_TE, sb, fields["score_func"], fields.get("softmax_before_topk", True), K,
                             fields["renormalize"], 1, 1, "top2_sum", scale)
            mine = e.argsort(-1)
            if torch.equal(e.gather(1, mine), want_e) and torch.allclose(w.gather(1, mine), want_w, atol=1e-5,
                                                                         rtol=1e-4):
                return dict(fields, routed_scaling_factor=scale,
                            selection_bias=None if selection_bias is None else TensorSource.param(
                                str(facts.selection_bias)),
                            bias=None if bias is None else TensorSource.param(str(facts.bias)))
    return None


def module_router(cap: Capture, facts: RouterFacts) -> RouterSpec | None:
    """The router region that calls the user's router module as it is, when it returns the selection; it
    names the known rule the module's selection matches, if one does (`RouterSpec.known_kind`)."""
    if facts.selection_outputs is None or facts.module is None:
        return None
    weights, experts = facts.selection_outputs
    known = known_rule(cap, facts)
    return RouterSpec(num_experts=facts.num_experts, top_k=facts.module_k or facts.top_k, logits_from="selection",
                      module_path=facts.module, module_output_index=weights, module_experts_index=experts,
                      module_input=facts.module_input, module_args=facts.module_args,
                      weight=TensorSource.param(facts.weight or f"{facts.module}.weight"),
                      known_kind=known is not None, **(known or {}))


DATA_DEPENDENT = (torch.nonzero, torch.Tensor.nonzero, torch.Tensor.item, torch.Tensor.tolist, torch.unique,
                  torch.Tensor.unique, torch.bincount, torch.Tensor.bincount, torch.multinomial,
                  torch.Tensor.multinomial)


def traced_logits(cap: Capture, sel: Selection) -> tuple[fx.GraphModule, tuple[str, ...]] | str:
    """The block's own code from its hidden states to the logits a known rule scores (the input of the first
    softmax / sigmoid on the way to the selection, else the selection's input), copied out of the capture as
    a GraphModule holding no tensor: called on the hidden states, then the block tensors it reads (their
    paths, returned beside it). Or why not: it reads other block inputs, calls something data-dependent,
    or bakes in one of the probe's sizes (a `view(B * S, D)` written with the probe's numbers would be wrong
    for any other batch)."""
    if sel.scores is None or cap.input_node is None:
        return "no selection scores"
    order = lambda n: n.meta["order"]  # noqa: E731
    scorers = sorted((n for n in upstream(sel.scores) if n.op == "call_function" and n.target in SOFTMAX + SIGMOID),
                     key=order)
    logits = scorers[0].args[0] if scorers else sel.scores
    if not isinstance(logits, fx.Node):
        return "the scores are not computed from the block's input"
    nodes = sorted(upstream(logits), key=order)
    if cap.input_node not in nodes or any(n.op == "placeholder" and n is not cap.input_node for n in nodes):
        return "the logits read more than the hidden states"
    hidden = value(cap.input_node)
    sizes = {*hidden.shape[:-1], hidden[..., 0].numel()} - {hidden.shape[-1], 0, 1}
    graph = fx.Graph()
    env = {cap.input_node: graph.placeholder("hidden_states")}
    paths: list[str] = []
    for node in nodes:
        if node.op == "get_attr":
            paths.append(str(node.target))
            env[node] = graph.placeholder(str(node.target).replace(".", "_"))  # fx keeps the names unique
        elif node.op == "call_function":
            if node.target in DATA_DEPENDENT:
                return f"the router code calls {getattr(node.target, '__name__', node.target)} (data-dependent)"
            baked = [a for a in tree_flatten((node.args, node.kwargs))[0] if type(a) is int and a in sizes]
            if baked:
                return f"the router code has the probe's size {baked[0]} in a call (written for one batch shape)"
            env[node] = graph.node_copy(node, lambda a: env[a])
            env[node].meta = {}
    graph.output(env[logits])
    return fx.GraphModule(nn.Module(), graph, class_name="TracedRouterLogits"), tuple(paths)


def router_hypotheses(cap: Capture, facts: RouterFacts) -> list[RouterSpec] | str:
    """RouterSpecs to try for a block, best guess first: the user's router module when it selects itself,
    else the known rules over the logits of its [E, D] weight."""
    found = module_router(cap, facts)
    if found is not None:  # a constant after the module's weights (on them or on the output): tried first
        scaled = [dataclasses.replace(found, selection_scale=s) for s in dict.fromkeys(facts.scales) if s != 1]
        if not facts.dispatch_ids:
            return scaled + [found]
        # ids that are not the block's selection: the known rules over its weight first (a one-hot dispatch mask a
        # known rule reproduces with capacity, say), the module as it is last
        by_rule = router_hypotheses(cap, dataclasses.replace(facts, selection_outputs=None, dispatch_ids=False))
        return (by_rule if isinstance(by_rule, list) else []) + scaled + [found]
    if facts.weight is None:
        return (f"no [E={facts.num_experts}, D] weight feeds the selection scores"
                + (f" ({facts.why_not_module})" if facts.why_not_module else ""))
    owner = facts.weight.rsplit(".", 1)[0] if "." in facts.weight else ""
    common = dict(
        num_experts=facts.num_experts, top_k=facts.top_k,
        weight=TensorSource.param(facts.weight, transpose=facts.weight_transposed),
        bias=TensorSource.param(facts.bias) if facts.bias else None,
        selection_bias=TensorSource.param(facts.selection_bias) if facts.selection_bias else None,
        module_path=owner, dtype="float32" if facts.logits_fp32 else "input",
    )
    rules = list(RULES)
    # the calls seen after the selection order the rules: a softmax over the top-k values, a sigmoid, a sum
    rules.sort(key=lambda rule: (
        (rule[1]["score_func"] == "sigmoid") != facts.sigmoid,
        (not rule[1].get("softmax_before_topk", True)) != facts.softmax_after,
        rule[1]["renormalize"] != facts.renormalized))
    scales = [1.0] + [s for s in dict.fromkeys(facts.scales)]
    if facts.scales:
        scales = scales[1:] + [1.0]
    specs = [RouterSpec(**common, **fields, routed_scaling_factor=scale)  # type: ignore[arg-type]
             for scale in scales for _label, fields in rules]
    if facts.groups is not None:  # a top-k over group scores before the selection: group-limited, tried first
        n_group, topk_group = facts.groups
        specs = [dataclasses.replace(spec, n_group=n_group, topk_group=topk_group, group_score=score)
                 for score in GROUP_SCORES for spec in specs] + specs
    traced = traced_logits(cap, facts.selection) if facts.selection is not None else "no selection"
    if isinstance(traced, str):
        facts.why_not_traced = traced
    else:  # the block's own logits code, then the known rules: tried after them
        fn, paths = traced
        specs += [dataclasses.replace(spec, logits_from="traced", traced=fn, module_args=paths, module_input="hidden",
                                      bias=None, dtype="input") for spec in specs]
    return specs
