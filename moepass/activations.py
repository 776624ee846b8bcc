"""The expert activations: one table, their forward and their backward (torch).

`act(gate) [* up]` for the gated ones ("geglu": the erf GELU, "geglu_tanh": its tanh approximation); "relu2" is the squared ReLU, `relu(gate) ** 2` (Primer, Nemotron-H);
"softcapped_swiglu" is `cap_g(gate) * sigmoid(gate) * cap_u(up)` with the softcap `cap_c(v) = c * tanh(v / c)`:
the sigmoid sees the raw gate, the caps bound the linear gate factor and `up` (its two caps travel in the two
float parameters every activation takes: `clamp_limit` is the gate's cap, `alpha` the up's). Every place that names an activation (MoESpec validation,
the dialect, the torch expert FFN, the Triton grouped GEMM) reads `ACTIVATIONS` / `GATED_ACTIVATIONS`
from here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

GATED_ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh", "clamped_swiglu", "softcapped_swiglu")
ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh", "gelu", "gelu_tanh", "relu", "relu2", "clamped_swiglu",
               "softcapped_swiglu")
# activations whose two parameters have no default: detection reads them from the block's graph (the constants of
# its calls), so they are not tried where the graph is not read (`detect.experts.read_expert`'s defaults)
GRAPH_PARAMETERS = ("softcapped_swiglu",)


def _approximate(activation: str) -> str:
    """`F.gelu`'s `approximate` for a GELU-gated activation."""
    return "tanh" if activation == "geglu_tanh" else "none"


def activate(h_gate: Tensor, h_up: Tensor | None, activation: str, clamp_limit: float, alpha: float) -> Tensor:
    """The expert activation, `act(gate) [* up]`."""
    if activation in ("swiglu", "geglu", "geglu_tanh"):
        assert h_up is not None, f"{activation} is gated: it needs an up projection"
        act = F.silu(h_gate) if activation == "swiglu" else F.gelu(h_gate, approximate=_approximate(activation))
        if torch.is_grad_enabled() and (h_gate.requires_grad or h_up.requires_grad):
            return act * h_up
        return act.mul_(h_up)  # the same product, one [N, F] buffer fewer
    if activation == "gelu":
        return F.gelu(h_gate)
    if activation == "gelu_tanh":
        return F.gelu(h_gate, approximate="tanh")
    if activation == "relu":
        return F.relu(h_gate)
    if activation == "relu2":
        return F.relu(h_gate).square()
    if activation == "clamped_swiglu":  # GPT-OSS
        assert h_up is not None
        g = h_gate.clamp(max=clamp_limit)
        u = h_up.clamp(min=-clamp_limit, max=clamp_limit)
        return (u + 1) * (g * torch.sigmoid(g * alpha))
    if activation == "softcapped_swiglu":
        assert h_up is not None
        cap_g, cap_u = clamp_limit, alpha
        return torch.tanh(h_gate / cap_g) * cap_g * torch.sigmoid(h_gate) * (torch.tanh(h_up / cap_u) * cap_u)
    raise ValueError(f"unknown expert activation {activation!r}: use one of {list(ACTIVATIONS)}")


