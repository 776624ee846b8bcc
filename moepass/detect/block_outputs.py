"""What a candidate's recorded forward says beyond its selection: the weights on the experts' input, what it
returns after the hidden states, an output bias or module, a load counter, per-expert output scales and a
shared expert. Each reads the probe graph (`moepass.detect.capture`), never a name."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from moepass.detect.candidate import Candidate, within
from moepass.detect.capture import (
    attrs,
    downstream,
    upstream,
    value,
)
from moepass.detect.graph_candidates import selections
from moepass.detect.router import ADD
from moepass.dialect import expert_load_ref
from moepass.spec import LOAD_OUTPUT, ROUTER_OUTPUT, SharedExpertSpec


def input_weighted(c: Candidate) -> bool:
    """Whether the selection's weights multiply the experts' input: a call reading an expert tensor (of the
    expert group, not the router's) has the selected values upstream of another of its inputs (e.g.
    `bmm(x * score, W)`). Weights applied to the outputs reach only calls after the experts' matmuls (an output
    bias, a projection after the block's experts: tensors outside the group); a mask made from the weights is no
    weighting."""
    if c.graph is None or c.selection is None or c.selection.values is None:
        return False
    prefix = f"{c.experts_path}." if c.experts_path else ""
    fused = {prefix + name for name in c.fused_params}

    def expert_tensor(node: fx.Node) -> bool:
        target = str(node.target)
        return node.op == "get_attr" and (target in fused if fused else bool(prefix) and target.startswith(prefix))

    weighted = _float_downstream(c.selection.values)
    for node in weighted:
        params = [a for a in node.all_input_nodes if expert_tensor(a)]
        if params and any(a in weighted for a in node.all_input_nodes if a not in params):
            return True
    return False


def _float_downstream(start: fx.Node) -> set[fx.Node]:
    """The nodes that depend on `start` through floating values only: a mask made from the weights (`w > 0`, a
    dispatch tensor) carries which rows go where, not the weights' values."""
    found, todo = {start}, [start]
    while todo:
        for user in todo.pop().users:
            val = value(user)
            if user in found or isinstance(val, torch.Tensor) and not val.is_floating_point():
                continue
            found.add(user)
            todo.append(user)
    return found


def side_outputs(c: Candidate) -> list[str]:
    """What the block returns after its hidden states, each as a `MoESpec.side_outputs` name when it is one
    moepass reproduces ("none"; "expert_load.<dtype>": the selection's count per expert; "router_logits": a
    [T, E] floating tensor; "topk_weights" / "topk_experts": the selection itself, [T, K]; the semantic check
    confirms each), else a description starting with "?"."""
    out = c.graph.output if c.graph is not None else None
    if not isinstance(out, tuple) or c.selection is None:
        return []
    R, (T, K) = c.num_experts, c.selection.indices.shape
    load = expert_load_ref(c.selection.indices, R)
    module = c.router.module if c.router is not None else None
    router = next((r for r in reversed(c.graph.calls) if r.path == module), None) if module else None
    returned = router.output if router is not None and isinstance(router.output, (tuple, list)) else ()
    kinds = []
    for i, v in enumerate(out[1:], start=1):
        mine = next((j for j, r in enumerate(returned) if v is not None and r is v), None)
        if mine is not None and not (isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() == T * R):
            kinds.append(f"{ROUTER_OUTPUT}{mine}")  # what the router module returned, as it is (not its logits)
        elif v is None:
            kinds.append("none")
        elif isinstance(v, torch.Tensor) and tuple(v.shape) == (R,) and torch.equal(v.double(), load.double()):
            kinds.append(LOAD_OUTPUT + str(v.dtype).removeprefix("torch."))
        elif isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() == T * R and v.shape[-1] == R:
            kinds.append("router_logits")
        elif isinstance(v, torch.Tensor) and v.numel() == T * K and v.shape[-1] == K:  # the selection itself
            same = not v.is_floating_point() and torch.equal(v.reshape(T, K), c.selection.indices)
            kinds.append("topk_experts" if same else "topk_weights" if v.is_floating_point() else
                         f"?output {i} ({list(v.shape)} {str(v.dtype).removeprefix('torch.')})")
        else:
            what = f"{list(v.shape)} {str(v.dtype).removeprefix('torch.')}" if isinstance(v, torch.Tensor) \
                else type(v).__name__
            kinds.append(f"?output {i} ({what}{', a scalar: an aux loss?' if isinstance(v, torch.Tensor) and not v.dim() else ''})")
    return kinds


