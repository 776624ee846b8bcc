"""Generic experts: the user's own expert function run over the token groups, for experts that are not a
known FFN (`ExpertsSpec.kind == "generic"`).

Detection accepts ModuleList / ModuleDict experts of one structure (same class, same tensor names and
shapes) whose function is not one `moe.expert_ffn` computes (a norm inside, a residual, an extra
elementwise op). The graph then calls `run_experts` where it would call the expert FFN:

    y_ND = run_experts(x_ND, counts_E, template, names, *stacked_E)

`x_ND` are the rows sorted by expert (as `moe.permute` gives them, `counts_E` rows each), `template` one
expert module deep-copied with every parameter and buffer removed (`stateless_template`: it holds no
state, so it is neither trained nor saved), and `stacked_E[i]` the `[E, ...]` stack of tensor `names[i]`
over the experts (read like the FFN weights: `canonical.stack_experts`, or the local shard under EP).
Expert e runs as `torch.func.functional_call(template, {name: stacked[e]}, rows_e)`.

Why an autograd.Function around it: slicing `stacked[e]` under autograd gives each expert a full-size
`[E, ...]` zero-filled gradient (the select backward), E of them per tensor and step. Here every expert
runs on detached slices (leaves of its own small graph); the backward asks each expert's graph for the
gradients of its slices and writes them into one `[E, ...]` gradient per tensor: one allocation per
tensor and step, as the FFN path, and no full-size zero fill (only experts with no rows, which are not
called, get their slice zeroed).

Reading the per-expert row counts is a host sync (one per block and step, as ragged groups need). Under
fake tensors (shape propagation) the counts are unknown: the template runs once on all rows with
expert 0's tensors, which gives the output's shape and dtype.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, fx, nn

TEMPLATE = "expert_template"  # the rewritten block's attribute holding the stateless template


def stateless_template(expert: nn.Module) -> nn.Module:
    """A deep copy of `expert` without its parameters and buffers (functional_call supplies them): their names
    stay, their values are None (what an absent bias already is), and no tensor is copied on the way."""
    tensors = [*expert.parameters(), *expert.buffers()]
    return copy.deepcopy(expert, memo={id(t): None for t in tensors})


def _call(template: nn.Module, names: Sequence[str], tensors: Sequence[Tensor], rows: Tensor) -> Tensor:
    return torch.func.functional_call(template, dict(zip(names, tensors, strict=True)), (rows,))


class _GenericExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, counts_E, template, names, grad_enabled, *stacked_E):  # type: ignore[override]
        needs = [grad_enabled and n for n in ctx.needs_input_grad]  # forward runs under no_grad: the caller's mode
        counts = counts_E.tolist()
        ctx.groups = []  # (expert, start, end, input leaf, tensor leaves, output) of every expert with rows
        y_ND, start = x_ND.new_empty(x_ND.shape), 0
        with torch.enable_grad():
            for e, count in enumerate(counts):
                if count == 0:
                    continue
                rows = x_ND[start:start + count].detach().requires_grad_(needs[0])
                leaves = [s.detach()[e].requires_grad_(needs[5 + i] and s.is_floating_point())
                          for i, s in enumerate(stacked_E)]
                y = _call(template, names, leaves, rows)
                if y.shape != rows.shape:
                    raise ValueError(f"a generic expert returned shape {tuple(y.shape)} for rows of shape "
                                     f"{tuple(rows.shape)}: an expert must map [n, D] rows to [n, D].")
                ctx.groups.append((e, start, start + count, rows, leaves, y))
                y_ND[start:start + count] = y.detach()
                start += count
        y_ND[start:].zero_()  # rows past the counted ones (none when the counts cover every row)
        ctx.shapes = (x_ND.shape, [(s.shape, s.dtype) for s in stacked_E])
        return y_ND

    @staticmethod
    def backward(ctx, grad_ND):  # type: ignore[override]
        if ctx.groups is None:
            raise RuntimeError("generic experts: backward through the same forward twice; the experts' graphs are "
                               "freed after the first backward, as autograd frees every graph without retain_graph.")
        x_shape, tensor_shapes = ctx.shapes
        needs = ctx.needs_input_grad
        # uninitialised: every expert's slice is written once below (zeros where it has no rows or no gradient)
        grad_x = grad_ND.new_empty(x_shape) if needs[0] else None
        grads_E = [torch.empty(shape, dtype=dtype, device=grad_ND.device) if needs[5 + i] else None
                   for i, (shape, dtype) in enumerate(tensor_shapes)]
        done, end = set(), 0
        for e, start, end, rows, leaves, y in ctx.groups:
            wanted = [t for t in (rows, *leaves) if t.requires_grad]
            got = torch.autograd.grad(y, wanted, grad_ND[start:end], allow_unused=True) if y.requires_grad else ()
            by_leaf = dict(zip(map(id, wanted), got))
            if grad_x is not None:
                _put(grad_x[start:end], by_leaf.get(id(rows)))
            for grad_E, leaf in zip(grads_E, leaves):
                if grad_E is not None:
                    _put(grad_E[e], by_leaf.get(id(leaf)))
            done.add(e)
        if grad_x is not None:
            grad_x[end:].zero_()  # rows past the counted ones (none when the counts cover every row)
        for grad_E in grads_E:
            for e in range(grad_E.shape[0] if grad_E is not None else 0):
                if e not in done:
                    grad_E[e].zero_()  # type: ignore[index]
        ctx.groups = None  # the experts' graphs are freed: a second backward raises (above), never returns zeros
        return (grad_x, None, None, None, None, *grads_E)


def _put(slot: Tensor, grad: Tensor | None) -> None:
    if grad is None:
        slot.zero_()
    else:
        slot.copy_(grad)


def run_experts(x_ND: Tensor, counts_E: Tensor, template: nn.Module, names: tuple[str, ...],
                *stacked_E: Tensor) -> Tensor:
    """Every expert's function on its rows (see the module doc): y_ND, row for row."""
    if isinstance(x_ND, fx.Proxy):  # FX re-tracing the generated code (unpickling): stay one node
        return x_ND.tracer.create_proxy("call_function", run_experts, (x_ND, counts_E, template, names, *stacked_E), {})
    if len(names) != len(stacked_E):
        raise ValueError(f"run_experts got {len(stacked_E)} stacked tensors for names {list(names)}: pass one each.")
    if isinstance(counts_E, torch._subclasses.FakeTensor):  # shape propagation: the counts are unknown
        return _call(template, names, [s[0] for s in stacked_E], x_ND)
    return _GenericExperts.apply(x_ND, counts_E, template, names, torch.is_grad_enabled(), *stacked_E)