def activate_backward(
    grad_a: Tensor, h_gate: Tensor, h_up: Tensor | None, activation: str, clamp_limit: float, alpha: float
) -> tuple[Tensor, Tensor | None]:
    """Gradients of `activate` w.r.t. the gate and up pre-activations."""
    aten = torch.ops.aten
    if activation == "relu2":  # d/dg relu(g)^2 = 2 relu(g)
        return grad_a * 2 * F.relu(h_gate), None
    if activation in ("gelu", "gelu_tanh", "relu"):
        if activation == "relu":
            return aten.threshold_backward(grad_a, h_gate, 0), None
        return aten.gelu_backward(grad_a, h_gate, approximate="tanh" if activation == "gelu_tanh" else "none"), None
    assert h_up is not None
    if activation == "swiglu":
        return aten.silu_backward(grad_a * h_up, h_gate), grad_a * F.silu(h_gate)
    if activation in ("geglu", "geglu_tanh"):
        approximate = _approximate(activation)
        return (aten.gelu_backward(grad_a * h_up, h_gate, approximate=approximate),
                grad_a * F.gelu(h_gate, approximate=approximate))
    if activation == "clamped_swiglu":
        g = h_gate.clamp(max=clamp_limit)
        u = h_up.clamp(min=-clamp_limit, max=clamp_limit)
        s = torch.sigmoid(g * alpha)
        glu = g * s
        grad_g = grad_a * (u + 1) * (s + alpha * g * s * (1 - s)) * (h_gate <= clamp_limit)
        grad_u = grad_a * glu * ((h_up >= -clamp_limit) & (h_up <= clamp_limit))
        return grad_g, grad_u
    if activation == "softcapped_swiglu":
        cap_g, cap_u = clamp_limit, alpha
        t_g, t_u, s = torch.tanh(h_gate / cap_g), torch.tanh(h_up / cap_u), torch.sigmoid(h_gate)
        capped_u = t_u * cap_u
        grad_g = grad_a * capped_u * ((1 - t_g * t_g) * s + t_g * cap_g * s * (1 - s))
        grad_u = grad_a * t_g * cap_g * s * (1 - t_u * t_u)
        return grad_g, grad_u
    raise ValueError(f"unknown expert activation {activation!r}: use one of {list(ACTIVATIONS)}")


def activate_and_backward(
    grad_a: Tensor, h_gate: Tensor, h_up: Tensor | None, activation: str, clamp_limit: float, alpha: float,
    out_gate: Tensor | None = None, out_up: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """`activate(...)` and `activate_backward(...)` together, sharing what both compute: the backward
    of the expert FFN needs the activation output (for the down projection's weight gradient) and the
    pre-activation gradients. SwiGLU / GeGLU: 5 elementwise passes instead of 6, and one new [N, F] buffer when
    the gate and up gradients are written into `out_gate` / `out_up` (e.g. the two halves of one [N, 2F]
    gradient, so nothing is concatenated; three new buffers otherwise): act(gate) becomes the activation
    output in place, grad_a * up is formed in the gate gradient's place; on a CPU every fresh buffer of this
    size is paid again in page faults. Same values as the two functions (the same operations, fewer buffers)."""
    if activation in ("swiglu", "geglu", "geglu_tanh") and not torch.is_grad_enabled():  # out= ops: no autograd
        assert h_up is not None
        act_g = F.silu(h_gate) if activation == "swiglu" else F.gelu(h_gate, approximate=_approximate(activation))
        grad_up = torch.mul(act_g, grad_a) if out_up is None else torch.mul(act_g, grad_a, out=out_up)
        a = act_g.mul_(h_up)  # act(g) is not needed after this: a = act(g) * up, in its buffer
        # grad_a * up, written where the gate gradient goes: an elementwise kernel may write over its input
        grad_a_up = torch.mul(grad_a, h_up) if out_gate is None else torch.mul(grad_a, h_up, out=out_gate)
        if activation == "swiglu":
            grad_gate = torch.ops.aten.silu_backward.grad_input(grad_a_up, h_gate, grad_input=grad_a_up)
        else:
            grad_gate = torch.ops.aten.gelu_backward.grad_input(grad_a_up, h_gate, approximate=_approximate(activation),
                                                                grad_input=grad_a_up)
        return a, grad_gate, grad_up
    a = activate(h_gate, h_up, activation, clamp_limit, alpha)
    grad_g, grad_u = activate_backward(grad_a, h_gate, h_up, activation, clamp_limit, alpha)
    if out_gate is not None:
        grad_g = out_gate.copy_(grad_g)
    if out_up is not None and grad_u is not None:
        grad_u = out_up.copy_(grad_u)
    return a, grad_g, grad_u
