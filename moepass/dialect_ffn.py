"""The expert FFN op of the MoE dialect: `moe.expert_ffn`, one node in every graph, over two ops autograd and AOT
see (`moe.expert_ffn_forward`, `moe.expert_ffn_backward`), with its torch reference, shape checks and the
weight-gradient machinery (rebuildable weights for FSEP, deferred weight gradients for Lancet).

A custom op's autograd sees only the op's output, and the backward needs the pre-activations, so the op is
defined with `define_expert_ffn` rather than `custom_op` (`moepass.dialect` re-exports every name here and
registers the op's autocast policy). Shape letters: `moepass.spec.SHAPES`. Host sync: the references read
`counts_E` on the host (`grouped_ffn.split_sizes`); the op runs `moepass.grouped_ffn`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from moepass import eager, ffn_autograd, grouped_ffn
from moepass.activations import activate
from moepass.grouped_ffn import fused_gate_up
from moepass.operands import OpSchema, register_autocast


def expert_ffn_ref(
    x_ND: Tensor,
    counts_E: Tensor,
    w_gate_EFD: Tensor,
    w_up_EFD: Tensor | None,
    w_down_EDF: Tensor,
    b_gate_EF: Tensor | None,
    b_up_EF: Tensor | None,
    b_down_ED: Tensor | None,
    activation: str,
    clamp_limit: float,
    alpha: float,
) -> Tensor:
    """Per-expert FFN over expert-sorted rows: rows [offset_e, offset_e + counts_E[e]) use expert e."""
    outs = []
    for e, rows_MD in enumerate(torch.split(x_ND, grouped_ffn.split_sizes(counts_E))):
        h_gate = F.linear(rows_MD, w_gate_EFD[e], None if b_gate_EF is None else b_gate_EF[e])
        h_up = None if w_up_EFD is None else F.linear(rows_MD, w_up_EFD[e], None if b_up_EF is None else b_up_EF[e])
        a = activate(h_gate, h_up, activation, clamp_limit, alpha)
        outs.append(F.linear(a, w_down_EDF[e], None if b_down_ED is None else b_down_ED[e]))
    if not outs:
        return x_ND.new_empty(0, w_down_EDF.shape[1])
    return torch.cat(outs)


# ----------------------------------------------------------------------------------------------
# Shape validation shared by the real and the fake implementations.
# ----------------------------------------------------------------------------------------------


def check_ffn_shapes(x_ND: Tensor, counts_E: Tensor, w_gate: Tensor, w_up: Tensor | None, w_down: Tensor,
                     activation: str = "") -> None:
    E, F_, D = w_gate.shape
    if fused_gate_up(w_up, activation):
        if F_ % 2:
            raise ValueError(f"moe.expert_ffn: fused gate/up w_gate_EFD has {F_} rows per expert, expected 2F")
        F_ //= 2
    if x_ND.dim() != 2 or x_ND.shape[1] != D:
        raise ValueError(f"moe.expert_ffn: x_ND has shape {tuple(x_ND.shape)}, expected (N, D={D}) from w_gate_EFD")
    if counts_E.shape != (E,):
        raise ValueError(f"moe.expert_ffn: counts_E has shape {tuple(counts_E.shape)}, expected (E={E},)")
    if w_up is not None and w_up.shape != w_gate.shape:
        raise ValueError(f"moe.expert_ffn: w_up_EFD {tuple(w_up.shape)} != w_gate_EFD {tuple(w_gate.shape)}")
    if w_down.shape != (E, D, F_):
        raise ValueError(f"moe.expert_ffn: w_down_EDF has shape {tuple(w_down.shape)}, expected (E={E}, D={D}, F={F_})")


FFN_DIFFERENTIABLE = (0, 2, 3, 4, 5, 6, 7)  # x, weights, biases (not counts)
FFN_WEIGHTS = ("Tensor counts_E, Tensor w_gate_EFD, Tensor? w_up_EFD, Tensor w_down_EDF, "
               "Tensor? b_gate_EF, Tensor? b_up_EF, Tensor? b_down_ED, str activation, float clamp_limit, float alpha")
FFN_ARGS = "Tensor x_ND, " + FFN_WEIGHTS  # the operands of every expert FFN op, then each op's own
# `compute_dtype`: the experts compute in that dtype (`ExpertsSpec.compute_dtype`): x, weights and biases cast to it,
# y cast back to x's dtype, every gradient to its input's dtype (as autograd over the block's own casts gives)
EXPERT_FFN_SCHEMA = OpSchema("expert_ffn", FFN_ARGS + ", bool recompute=False, ScalarType? compute_dtype=None",
                             "Tensor", autocast="compute")
EXPERT_FFN_DEFAULTS = (False, None)  # recompute, compute_dtype: the trailing defaults the dispatcher drops
FFN_WEIGHT_NAMES = tuple(o.name for o in EXPERT_FFN_SCHEMA.operands if o.name[:2] in ("w_", "b_"))  # weights, biases
_FFN_LIBS: list[torch.library.Library] = []


def complete(args: tuple) -> tuple:
    """An expert-FFN op's arguments with the trailing defaults the dispatcher (or a graph) left out."""
    return args + EXPERT_FFN_DEFAULTS[len(args) - 11:]


