"""The expert function of an expert *module* (a ModuleList / ModuleDict entry), read from its graph.

One expert is captured on a probe input (`moepass.detect.capture`); its linear calls say the roles,
whatever the linears are called: the linear whose output the expert returns is `down`, the linears
on the expert's input are `gate` (and `up`); one input linear twice as wide as `down`'s input holds
gate and up (halves in either order, or interleaved rows). Which activation joins them, and which
of two input linears is the gate, is decided numerically: each reading is run on the probe input
with the expert's own weights and must reproduce the expert's output (`moepass.activations`). An
expert that does something else (a norm, a scale, a matmul with a bare tensor) is declined with the
reason, and `read_generic_expert` says whether the experts can run as they are instead (the generic
expert op, `moepass.generic_experts`): identical structure, [T, D] -> [T, D].
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from moepass.activations import ACTIVATIONS, GATED_ACTIVATIONS, GRAPH_PARAMETERS, activate
from moepass.detect.capture import LINEAR, capture, upstream, value
from moepass.detect.check import probe_copy

ATOL, RTOL = 1e-5, 1e-4
CLAMP_LIMIT, SWIGLU_ALPHA = 7.0, 1.702  # clamped_swiglu's constants (ExpertsSpec defaults)


@dataclass(frozen=True)
class Role:
    """One weight of the expert function: a parameter path (relative to the expert) and its view."""

    weight: str
    bias: str | None = None
    chunk: tuple[int, int] | None = None  # (index, parts) of the rows (dim 0 of a [out, in] weight)
    interleave: tuple[int, int] | None = None  # (start, step) of the rows


@dataclass(frozen=True)
class ExpertFunction:
    """`down(act(gate(x)) [* up(x)])`, the roles in nn.Linear layout ([out, in])."""

    activation: str
    gate: Role
    up: Role | None
    down: Role
    hidden_dim: int  # D
    ffn_dim: int  # F


def _rows(tensor: torch.Tensor | None, role: Role) -> torch.Tensor | None:
    if tensor is None:
        return None
    if role.chunk is not None:
        return tensor.chunk(role.chunk[1], 0)[role.chunk[0]]
    if role.interleave is not None:
        return tensor[role.interleave[0]::role.interleave[1]]
    return tensor


def _linear_parts(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """(input, weight, bias) nodes of an F.linear call whose weight (and bias) are the expert's own tensors."""
    args = list(node.args) + [None] * 3
    x, weight = args[0], args[1]
    bias = node.kwargs.get("bias", args[2])
    if not isinstance(weight, fx.Node) or weight.op != "get_attr" or not isinstance(x, fx.Node):
        return None
    if bias is not None and (not isinstance(bias, fx.Node) or bias.op != "get_attr"):
        return None
    return x, weight, bias