def output_bias(c: Candidate) -> str | None:
    """A [D] parameter of the block (outside its experts and router) added to a value that depends on the
    selection: a bias on the combined output. None when there is none."""
    if c.graph is None or c.selection is None:
        return None
    after: set = set()  # what depends on any selection over the R scores (the block's last may come late)
    for node, _, E in selections(c.graph):
        if E == c.num_experts:
            after |= downstream(node)
    skip = [p for p in (c.experts_path, c.router_path) if p]
    for node in attrs(c.graph.graph.nodes):
        val, path = value(node), str(node.target)
        if not isinstance(val, nn.Parameter) or tuple(val.shape) != (c.hidden_dim,) or any(within(path, p) for p in skip):
            continue
        if any(u.op == "call_function" and u.target in (*ADD, torch.Tensor.__iadd__)
               and any(a in after for a in u.all_input_nodes)
               for u in node.users):
            return path
    return None


def output_module(c: Candidate) -> str | None:
    """A submodule with parameters (outside the experts and the router) that the block calls last and whose output
    is what the block returns, called on something that depends on the selection: a norm on the output (`MoESpec.
    output_module`). None when there is none."""
    if c.graph is None or c.selection is None:
        return None
    out = c.graph.output[0] if isinstance(c.graph.output, tuple) else c.graph.output
    top = [call for call in c.graph.calls if call.parent == "" and call.path]
    if not top or top[-1].output is not out or not top[-1].args:
        return None
    path = top[-1].path
    skip = [p for p in (c.experts_path, c.router_path, c.router.module if c.router else None) if p]
    if any(within(path, p) or within(p, path) for p in skip) or not any(True for _ in
                                                                       c.module.get_submodule(path).parameters()):
        return None
    arg = top[-1].args[0]
    after = downstream(c.selection.node)
    return path if any(value(n) is arg for n in after) else None