def in_compute_dtype(inputs: tuple | list, dtype: torch.dtype | None) -> tuple:
    """The floating tensors among an expert-FFN call's leading operands cast to its compute dtype (unchanged
    without one; counts_E is an integer tensor and stays)."""
    if dtype is None:
        return tuple(inputs)
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t for t in inputs)


def forward_only(forward: Callable[..., Any], args: tuple) -> Tensor:
    """y_ND of a complete expert-FFN call that keeps nothing for backward: `forward` (an expert-FFN forward op
    or its function) in the call's compute dtype, y back in x's dtype."""
    dtype = args[12]
    y_ND = forward(*in_compute_dtype(args[:11], dtype), False)[0]
    return y_ND if dtype is None else y_ND.to(args[0].dtype)


REBUILD = "moepass_rebuild"  # attribute of a weight operand the expert FFN's backward can rebuild


def rebuildable(weight: Tensor, rebuild: Callable[[], Tensor]) -> Tensor:
    """Mark an expert-FFN weight operand as rebuildable: the op's autograd keeps `rebuild` (a closure that
    returns the same values) instead of the tensor, and calls it in the backward. FSEP marks its restored
    experts so, and restores them again rather than keeping every layer's alive until the backward.
    Under AOT/torch.compile the mark is ignored and the tensor is kept (correct, more memory)."""
    setattr(weight, REBUILD, rebuild)
    return weight


WGRAD_SINK = "moepass_wgrad_sink"  # attribute of a weight operand whose gradient is computed later (Lancet)


class DeferredWeightGrads:
    """The weight gradients of one expert-FFN backward, computed on first demand (once)."""

    def __init__(self, compute: Callable[[], list[Tensor | None]]):
        self._compute: Callable[[], list[Tensor | None]] | None = compute
        self._grads: list[Tensor | None] | None = None

    @property
    def done(self) -> bool:
        return self._grads is not None

    def result(self) -> list[Tensor | None]:
        if self._grads is None:
            assert self._compute is not None
            self._grads, self._compute = self._compute(), None
        return self._grads


class WeightGradSink:
    """Lancet's split of an expert-FFN backward, seen from one weight operand.

    A weight operand carrying a sink (`setattr(w, WGRAD_SINK, sink)`, done by `moe_sched.defer_wgrad`,
    whose autograd node owns the sink) lets the expert FFN's backward return grad_x at once and leave
    the weight GEMMs pending here, handing that operand a stride-0 zero placeholder; the sink's own
    backward node then `take`s the real gradient (the weight GEMMs of the whole call run on the first
    take). So the gradient still reaches the weight once, through the same autograd edges, only later:
    when the autograd engine reaches the sink's node, which the schedule pass places (by forward
    order) between the dispatch-backward's issue and its wait. Only the exact torch path defers
    (`define_expert_ffn(split_backward=...)`); elsewhere the sink passes the gradient through."""

    def __init__(self) -> None:
        self.pending: DeferredWeightGrads | None = None
        self.slot = -1  # in the (w_gate, w_up, w_down, b_gate, b_up, b_down) order

    def defer(self, pending: DeferredWeightGrads, slot: int) -> None:
        self.pending, self.slot = pending, slot

    def take(self) -> Tensor | None:
        """The real gradient of this operand (None: nothing was deferred)."""
        if self.pending is None:
            return None
        grad = self.pending.result()[self.slot]
        self.pending = None
        return grad


