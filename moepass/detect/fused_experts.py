"""Recogniser: fused 3-D expert weights used with batched / grouped matmul (any calls, any names).

Reads the weight layout from shapes: with D from the router's [E, D] weight, a 3-D parameter
[E, D, X] is input-major (x @ W) and [E, X, D] output-major (W @ x, nn.Linear's layout). Two
parameters: gate/up with X = 2F holds gate and up halves (either order) or interleaved rows; X = F
is a plain FFN. Three parameters: separate gate and up [E, F, D] (either role) and down. Expert
biases are the [E, F | 2F] and [E, D] parameters beside them (a [E, 2F] one split as its weight's rows). The activation is functional code:
the activation calls seen in the block's graph order the hypotheses, the semantic check decides.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from itertools import permutations

import torch
import torch.nn.functional as F
from torch import fx

from moepass.activations import ACTIVATIONS, GATED_ACTIVATIONS
from moepass.detect.candidates import Candidate
from moepass.detect.loop_experts import block_specs
from moepass.detect.router import router_hypotheses
from moepass.spec import CapacitySpec, ExpertsSpec, MoESpec, TensorSource

NAME = "fused-3d"
GATED_ACTS = GATED_ACTIVATIONS
PLAIN_ACTS = tuple(a for a in ACTIVATIONS if a not in GATED_ACTIVATIONS)
# activation calls seen in a block's graph -> the activations they make likely, first
SEEN_ACTS = {F.silu: ("swiglu",), F.gelu: ("geglu", "gelu", "gelu_tanh", "geglu_tanh"), F.relu: ("relu", "relu2"),
             torch.relu: ("relu", "relu2"),
             torch.clamp: ("clamped_swiglu",), torch.Tensor.clamp: ("clamped_swiglu",),
             torch.tanh: ("softcapped_swiglu",), torch.Tensor.tanh: ("softcapped_swiglu",)}
TANH = (torch.tanh, torch.Tensor.tanh)
DIV = (torch.div, torch.Tensor.div, torch.true_divide, torch.Tensor.__truediv__, operator.truediv)


def _halves(name: str, input_major: bool, chunk_dim: int, unflatten: int | None = None
            ) -> list[tuple[TensorSource, TensorSource]]:
    """(gate, up) readings of one [.., 2F, ..] tensor: halves in either order, rows interleaved either way."""
    out = []
    view = dict(transpose=input_major, chunk_dim=chunk_dim, unflatten=unflatten)
    for g, u in ((0, 1), (1, 0)):
        out.append((TensorSource.param(name, chunk=(g, 2), **view), TensorSource.param(name, chunk=(u, 2), **view)))
    for g, u in ((0, 1), (1, 0)):
        out.append((TensorSource.param(name, interleave=(g, 2), **view),
                    TensorSource.param(name, interleave=(u, 2), **view)))
    return out


def expert_layouts(c: Candidate, D: int) -> list[dict]:
    """Possible (w_gate, w_up, w_down, F) readings of the fused parameters (see the module doc).

    Canonical layouts are gate/up [E, F, D] and down [E, D, F]. The in-projections and the down projection
    are read in one orientation first (both input-major, both output-major); only when neither reads, in
    opposite ones (e.g. every tensor [E, F, D]: gate / up as nn.Linear weights, down as `h @ W`). Tensors
    stored flattened [E·n, X] (`Candidate.flattened`) are read as [E, n, X].
    """
    prefix = f"{c.experts_path}." if c.experts_path else ""

    def source(name: str, **view: object) -> TensorSource:
        return TensorSource.param(prefix + name, unflatten=c.flattened.get(name), **view)  # type: ignore[arg-type]

    layouts: list[dict] = []
    for orientations in (((True, True), (False, False)), ((False, True), (True, False))):
        for in_major, down_major in orientations:
            # in-projections: [E, D, X] input-major, [E, X, D] output-major; down the other way round
            x_dim, chunk_dim = (2, 2) if in_major else (1, 1)

            def reads_in(shape: tuple[int, ...], in_major: bool = in_major) -> bool:
                return shape[1 if in_major else 2] == D

            def down_width(shape: tuple[int, ...], down_major: bool = down_major) -> int | None:
                return shape[1] if down_major and shape[2] == D else shape[2] if not down_major and shape[1] == D \
                    else None

            items = list(c.fused_params.items())
            for (down_name, sd), *ins in (p for n in (2, 3) if len(items) == n for p in permutations(items, n)):
                F_dim = down_width(sd)
                if F_dim is None or not all(reads_in(s) for _, s in ins):
                    continue
                down = source(down_name, transpose=down_major)
                widths = [s[x_dim] for _, s in ins]
                if len(ins) == 1 and widths == [2 * F_dim]:
                    for gate, up in _halves(prefix + ins[0][0], in_major, chunk_dim, c.flattened.get(ins[0][0])):
                        layouts.append(dict(F=F_dim, gated=True, w_down=down, w_gate=gate, w_up=up))
                elif len(ins) == 1 and widths == [F_dim]:
                    layouts.append(dict(F=F_dim, gated=False, w_down=down, w_up=None,
                                        w_gate=source(ins[0][0], transpose=in_major)))
                elif len(ins) == 2 and widths == [F_dim, F_dim]:
                    (g, _), (u, _) = ins
                    layouts.append(dict(F=F_dim, gated=True, w_down=down, w_gate=source(g, transpose=in_major),
                                        w_up=source(u, transpose=in_major)))
        if layouts:
            break
    return layouts


def _biases(c: Candidate, width: int) -> list[TensorSource | None]:
    """The experts' [E, width] parameters (biases) that could serve, or [None]. Several when shapes tie (D == F:
    the in- and out-biases are both [E, D]): each is a hypothesis, the semantic check decides."""
    prefix = f"{c.experts_path}." if c.experts_path else ""
    router = {c.router.weight, c.router.bias, c.router.selection_bias} if c.router else set()
    found = [n for n, p in c.experts.named_parameters(recurse=False)
             if tuple(p.shape) == (c.num_ffn_experts, width) and prefix + n not in router]
    return [TensorSource.param(prefix + n) for n in found] or [None]


def _bias_pairs(c: Candidate, in_width: int | None, D: int) -> list[tuple[TensorSource | None, TensorSource | None]]:
    """(in-projection bias, down bias) readings, never one parameter for both; in_width None: no in-bias read."""
    ins = _biases(c, in_width) if in_width is not None else [None]
    pairs = [(b_in, b_down) for b_in in ins for b_down in _biases(c, D)
             if b_in is None or b_down is None or b_in.paths != b_down.paths]
    return pairs or [(None, None)]


def activations(c: Candidate, gated: bool) -> list[str]:
    """The known activations, those whose calls the block's graph makes first."""
    known = GATED_ACTS if gated else PLAIN_ACTS
    seen = [a for fn, acts in SEEN_ACTS.items() if c.graph is not None and c.graph.nodes([fn]) for a in acts]
    if c.graph is not None and any(n.kwargs.get("approximate") == "tanh" for n in c.graph.nodes([F.gelu])):
        seen = ["geglu_tanh", "gelu_tanh", *seen]  # GELU's tanh approximation: the erf form differs by ~1e-4
    return sorted(known, key=lambda a: seen.index(a) if a in seen else len(seen))