def input_module(c: Candidate) -> str | None:
    """A submodule with parameters (outside the experts and the router) that the block calls on its input (as
    given, or as [T, D] tokens) and whose output, of the same shape, is what the experts module is called on, away
    from the selection scores: a norm on the experts' input only (`MoESpec.input_module`). None when there is none."""
    if c.graph is None or c.selection is None or c.graph.input_node is None or not c.experts_path:
        return None
    x = value(c.graph.input_node)
    top = [call for call in c.graph.calls if call.parent == "" and call.path]
    experts = next((call for call in top if call.path == c.experts_path), None)
    if experts is None or not experts.args or not isinstance(experts.args[0], torch.Tensor):
        return None
    scores = upstream(c.selection.scores or c.selection.node)
    skip = [p for p in (c.experts_path, c.router_path, c.router.module if c.router else None, c.output_module) if p]
    for call in top:
        arg = call.args[0] if call.args else None
        if call.output is not experts.args[0] or not isinstance(arg, torch.Tensor) or arg.shape != call.output.shape \
                or any(within(call.path, p) or within(p, call.path) for p in skip) \
                or not any(True for _ in c.module.get_submodule(call.path).parameters()):
            continue
        tokens = arg.dim() == 2 and arg.shape == (x.numel() // x.shape[-1], x.shape[-1]) \
            and torch.equal(arg, x.reshape(arg.shape))
        if (arg is x or tokens) and not any(value(n) is call.output for n in scores):
            return call.path
    return None


def load_counter(probe: nn.Module, inputs: tuple[Any, ...], R: int, K: int) -> str | None:
    """The [O] buffer a train-mode forward of the block adds its experts' load to, read from what one such
    forward does (on the probe, under no_grad, the RNG state restored): the buffer whose increase is a count
    per expert summing to every token's K choices. None when no buffer moves that way."""
    tokens = inputs[0].numel() // inputs[0].shape[-1]
    start = {name: t.clone() for name, t in probe.named_buffers() if t.dim() == 1 and t.shape[0] == R}
    if not start:
        return None
    was_training = probe.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            probe.train()
            probe(*(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs))
    except Exception:  # the block's train mode is checked (and reported) by the semantic check
        return None
    finally:
        probe.train(was_training)
    buffers = dict(probe.named_buffers())
    found = None
    for name, before in start.items():
        delta = (buffers[name].double() - before.double()).round()  # the probe's buffers hold random values
        moved = not torch.equal(buffers[name], before)
        buffers[name].copy_(before)  # the probe is used again: leave it as it was
        if found is None and moved and bool((delta >= 0).all()) and int(delta.sum()) == tokens * K:
            found = name
    return found


def output_scales(c: Candidate) -> list[str]:
    """Block tensors that may scale each expert's output: [O] or [O, 1] floating parameters / buffers the
    graph reads outside the selection scores' slice that are not the router's (R the router's experts). Not one
    only a router module returning the selection reads: the weights it returns carry it already."""
    if c.graph is None or c.selection is None:
        return []
    R = c.num_experts
    scores = upstream(c.selection.scores or c.selection.node)
    router = {c.router.weight, c.router.bias, c.router.selection_bias} if c.router else set()
    selecting = c.router.module if c.router is not None and c.router.selection_outputs is not None else None
    found = []
    for node in attrs(c.graph.graph.nodes):
        val = value(node)
        if node in scores or str(node.target) in router or not node.users or not isinstance(val, torch.Tensor) \
                or not val.is_floating_point() or tuple(val.shape) not in ((R,), (R, 1)):
            continue
        if selecting is not None and all(selecting in u.meta["stack"] for u in node.users):
            continue
        found.append(str(node.target))
    return list(dict.fromkeys(found))


def shared_expert(c: Candidate) -> SharedExpertSpec | None:
    """The shared expert, from the block's own module calls: a submodule (outside the router and the
    experts) called on the tokens that returns [T, D]; its gate, a linear to 1 output called on them too."""
    if c.graph is None or c.graph.input_node is None:
        return None
    x = c.graph.input_node.meta["val"]
    T, D = x.numel() // x.shape[-1], x.shape[-1]
    skip = [p for p in (c.experts_path, c.router_path, c.router.module if c.router else None, c.output_module,
                        c.input_module) if p]
    shared = gate = None
    taken: tuple[tuple[str, int], ...] = ()
    for call in c.graph.calls:
        if call.parent != "" or call.path == "" or not call.args or any(
                within(call.path, p) or within(p, call.path) for p in skip):  # the experts, the router, or above
            continue
        arg, out = call.args[0], call.output
        if not isinstance(arg, torch.Tensor) or not isinstance(out, torch.Tensor) or arg.shape[-1] != D \
                or arg.numel() != T * D:  # called on the tokens ([T, D], or the input as given)
            continue
        if out.shape == arg.shape and shared is None:
            shared, taken = call.path, _router_outputs(c, call)
        elif out.shape == (*arg.shape[:-1], 1) and isinstance(c.module.get_submodule(call.path), nn.Linear) \
                and gate is None:
            gate = call.path
    return None if shared is None else SharedExpertSpec(module_path=shared, gate_path=gate, router_outputs=taken)


def _router_outputs(c: Candidate, call: Any) -> tuple[tuple[str, int], ...]:
    """The further arguments of the shared expert's `call` that are outputs of the block's router module (the
    very tensors its last call returned): (keyword, or "" by position; index into the router's outputs).
    A sink scored beside the routed experts is weighted this way (`SharedExpertSpec.router_outputs`)."""
    module = c.router.module if c.router is not None else None
    router = next((r for r in reversed(c.graph.calls) if r.path == module), None) if c.graph is not None else None
    if router is None or not isinstance(router.output, (tuple, list)):
        return ()
    given = [("", a) for a in call.args[1:]] + list(call.kwargs.items())
    found = []
    for key, arg in given:
        index = next((i for i, v in enumerate(router.output) if isinstance(arg, torch.Tensor) and v is arg), None)
        if index is None:
            return ()  # something else is passed too: not read (the check decides without it)
        found.append((key, index))
    return tuple(found)