def read_expert(expert: nn.Module, dim: int, seed: int = 0) -> ExpertFunction | str:
    """The expert's function (see the module doc), or the reason it is not a known FFN."""
    probe = probe_copy(expert, seed)
    x = torch.randn(5, dim, generator=torch.Generator().manual_seed(seed))
    try:
        cap = capture(probe, x)
    except Exception as err:
        return f"an expert fails on a [5, D={dim}] probe: {type(err).__name__}: {err}"
    out = cap.output
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return f"an expert returns {type(out).__name__} of shape {getattr(out, 'shape', None)}, not [T, D={dim}]"
    linears = cap.nodes(LINEAR)
    parts = {n: _linear_parts(n) for n in linears}
    if not linears or any(p is None for p in parts.values()):
        return "an expert's computation is not linear layers of its own weights (F.linear / nn.Linear)"
    params = dict(probe.named_parameters())
    used = {str(p[1].target) for p in parts.values() if p} | {str(p[2].target) for p in parts.values() if p and p[2]}
    if set(params) - used:
        return f"an expert holds parameters its linears do not use: {sorted(set(params) - used)}"
    output_node = next(n for n in cap.graph.nodes if n.op == "output").args[0][0]
    ending = [n for n in linears if n in upstream(output_node)]
    down = ending[-1] if ending else None
    if down is None or value(down) is not out and not torch.equal(value(down), out):
        return "an expert's output is not the result of its last linear layer"
    inputs = [n for n in linears if n is not down]
    if any(parts[n][0] is not cap.input_node for n in inputs) or parts[down][0] is cap.input_node:  # type: ignore[index]
        return "an expert is not input linear(s) -> activation -> output linear"

    def role(node: fx.Node, **view: object) -> Role:
        _x, w, b = parts[node]  # type: ignore[misc]
        return Role(str(w.target), None if b is None else str(b.target), **view)  # type: ignore[arg-type]

    F_dim = params[str(parts[down][1].target)].shape[1]  # type: ignore[index]
    readings: list[tuple[Role, Role | None, tuple[str, ...]]] = []
    known = tuple(a for a in ACTIVATIONS if a not in GRAPH_PARAMETERS)  # tried with their default parameters
    gated_known = tuple(a for a in GATED_ACTIVATIONS if a in known)
    plain = tuple(a for a in known if a not in GATED_ACTIVATIONS)
    if len(inputs) == 1 and value(inputs[0]).shape[-1] == F_dim:
        readings.append((role(inputs[0]), None, plain))
    elif len(inputs) == 1 and value(inputs[0]).shape[-1] == 2 * F_dim:
        for g, u in ((0, 1), (1, 0)):
            readings.append((role(inputs[0], chunk=(g, 2)), role(inputs[0], chunk=(u, 2)), gated_known))
            readings.append((role(inputs[0], interleave=(g, 2)), role(inputs[0], interleave=(u, 2)), gated_known))
    elif len(inputs) == 2:
        a, b = inputs
        readings += [(role(a), role(b), gated_known), (role(b), role(a), gated_known)]
    else:
        return f"an expert has {len(inputs)} input linear(s) of widths {[value(n).shape[-1] for n in inputs]}"
    down_role = role(down)
    for gate, up, activations in readings:
        for activation in activations:
            if _reproduces(params, x, out, gate, up, down_role, activation):
                return ExpertFunction(activation, gate, up, down_role, dim, F_dim)
    return (f"no known FFN activation {list(known)} reproduces an expert "
            f"({'gated' if readings[0][1] is not None else 'not gated'}, F={F_dim})")


@dataclass(frozen=True)
class GenericExpert:
    """Experts run as they are: their tensors' names (parameters, then buffers) and the class for reports."""

    tensors: tuple[str, ...]
    class_name: str
    ffn_dim: int  # the FFN width with the same parameter count, 2*D*F (for the cost model)


def _structure(module: nn.Module) -> tuple[object, ...]:
    """What experts must share to be stacked: every submodule's class, every tensor's name, shape and dtype."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (tuple(type(m) for m in module.modules()), tuple((n, t.shape, t.dtype) for n, t in tensors))


def read_generic_expert(experts: list[nn.Module], dim: int, seed: int = 0) -> GenericExpert | str:
    """The generic reading of experts that are not a known FFN (see the module doc), or why there is none."""
    first = experts[0]
    if any(_structure(m) != _structure(first) for m in experts[1:]):
        return "the experts differ in their classes or their tensors' names, shapes or dtypes, so they do not stack"
    params = [n for n, _ in first.named_parameters()]
    if not params:
        return "an expert holds no parameters"
    x = torch.randn(5, dim, generator=torch.Generator().manual_seed(seed))
    try:
        out = probe_copy(first, seed)(x)
    except Exception as err:
        return f"an expert fails on a [5, D={dim}] probe: {type(err).__name__}: {err}"
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return f"an expert returns {type(out).__name__} of shape {getattr(out, 'shape', None)}, not [T, D={dim}]"
    numel = sum(p.numel() for p in first.parameters())
    names = (*params, *(n for n, _ in first.named_buffers()))
    return GenericExpert(names, type(first).__name__, max(1, numel // (2 * dim)))


def _reproduces(params: Mapping[str, torch.Tensor], x: torch.Tensor, out: torch.Tensor, gate: Role, up: Role | None,
                down: Role, activation: str) -> bool:
    def linear(r: Role, inp: torch.Tensor) -> torch.Tensor:
        w = _rows(params[r.weight], r)
        b = _rows(params[r.bias], r) if r.bias else None
        return F.linear(inp, w, b)  # type: ignore[arg-type]

    with torch.no_grad():
        h = activate(linear(gate, x), None if up is None else linear(up, x), activation, CLAMP_LIMIT, SWIGLU_ALPHA)
        if h.shape[-1] != params[down.weight].shape[1]:
            return False
        return torch.allclose(linear(down, h), out, atol=ATOL, rtol=RTOL)