def softcaps(c: Candidate) -> list[tuple[float, float]]:
    """(gate cap, up cap) readings of a softcapped SwiGLU: the constants `c` of the `tanh(v / c)` calls in the
    block's graph, in call order (gate first, then up; also the other way round); [] when it makes none."""
    caps: list[float] = []
    for node in c.graph.nodes(list(TANH)) if c.graph is not None else []:
        arg = node.args[0] if node.args else None
        if isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target in DIV and len(arg.args) == 2 \
                and isinstance(arg.args[1], (int, float)) and arg.args[1] and float(arg.args[1]) not in caps:
            caps.append(float(arg.args[1]))
    if not caps:
        return []
    gate, up = (caps[0], caps[1]) if len(caps) > 1 else (caps[0], caps[0])
    return list(dict.fromkeys([(gate, up), (up, gate)]))


def down_read_last(c: Candidate, layout: dict) -> bool:
    """Whether the block's graph first uses `layout`'s down weight after every in-projection weight (an FFN
    reads its in-projections first, whatever the code looks like): such layouts are tried first."""
    if c.graph is None:
        return False
    first_use = {str(n.target): min((u.meta["order"] for u in n.users), default=-1)
                 for n in c.graph.graph.nodes if n.op == "get_attr"}
    down = first_use.get(layout["w_down"].paths[0], -1)
    return all(first_use.get(layout[role].paths[0], -1) < down for role in ("w_gate", "w_up") if layout[role])