def sinks_of(inputs: tuple | list) -> dict[int, WeightGradSink]:
    """{input index: sink} when every present weight/bias operand carries a sink, else {}."""
    sinks = {i: getattr(t, WGRAD_SINK, None) for i, t in enumerate(inputs) if i >= 2 and t is not None}
    return {i: sink for i, sink in sinks.items() if sink is not None} if all(sinks.values()) and sinks else {}


class ExpertFFNEagerOp(eager.EagerOp):
    """The expert FFN's eager call: by autograd over the experts' own tensors where `ffn_autograd` applies
    (separate expert tensors, run expert by expert), else the op's function and autograd.Function."""

    def __call__(self, *args: Any) -> Any:
        y = ffn_autograd.expert_ffn(*args)
        return super().__call__(*args) if y is None else y


def define_expert_ffn(qualname: str, forward_op: Any, backward_op: Any,
                      split_backward: Callable[..., tuple[Tensor, Callable[[], list[Tensor | None]]]] | None = None,
                      ) -> torch._ops.OpOverload:
    """Define an op with `moe.expert_ffn`'s schema whose autograd can keep intermediates.

    The op is what graphs show (one node, y_ND only). Underneath, autograd and AOT see two ops:
    `forward_op(*ffn_args, save) -> (y_ND, h_gate_NF, h_up_NF)` — the pre-activations when `save`,
    else empty tensors — and `backward_op(grad_y_ND, x_ND, h_gate_NF, h_up_NF, counts_E, weights...,
    biases..., options...) -> grads` in `FFN_DIFFERENTIABLE` order (empty for absent inputs), which
    recomputes the pre-activations it was not given. `recompute=True` on the op saves only the inputs
    (`Plan.expert_recompute`). A `custom_op`'s autograd hands `setup_context` the op's output only,
    so the op is defined with `torch.library` and an Autograd kernel of its own instead.

    `split_backward(same arguments as backward_op) -> (grad_x_ND, weight_grads)`, where
    `weight_grads()` returns the (w_gate, w_up, w_down, b_gate, b_up, b_down) gradients (None for absent
    ones), lets the backward defer the weight GEMMs to the operands' `WeightGradSink`s (Lancet); the
    same functions as `backward_op` runs, so the gradients are the same bit for bit.
    """
    namespace, name = qualname.split("::")
    lib = torch.library.Library(namespace, "FRAGMENT")
    _FFN_LIBS.append(lib)
    lib.define(name + EXPERT_FFN_SCHEMA.signature())
    ExpertFFN = expert_ffn_function(forward_op, backward_op, split_backward)

    def run(*args: Any) -> Tensor:  # no autograd: nothing to keep
        return forward_only(forward_op, complete(args))

    def autograd_kernel(*args: Any) -> Tensor:
        args = complete(args)
        if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args[:8]):
            return ExpertFFN.apply(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return run(*args)

    lib.impl(name, run, "CompositeExplicitAutograd")
    lib.impl(name, autograd_kernel, "Autograd")
    op = getattr(getattr(torch.ops, namespace), name).default
    # eagerly: the same autograd.Function over the forward/backward ops' own functions (`moepass.eager`)
    forward_fn, backward_fn = eager.function_of(forward_op), eager.function_of(backward_op)
    if forward_fn is not None and backward_fn is not None:
        eager.register(op, ExpertFFNEagerOp(op, lambda *args: forward_only(forward_fn, args),
                                            function=expert_ffn_function(forward_fn, backward_fn, split_backward)))

    def fake(x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate, b_up, b_down, activation, *rest):
        check_ffn_shapes(x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, activation)
        return x_ND.new_empty(x_ND.shape[0], w_down_EDF.shape[1])

    torch.library.register_fake(qualname, fake, lib=lib)
    if EXPERT_FFN_SCHEMA.autocast is not None:
        register_autocast(op, EXPERT_FFN_SCHEMA.autocast)
    return op


def expert_ffn_function(forward_op: Any, backward_op: Any,
                        split_backward: Callable[..., tuple[Tensor, Callable[[], list[Tensor | None]]]] | None,
                        ) -> type[torch.autograd.Function]:
    """The autograd.Function of an expert-FFN op over these forward / backward callables (see
    `define_expert_ffn`): the ops under the dispatcher and AOT, their functions eagerly."""

    class ExpertFFN(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):  # type: ignore[override]
            ctx.arity = len(args)  # the backward returns one gradient per argument given
            given, options = args[:8], args[8:11]
            recompute, dtype = complete(args)[11:]
            inputs = in_compute_dtype(given, dtype)
            y_ND, h_gate_NF, h_up_NF = forward_op(*inputs, *options, not recompute)
            ctx.present = [t is not None for t in inputs]
            ctx.dtypes = [None if t is None else t.dtype for t in given]  # each gradient's dtype
            ctx.rebuild = {i: rebuilt_in(getattr(t, REBUILD), dtype) for i, t in enumerate(given)
                           if i >= 2 and hasattr(t, REBUILD)}
            ctx.save_for_backward(h_gate_NF, h_up_NF, *[t for i, t in enumerate(inputs)
                                                        if t is not None and i not in ctx.rebuild])
            ctx.options = options
            ctx.sinks = sinks_of(given) if split_backward is not None else {}
            return y_ND if dtype is None else y_ND.to(given[0].dtype)

        @staticmethod
        def backward(ctx, grad_y_ND):  # type: ignore[override]
            h_gate_NF, h_up_NF, *saved = ctx.saved_tensors
            it = iter(saved)
            inputs = [ctx.rebuild[i]() if i in ctx.rebuild else next(it) if present else None
                      for i, present in enumerate(ctx.present)]
            x_ND = inputs[0]
            args = (grad_y_ND.to(x_ND.dtype), x_ND, h_gate_NF, h_up_NF, *inputs[1:], *ctx.options)
            result: list[Tensor | None] = [None] * 13
            dtypes = ctx.dtypes
            if ctx.sinks and not torch.is_grad_enabled():  # Lancet: grad_x now, weight GEMMs at the sinks
                assert split_backward is not None
                grad_x_ND, weight_grads = split_backward(*args)
                result[0] = grad_x_ND.to(dtypes[0])
                pending = DeferredWeightGrads(lambda: [g if g is None else g.to(d)
                                                       for g, d in zip(weight_grads(), dtypes[2:], strict=True)])
                for i, sink in ctx.sinks.items():
                    sink.defer(pending, i - 2)
                    result[i] = inputs[i].new_zeros((), dtype=dtypes[i]).expand(inputs[i].shape)  # placeholder: no memory
                return tuple(result[:ctx.arity])
            grads = backward_op(*args)
            for slot, i in enumerate(FFN_DIFFERENTIABLE):
                if inputs[i] is not None:
                    result[i] = grads[slot].to(dtypes[i])
            return tuple(result[:ctx.arity])

    return ExpertFFN


def rebuilt_in(rebuild: Callable[[], Tensor], dtype: torch.dtype | None) -> Callable[[], Tensor]:
    """A weight operand's rebuild closure (`rebuildable`), giving the operand as the op computes with it."""
    return rebuild if dtype is None else lambda: rebuild().to(dtype)


def saved_activations(x_ND: Tensor, w_gate_EFD: Tensor, gated: bool, save: bool) -> tuple[Tensor, Tensor]:
    """Fake (h_gate_NF, h_up_NF) of an expert-FFN forward op: [N, F] when kept, else empty. With fused
    gate/up (`w_gate` [E, 2F, D], no `w_up`) the first is the [N, 2F] pre-activation of both."""
    N, F_ = x_ND.shape[0], w_gate_EFD.shape[1]
    h_gate = x_ND.new_empty(N, F_) if save else x_ND.new_empty(0)
    return h_gate, (x_ND.new_empty(N, F_) if save and gated else x_ND.new_empty(0))


def kept(h_NF: Tensor, x_ND: Tensor) -> Tensor | None:
    """A saved pre-activation, or None where the forward kept nothing (the backward recomputes)."""
    return h_NF if h_NF.dim() == 2 and h_NF.shape[0] == x_ND.shape[0] else None


def ffn_gradient_fakes(
    x_ND: Tensor, w_gate_EFD: Tensor, w_up_EFD: Tensor | None, w_down_EDF: Tensor, b_gate_EF: Tensor | None,
    b_up_EF: Tensor | None, b_down_ED: Tensor | None, contiguous: bool,
) -> list[Tensor]:
    """Fake outputs of an expert-FFN backward op: one gradient per input in `FFN_DIFFERENTIABLE` order
    (empty for absent ones), contiguous or laid out as the torch path writes them (`gradient_like`)."""
    inputs = [x_ND, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED]
    like = (lambda t: t.new_empty(t.shape)) if contiguous else grouped_ffn.gradient_like
    return [x_ND.new_empty(0) if t is None else like(t) for t in inputs]


def _expert_ffn_forward(x_ND: Tensor, counts_E: Tensor, *rest: Any) -> tuple[Tensor, Tensor, Tensor]:
    """y_ND and, when `save`, the pre-activations h_gate_NF, h_up_NF (else empty tensors). The operands are
    `EXPERT_FFN_FORWARD_SCHEMA`'s: after x_ND and counts_E, the weights, biases and options of `FFN_WEIGHTS`
    (passed on to `grouped_ffn.forward` as they are), then `save`."""
    *weights_and_options, save = rest
    w_gate_EFD, w_up_EFD, w_down_EDF, _, _, _, activation, _, _ = weights_and_options
    check_ffn_shapes(x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, activation)
    y_ND, h_gate, h_up = grouped_ffn.forward(x_ND, counts_E, *weights_and_options)
    if not save:
        return y_ND, x_ND.new_empty(0), x_ND.new_empty(0)
    return y_ND, h_gate, x_ND.new_empty(0) if h_up is None else h_up


def _expert_ffn_forward_fake(x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, activation, clamp_limit,
      alpha, save):
    check_ffn_shapes(x_ND, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, activation)
    return (x_ND.new_empty(x_ND.shape[0], w_down_EDF.shape[1]),
            *saved_activations(x_ND, w_gate_EFD, w_up_EFD is not None, save))


EXPERT_FFN_FORWARD_SCHEMA = OpSchema("expert_ffn_forward", FFN_ARGS + ", bool save", "(Tensor, Tensor, Tensor)",
                                     fake=_expert_ffn_forward_fake, autocast="compute")
expert_ffn_forward = EXPERT_FFN_FORWARD_SCHEMA.define("moe", _expert_ffn_forward)


def _expert_ffn_backward(grad_y_ND: Tensor, x_ND: Tensor, h_gate_NF: Tensor, h_up_NF: Tensor, *rest: Any,
                         ) -> list[Tensor]:
    """Backward of `expert_ffn` (`rest`: counts_E and `FFN_WEIGHTS`' weights, biases and options, passed on to
    `grouped_ffn.backward`); absent optional inputs get an empty tensor in their slot."""
    grads = grouped_ffn.backward(grad_y_ND, x_ND, kept(h_gate_NF, x_ND), kept(h_up_NF, x_ND), *rest)
    return [x_ND.new_empty(0) if g is None else g for g in grads]


def _expert_ffn_backward_fake(grad_y_ND, x_ND, h_gate_NF, h_up_NF, counts_E, *weights_and_options):
    return ffn_gradient_fakes(x_ND, *weights_and_options[:6], contiguous=False)


EXPERT_FFN_BACKWARD_SCHEMA = OpSchema(
    "expert_ffn_backward", "Tensor grad_y_ND, Tensor x_ND, Tensor h_gate_NF, Tensor h_up_NF, " + FFN_WEIGHTS,
    "Tensor[]", fake=_expert_ffn_backward_fake)
expert_ffn_backward = EXPERT_FFN_BACKWARD_SCHEMA.define("moe", _expert_ffn_backward)


def expert_ffn_split_backward(grad_y_ND: Tensor, x_ND: Tensor, h_gate_NF: Tensor, h_up_NF: Tensor, *rest: Any,
                              ) -> tuple[Tensor, Callable[[], list[Tensor | None]]]:
    """`expert_ffn_backward` in two steps (Lancet): grad_x_ND now, the weight gradients on demand."""
    grad_x_ND, work = grouped_ffn.backward_input(grad_y_ND, x_ND, kept(h_gate_NF, x_ND), kept(h_up_NF, x_ND), *rest)
    return grad_x_ND, functools.partial(grouped_ffn.backward_weights, work)


expert_ffn = define_expert_ffn("moe::expert_ffn", torch.ops.moe.expert_ffn_forward,
                               torch.ops.moe.expert_ffn_backward, expert_ffn_split_backward)
