"""The expert FFN of experts kept as separate tensors, run eagerly by autograd itself, expert by expert.

`moe.expert_ffn`'s own autograd (`dialect_ffn.expert_ffn_function`) computes every expert's weight gradient in
one backward node and hands each role one `[E, ...]` gradient. Where the experts are one stacked parameter per
role (Hugging Face's fused experts) that is the gradient the parameter takes. Where they are separate tensors
(ModuleList experts, read each step as one `[E, ...]` view by `canonical.stack_experts`), autograd then adds
that gradient's E slices into E `.grad`s only after the whole FFN backward: the `[E, F, D]` gradients (12 MiB
for issue 29's layer: E=8, D=256, F=512, three roles) are written whole and read back whole, beyond the 1 MiB
L2, while the block moepass replaced lets autograd add each expert's fresh 512 KB gradient as soon as it is
made. That cost the loop sample 1.04x its original's forward+backward (issue 29, item 8).

So where the expert loop runs expert by expert anyway (`grouped_ffn.Rows.per_expert`: a CPU, the counts in
host memory, a large layer) and every weight operand is such a stack (`mark_experts`), the eager call runs the
same per-expert functions — `grouped_ffn.project` (addmm with a bias) and `activation_output` — as
differentiable torch ops on the experts' own tensors:

    x_ND.split(counts) -> per expert e: h = x_e @ w_gate[e]^T (+ b), u = x_e @ w_up[e]^T (+ b),
                         y_e = act(h, u) @ w_down[e]^T (+ b)  -> cat(y_e, zeros for rows past the counts)

An expert without rows runs on its empty slice, so its weights get the zero gradient the op gives them (the
untouched loop skips it and leaves None; `moepass.train.optim.fill_missing_grads` makes the two agree).

The forward and backward values are the op's bit for bit (the same kernels on the same operands;
tests/test_ffn_autograd.py), each gradient reaches its parameter through the parameter's own AccumulateGrad, as the
original block's do (tensor hooks, DDP's reducer, `torch.autograd.grad` see what they saw there), and autograd
keeps what it kept for the original: per expert h, act(h), u and a, two [n, F] more than the op keeps (which
recomputes act(h) and a in its backward). `Plan(expert_recompute=True)` keeps the op's path and its memory.
Activations whose autograd is not the op's backward to the bit (`BY_AUTOGRAD` leaves them out) keep the op too.
Traced, compiled or exported graphs always show and run the op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from moepass import eager
from moepass.grouped_ffn import Rows, activation_output, fused_gate_up, project

EXPERT_TENSORS = "moepass_expert_tensors"  # attribute of a stacked view: the per-expert tensors it reads
# activations whose autograd backward computes what `activations.activate_and_backward` computes, bit for bit
BY_AUTOGRAD = ("swiglu", "geglu", "geglu_tanh", "gelu", "gelu_tanh", "relu")


def mark_experts(stacked: Tensor, tensors: Sequence[Tensor]) -> Tensor:
    """Record on `stacked` (a fresh `[E, ...]` view or stack of `tensors`) the tensors it was read from."""
    setattr(stacked, EXPERT_TENSORS, tuple(tensors))
    return stacked


def expert_tensors(t: Any) -> tuple[Tensor, ...] | None:
    return getattr(t, EXPERT_TENSORS, None) if isinstance(t, Tensor) else None


def pays(x_ND: Tensor, weights: Sequence[Tensor | None]) -> bool:
    """Whether autograd's way costs less memory traffic than the op's: the op writes every expert's weight
    gradients whole and autograd reads them back (their elements, once each); autograd's way keeps two [N, F]
    intermediates the op does not (act(h) and a; ReLU's one new gradient buffer instead). Measured (issue 29's
    layer, CPU, 1 thread, forward+backward against the original block): N=1024, 3 x 8 x 512 x 256 weight elements
    against 2 x 1024 x 512: autograd's way 0.98-1.00x, the op's 1.01-1.06x (SwiGLU, GeLU, ReLU, with and without
    biases); NLLB-MoE's block (N=4096, 2 x 8 x 512 x 256 against 2 x 4096 x 512): autograd's way 1.05x (median of
    4 processes), the op's 1.02x."""
    w_down_EDF = weights[2]
    assert w_down_EDF is not None
    return sum(w.numel() for w in weights if w is not None) > 2 * x_ND.shape[0] * w_down_EDF.shape[2]


def expert_ffn(*args: Any) -> Tensor | None:
    """`moe.expert_ffn(*args)` by autograd over the experts' own tensors, or None where it does not apply (the
    caller then runs the op's eager path). `args` are the op's, complete and positional."""
    x_ND, counts_E, *operands = args[:8]
    activation, clamp_limit, alpha, recompute = args[8:12]
    compute_dtype = args[12] if len(args) > 12 else None
    if recompute or compute_dtype is not None or activation not in BY_AUTOGRAD or not torch.is_grad_enabled():
        return None
    if type(x_ND) not in eager.PLAIN_TENSORS or type(counts_E) not in eager.PLAIN_TENSORS:
        return None
    experts = [expert_tensors(t) for t in operands]
    if any(t is not None and (found is None or type(t) not in eager.PLAIN_TENSORS)
           for t, found in zip(operands, experts, strict=True)):
        return None
    if not (x_ND.requires_grad or any(t is not None and t.requires_grad for t in operands)):
        return None
    w_gate_EFD, w_up_EFD, w_down_EDF = operands[:3]
    rows = Rows(counts_E, x_ND.shape[0])
    if not rows.per_expert(x_ND.shape[1], w_down_EDF.shape[2]) or not pays(x_ND, operands[:3]):
        return None
    fused = fused_gate_up(w_up_EFD, activation)
    w_gate, w_up, w_down, b_gate, b_up, b_down = experts
    assert w_gate is not None and w_down is not None
    sizes = rows.sizes
    tail = rows.rows - sum(sizes)
    parts = x_ND.split([*sizes, tail])
    ys = []
    for e, x_nD in enumerate(parts[:-1]):  # an expert without rows too: its weights get the op's zero gradient
        h_gate = project(x_nD, w_gate[e], None if b_gate is None else b_gate[e])
        h_up = None if w_up is None else project(x_nD, w_up[e], None if b_up is None else b_up[e])
        # the op's activation: ReLU in place, whose output autograd keeps for its backward as the op does
        a_nF = activation_output(h_gate, h_up, activation, clamp_limit, alpha, fused)
        ys.append(project(a_nF, w_down[e], None if b_down is None else b_down[e]))
    if tail:
        ys.append(x_ND.new_zeros(tail, w_down_EDF.shape[1]))
    return torch.cat(ys)