def recognise(c: Candidate, capacity: CapacitySpec | None = None, name: str = NAME) -> list[MoESpec] | str:
    if c.experts_kind != "fused" or c.router is None or c.graph is None:
        return "experts are not fused 3-D weights"
    D = c.hidden_dim
    layouts = expert_layouts(c, D)
    if not layouts:
        return f"3-D parameters {c.fused_params} do not read as gate/up [E, D, F|2F] and down [E, F, D] with D={D}"
    routers = router_hypotheses(c.graph, c.router)
    if isinstance(routers, str):
        return routers
    specs: list[MoESpec] = []
    for layout in sorted(layouts, key=lambda lay: not down_read_last(c, lay)):
        for experts in layout_experts(c, layout, D):
            found = block_specs(c, name, experts, routers, capacity=capacity)
            if isinstance(found, str):
                return found
            specs.extend(found)
    return specs


def _softcap_params(c: Candidate) -> list[dict]:
    """The ExpertsSpec fields of each softcap reading (`softcaps`): the gate's cap in `clamp_limit`, the up's in
    `swiglu_alpha` (`moepass.activations`)."""
    return [dict(clamp_limit=gate, swiglu_alpha=up) for gate, up in softcaps(c)]


def layout_experts(c: Candidate, layout: dict, D: int, biases: bool = True) -> list[ExpertsSpec]:
    """The ExpertsSpecs of one layout (`expert_layouts`): each reading of its biases (`biases`: the experts'
    [E, width] parameters beside the weights) times each activation, the graph's first."""
    F_dim = layout["F"]
    one_tensor = layout["gated"] and layout["w_gate"].paths == layout["w_up"].paths
    # separate gate and up tensors: a lone [E, F] bias cannot say which it belongs to (none is read)
    in_width = 2 * F_dim if one_tensor else None if layout["gated"] else F_dim
    found = []
    for b_in, b_down in _bias_pairs(c, in_width, D) if biases else [(None, None)]:
        b_gate = b_up = None
        if not layout["gated"]:
            b_gate = b_in
        elif one_tensor and b_in is not None:  # one gate/up tensor: its [E, 2F] bias, split like its rows
            b_gate, b_up = (replace(b_in, chunk=w.chunk, interleave=w.interleave, chunk_dim=1)
                            for w in (layout["w_gate"], layout["w_up"]))
        found += [ExpertsSpec(num_experts=c.num_ffn_experts, hidden_dim=D, ffn_dim=F_dim, activation=act,  # type: ignore[arg-type]
                              w_gate=layout["w_gate"], w_up=layout["w_up"], w_down=layout["w_down"],
                              b_gate=b_gate, b_up=b_up, b_down=b_down, container=c.experts_path, **params)
                  for act in activations(c, layout["gated"])
                  for params in (_softcap_params(c) if act == "softcapped_swiglu" else [{}])]
    return found


