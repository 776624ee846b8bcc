"""The expert FFN over expert-sorted rows, in torch: grouped GEMMs, every gradient written once.

This is what `moe.expert_ffn` runs when it is not lowered to Triton (the torch path, any device).
`moepass.dialect.expert_ffn_ref` stays the semantics (its gradients: autograd through it); this file is the
fast implementation of the same function:

    forward   h_gate_NF = x_ND @ w_gate[e]^T (+ b_gate[e])      one grouped GEMM (two when gated)
              h_up_NF   = x_ND @ w_up[e]^T   (+ b_up[e])
              y_ND      = act(h_gate, h_up) @ w_down[e]^T (+ b_down[e])
    backward  grad_a_NF   = grad_y_ND @ w_down[e]                 (rows)
              grad_w_down = grad_y[rows_e]^T @ a[rows_e]           (weight gradient, [E, D, F] at once)
              grad_gate, grad_up = act'(grad_a, h_gate, h_up)
              grad_w_gate/up = grad_gate/up[rows_e]^T @ x[rows_e]
              grad_x_ND   = grad_gate @ w_gate[e] + grad_up @ w_up[e]

The backward is two steps, `backward_input` (grad_x: the 3 GEMMs the all-to-all backward waits
for) then `backward_weights` (the weight-gradient GEMMs), so a caller can send grad_x on before the
weight GEMMs run (Lancet; `moepass.dialect.define_expert_ffn`); `backward` runs both.

Every weight gradient is one `[E, ...]` tensor written once by a grouped GEMM (or expert slice by
expert slice into one `empty` buffer): no per-expert full-size gradient is ever allocated, zeroed or
summed, which is what slicing `w[e]` under autograd costs (O(E^2) memory traffic). In host memory a
gradient of `GRAD_BUFFER_BYTES` or more is written into a buffer reused from step to step while nothing
else holds it (`reusable_grad_buffer`: fresh pages cost a page fault each).

Saved for backward: the inputs and the pre-activations h_gate, h_up (2·N·F elements), so the
backward runs 6 GEMMs (gated; 4 otherwise) instead of recomputing 2 of the forward's 3.
`Plan(expert_recompute=True)` keeps only the inputs and recomputes h_gate/h_up in the backward: 2·N·F
fewer elements alive between forward and backward for 2/3 more forward GEMM work (gated), the
trade `cost_model.ep.compute_time(recompute=1)` prices. The activation output a = act(h_gate, h_up)
is recomputed from the saved pre-activations (elementwise, cheap) rather than kept; ReLU's forward keeps
relu(h) in h's place, which serves the backward as h does (`activation_output`), so nothing is recomputed.

Expert by expert (`Rows.per_expert`, the first choice): where the row counts are in host memory (a CPU;
reading them waits for nothing), the whole FFN runs one expert at a time — its GEMMs, activation and, in the
backward, its input and weight gradients — so an expert's [n, F] intermediates are still in cache when the next
op reads them, and its bias is summed inside the GEMM (`addmm`, not gathered per row). Run eagerly on separate expert
tensors (ModuleList experts), the per-expert loop is autograd's own instead (`moepass.ffn_autograd`).

Otherwise the GEMM engine, per GEMM: a small one (E·N·K·Q <= `PADDED_MACS`: the layer's host overhead outweighs its
arithmetic; off by default, `PADDED_MACS = 0`: its batched GEMM sums in another order than a per-expert
one, and a gradient of the detection zoo then lands 1.2e-6 off its reference, over the 1e-6 the parity tests
hold; set it to 2**18 to trade that for fewer ops on tiny layers) runs *padded*: the rows scattered into a zero `[E, N, K]` buffer (each expert's rows first, at
most N of them), one `torch.bmm`, the rows gathered back — a few ops whatever E and no host read (the
grouped GEMM below costs ~13 ops per expert on CPU, the loop a host sync). One GEMM per expert over its
rows, as the other engines, so one expert equals a dense MLP bit for bit
(`tests/test_compile_parity.py`). Otherwise `torch._grouped_mm` (one kernel
for all experts, row groups given by `offs = cumsum(counts_E)` on the device: no host sync) where it runs —
CPU in fp32/bf16/fp16 and CUDA in bf16 on sm_90+, each with 16-byte aligned strides (`grouped_mm_ok`) —,
else a loop over experts writing into preallocated outputs (`torch.mm(out=...)`), which reads `counts_E`
on the host once per call. All three compute the same products; rows past an expert's count are zeros,
which add nothing to a weight gradient. (On a CPU, `torch._grouped_mm` is itself a loop over the groups,
~13 dispatcher ops and one `.item()` of host memory each, no device sync; the Python loop computes the same
bits with fewer ops but costs more host time at small sizes — 0.27 ms against 0.11 ms for six GEMMs over 8
experts of 2 rows, equal at 512 rows — so `_grouped_mm` is the CPU engine below `PER_EXPERT_ELEMENTS`.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moepass.activations import GATED_ACTIVATIONS, activate, activate_and_backward
from moepass.process_state import GRAD_BUFFERS, GRAD_BUFFERS_LOCK

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PADDED_MACS = 0  # the small engine's bound (module doc): off
GRAD_BUFFER_BYTES = 1 << 20  # weight gradients at least this large reuse a buffer (`reusable_grad_buffer`)
PER_EXPERT_ELEMENTS = 1 << 16  # the smallest [N, F] run expert by expert (`Rows.per_expert`); tests move it


def fused_gate_up(w_up: Tensor | None, activation: str) -> bool:
    """A gated activation without `w_up`: `w_gate` holds gate and up as one `[E, 2F, D]` tensor (gate
    rows first, as Hugging Face's `gate_up_proj`): one GEMM computes both pre-activations, one gives
    their weight gradient, and the caller's parameter gets it without a chunk backward."""
    return w_up is None and activation in GATED_ACTIVATIONS


def halves(h_gate: Tensor, h_up: Tensor | None, fused: bool) -> tuple[Tensor, Tensor | None]:
    """(gate, up) pre-activations: the two column halves of a fused [N, 2F] one, else as given."""
    if not fused:
        return h_gate, h_up
    F = h_gate.shape[-1] // 2
    return h_gate[:, :F], h_gate[:, F:]


def grouped_mm_ok(*mats: Tensor) -> bool:
    """Whether `torch._grouped_mm` runs these operands (as laid out) on their device."""
    first = mats[0]
    if first.device.type == "cpu":
        if first.dtype not in GROUPED_MM_DTYPES:
            return False
    elif first.device.type == "cuda":
        # The documented fast path (CUTLASS, sm_90+, bf16); other CUDA cases take the expert loop.
        if first.dtype != torch.bfloat16 or torch.cuda.get_device_capability(first.device) < (9, 0):
            return False
    else:
        return False
    step = 16 // first.element_size()  # 16-byte aligned: strides in elements, the address in bytes
    for m in mats:
        if m.dtype != first.dtype or m.data_ptr() % 16:
            return False
        row, col = m.stride()[-2:]
        if not ((row == 1 or col == 1) and (row == 1 or row % step == 0) and (col == 1 or col % step == 0)):
            return False
    return True


def offsets(counts_E: Tensor) -> Tensor:
    """Row group ends for `torch._grouped_mm` (int32, on the counts' device)."""
    return torch.cumsum(counts_E, 0, dtype=torch.int32)


def split_sizes(counts_E: Tensor) -> list[int]:
    """Host sync point: rows per expert as Python ints (one device->host copy)."""
    return [int(c) for c in counts_E.tolist()]


def row_experts(counts_E: Tensor, rows: int) -> Tensor:
    """Expert of each sorted row, on the device (no host sync: `rows` is known statically)."""
    return torch.repeat_interleave(torch.arange(counts_E.shape[0], device=counts_E.device), counts_E,
                                   output_size=rows)


class Rows:
    """The row grouping of one call: grouped GEMMs over experts, with a per-expert loop fallback."""

    def __init__(self, counts_E: Tensor, rows: int):
        self.counts_E = counts_E
        self.rows = rows
        self._offs: Tensor | None = None
        self._sizes: list[int] | None = None
        self._experts: Tensor | None = None
        self._slots: Tensor | None = None
        self._padded: tuple[Tensor, Tensor] | None = None  # the last tensor `pad` was given, and its padding

    def per_expert(self, D: int, F: int) -> bool:
        """Whether the whole FFN runs expert by expert (`forward_per_expert`): the row counts are in host memory,
        so reading them waits for nothing, and the [N, F] intermediates are large enough (`PER_EXPERT_ELEMENTS`)
        for cache misses to cost more than the loop's host time (~0.2 ms a step over 8 experts: smaller layers
        keep the grouped engines)."""
        return (self.counts_E.device.type == "cpu" and self.rows * F >= PER_EXPERT_ELEMENTS
                and not self.small(D, F))

    @property
    def spans(self) -> list[tuple[int, slice]]:
        """(expert, its rows) for every expert with rows, in order (the counts read on the host)."""
        spans, start = [], 0
        for e, n in enumerate(self.sizes):
            if n:
                spans.append((e, slice(start, start + n)))
            start += n
        return spans

    def zero_tail(self, out_Nq: Tensor) -> None:
        """Rows past the last expert's (no expert computes them) set to zero, as the grouped engines leave them."""
        total = sum(self.sizes)
        if total < self.rows:
            out_Nq[total:].zero_()

    def small(self, k: int, q: int) -> bool:
        """Whether a GEMM with reduction k and q output columns runs padded (`PADDED_MACS`)."""
        return self.counts_E.shape[0] * self.rows * k * q <= PADDED_MACS

    @property
    def slots(self) -> Tensor:
        """Each sorted row's place in an `[E, N]` padding: expert * N + its rank among the expert's rows."""
        if self._slots is None:
            starts_E = torch.cumsum(self.counts_E, 0) - self.counts_E
            experts_N = self.experts
            self._slots = (experts_N * self.rows + torch.arange(self.rows, device=experts_N.device)
                           - starts_E.index_select(0, experts_N))
        return self._slots

    def pad(self, a_Np: Tensor) -> Tensor:
        """a_Np's rows in a zero `[E, N, K]` buffer, expert e's first (no host read)."""
        if self._padded is not None and self._padded[0] is a_Np:
            return self._padded[1]
        E, N, K = self.counts_E.shape[0], self.rows, a_Np.shape[1]
        padded_ENK = a_Np.new_zeros(E * N, K).index_copy_(0, self.slots, a_Np).view(E, N, K)
        self._padded = (a_Np, padded_ENK)
        return padded_ENK

    @property
    def offs(self) -> Tensor:
        if self._offs is None:
            self._offs = offsets(self.counts_E)
        return self._offs

    @property
    def sizes(self) -> list[int]:
        """Host sync point of the fallback: rows per expert as Python ints."""
        if self._sizes is None:
            self._sizes = split_sizes(self.counts_E)
        return self._sizes

    def mm(self, a_Np: Tensor, b_Epq: Tensor) -> Tensor:
        """out_Nq[rows_e] = a_Np[rows_e] @ b_Epq[e]."""
        if self.small(a_Np.shape[1], b_Epq.shape[-1]):
            out_ENq = torch.bmm(self.pad(a_Np), b_Epq)
            return out_ENq.view(-1, out_ENq.shape[-1]).index_select(0, self.slots)
        if grouped_mm_ok(a_Np, b_Epq):
            return torch._grouped_mm(a_Np, b_Epq, offs=self.offs)
        out_Nq = a_Np.new_empty(a_Np.shape[0], b_Epq.shape[-1])
        start = 0
        for e, n in enumerate(self.sizes):
            if n:
                torch.mm(a_Np[start:start + n], b_Epq[e], out=out_Nq[start:start + n])
            start += n
        return out_Nq

    def wgrad(self, a_Np: Tensor, b_Nq: Tensor, out_Epq: Tensor | None = None) -> Tensor:
        """out_Epq[e] = a_Np[rows_e]^T @ b_Nq[rows_e]; zero for experts without rows. Given `out_Epq` (a
        host-memory buffer from `reusable_grad_buffer`), the expert loop writes into it: the same `mm` per
        expert as CPU `torch._grouped_mm`, which has no `out=`, and the row counts read from host memory."""
        a_pN = a_Np.t()
        if out_Epq is None:
            if self.small(a_Np.shape[1], b_Nq.shape[1]):
                return torch.bmm(self.pad(a_Np).transpose(1, 2), self.pad(b_Nq))
            if grouped_mm_ok(a_pN, b_Nq):
                return torch._grouped_mm(a_pN, b_Nq, offs=self.offs)
            out_Epq = a_Np.new_empty(len(self.sizes), a_Np.shape[1], b_Nq.shape[1])
        start = 0
        for e, n in enumerate(self.sizes):
            if n:
                torch.mm(a_pN[:, start:start + n], b_Nq[start:start + n], out=out_Epq[e])
            else:
                out_Epq[e].zero_()
            start += n
        return out_Epq

    def add_bias(self, h_Nq: Tensor, b_Eq: Tensor | None) -> Tensor:
        if b_Eq is None:
            return h_Nq
        return h_Nq.add_(b_Eq.index_select(0, self.experts))

    def bias_grad(self, g_Nq: Tensor, like_Eq: Tensor | None) -> Tensor | None:
        """Per-expert column sums of g (the gradient of a per-expert bias)."""
        if like_Eq is None:
            return None
        return g_Nq.new_zeros(like_Eq.shape).index_add_(0, self.experts, g_Nq)

    @property
    def experts(self) -> Tensor:
        if self._experts is None:
            self._experts = row_experts(self.counts_E, self.rows)
        return self._experts


def transposed(w: Tensor) -> bool:
    """A weight read as a transposed view of a contiguous tensor (e.g. a `[E, F, D]` parameter read as `[E, D, F]`)."""
    return not w.is_contiguous() and w.transpose(-2, -1).is_contiguous()


def gradient_like(w: Tensor) -> Tensor:
    """An empty tensor laid out as `backward` returns the gradient of `w` (for fake implementations)."""
    return torch.empty_like(w) if transposed(w) else w.new_empty(w.shape)


def storage_use_count(t: Tensor) -> int:
    """How many tensors (views included) and storage objects hold `t`'s memory."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def reusable_grad_buffer(w: Tensor, shape: tuple[int, ...]) -> Tensor | None:
    """A `shape` buffer for the gradient of expert weight `w`, the same memory step after step while nothing
    else holds it; None where it does not pay (the caller allocates).

    Each step's weight gradient is a fresh `[E, ...]` tensor of the whole expert weight (4 MiB at the layer
    case): glibc serves allocations that large with fresh pages and gives them back to the OS when they are
    freed (its mmap and trim thresholds), so every step pays a page fault per 4 KiB of gradient (~3,000 per
    step on the layer case), where the original module's per-expert gradients come from malloc's free lists.
    A CUDA caching allocator never gives memory back, so only host memory takes this path.

    The buffer is kept per weight storage (dropped with the weight) and handed out as a view; it is handed out
    again only when its storage has no holder but the buffer itself (`storage_use_count`): autograd consumed
    the gradient (`p.grad += g`), or the parameter that took it as its `.grad` let it go
    (`zero_grad(set_to_none=True)`). Anything still holding it — a `.grad` that is the buffer, a gradient a
    caller kept, a second call of the block in the same backward — makes this allocate a new one instead, so
    no gradient anyone can see is ever overwritten."""
    itemsize = w.element_size()
    if type(w) not in (Tensor, nn.Parameter) or w.device.type != "cpu" or w.is_meta:
        return None
    numel = 1
    for n in shape:
        numel *= n
    if numel * itemsize < GRAD_BUFFER_BYTES:
        return None
    key = (w.storage_offset(), tuple(shape), w.dtype)
    with GRAD_BUFFERS_LOCK:
        buffers = GRAD_BUFFERS.setdefault(w.untyped_storage(), {})
        found = buffers.get(key)
        if found is None or storage_use_count(found[0]) > found[1]:
            buffer = w.new_empty(shape)
            found = buffers[key] = (buffer, storage_use_count(buffer))
        return found[0].view(shape)  # a view: whoever keeps it keeps the storage busy


def weight_grad(rows: Rows, a_Np: Tensor, b_Nq: Tensor, w_Epq: Tensor) -> Tensor:
    """`rows.wgrad(a, b)` in the layout of `w`: a transposed-view weight gets the transpose of a
    contiguous `[E, Q, P]` result, so autograd hands the parameter a contiguous gradient (no copy). Large
    host-memory gradients are written into a reused buffer (`reusable_grad_buffer`)."""
    E, P, Q = w_Epq.shape
    if transposed(w_Epq):
        return rows.wgrad(b_Nq, a_Np, reusable_grad_buffer(w_Epq, (E, Q, P))).transpose(-2, -1)
    return rows.wgrad(a_Np, b_Nq, reusable_grad_buffer(w_Epq, (E, P, Q)))


OUTPUT_KEPT = ("relu",)  # activations whose output the forward keeps in place of their input (`activation_output`)


def activation_output(h_gate: Tensor, h_up: Tensor | None, activation: str, clamp_limit: float, alpha: float,
                      fused: bool) -> Tensor:
    """a = act(gate) [* up], the down projection's input. ReLU is applied in place: the forward then keeps relu(h)
    where it kept h, which the backward reads as it reads h (relu(relu(h)) = relu(h), and relu(h) > 0 exactly
    where h > 0: the same values), as `F.relu`'s own autograd keeps its output: no [N, F] buffer made for `a` in
    the forward nor recomputed in the backward."""
    if activation in OUTPUT_KEPT:
        return h_gate.relu_()
    return activate(*halves(h_gate, h_up, fused), activation, clamp_limit, alpha)


def activation_grads(grad_a: Tensor, h_gate: Tensor, h_up: Tensor | None, activation: str, clamp_limit: float,
                     alpha: float, fused: bool, recomputed: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """(a, grad_gate, grad_up) from the activation's input gradient `grad_a` and the kept (or, `recomputed`, just
    recomputed: ours to overwrite) pre-activations; with fused gate/up one [n, 2F] gradient, gate columns first,
    and grad_up None. ReLU: `a` is the kept relu(h) (`activation_output`), its gradient written over grad_a."""
    if activation in OUTPUT_KEPT:
        a = h_gate.relu_() if recomputed else h_gate
        return a, torch.ops.aten.threshold_backward.grad_input(grad_a, a, 0, grad_input=grad_a), None
    if fused:  # one gradient for the one [2F, D] weight, its halves written in place
        grad_gate_up = h_gate.new_empty(h_gate.shape)
        a, _, _ = activate_and_backward(grad_a, *halves(h_gate, h_up, fused), activation, clamp_limit, alpha,
                                        *halves(grad_gate_up, None, fused))
        return a, grad_gate_up, None
    return activate_and_backward(grad_a, h_gate, h_up, activation, clamp_limit, alpha)


def pre_activations(
    rows: Rows, x_ND: Tensor, w_gate_EFD: Tensor, w_up_EFD: Tensor | None, b_gate_EF: Tensor | None,
    b_up_EF: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    h_gate = rows.add_bias(rows.mm(x_ND, w_gate_EFD.transpose(-2, -1)), b_gate_EF)
    h_up = None if w_up_EFD is None else rows.add_bias(rows.mm(x_ND, w_up_EFD.transpose(-2, -1)), b_up_EF)
    return h_gate, h_up


def forward(
    x_ND: Tensor, counts_E: Tensor, w_gate_EFD: Tensor, w_up_EFD: Tensor | None, w_down_EDF: Tensor,
    b_gate_EF: Tensor | None, b_up_EF: Tensor | None, b_down_ED: Tensor | None, activation: str,
    clamp_limit: float, alpha: float,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """y_ND and the pre-activations the backward can reuse: (h_gate_NF, h_up_NF or None), or with
    fused gate/up (see `fused_gate_up`) the one [N, 2F] pre-activation and None."""
    rows = Rows(counts_E, x_ND.shape[0])
    x_ND = x_ND.contiguous()
    if rows.per_expert(x_ND.shape[1], w_down_EDF.shape[2]):
        return forward_per_expert(rows, x_ND, (w_gate_EFD, w_up_EFD, w_down_EDF), (b_gate_EF, b_up_EF, b_down_ED),
                                  activation, clamp_limit, alpha)
    h_gate, h_up = pre_activations(rows, x_ND, w_gate_EFD, w_up_EFD, b_gate_EF, b_up_EF)
    a_NF = activation_output(h_gate, h_up, activation, clamp_limit, alpha, fused_gate_up(w_up_EFD, activation))
    y_ND = rows.add_bias(rows.mm(a_NF, w_down_EDF.transpose(-2, -1)), b_down_ED)
    return y_ND, h_gate, h_up


@dataclass
class WeightGradInputs:
    """What the weight gradients of one backward need once the input gradient is done (`backward_input`):
    the row grouping, the output gradient, the activation and the pre-activation gradients."""

    rows: Rows
    x_ND: Tensor
    grad_y_ND: Tensor
    a_NF: Tensor | None  # None when run expert by expert: `experts` holds them
    grad_gate: Tensor | None  # [N, F] (with fused gate/up: [N, 2F], gate columns first)
    grad_up: Tensor | None
    weights: tuple[Tensor, Tensor | None, Tensor]  # w_gate_EFD, w_up_EFD, w_down_EDF
    biases: tuple[Tensor | None, Tensor | None, Tensor | None]  # b_gate_EF, b_up_EF, b_down_ED
    experts: list[ExpertGrads] | None = None  # expert by expert (`Rows.per_expert`): each expert's own


def backward_input(
    grad_y_ND: Tensor, x_ND: Tensor, h_gate_NF: Tensor | None, h_up_NF: Tensor | None, counts_E: Tensor,
    w_gate_EFD: Tensor, w_up_EFD: Tensor | None, w_down_EDF: Tensor, b_gate_EF: Tensor | None,
    b_up_EF: Tensor | None, b_down_ED: Tensor | None, activation: str, clamp_limit: float, alpha: float,
) -> tuple[Tensor, WeightGradInputs]:
    """The input gradient grad_x_ND first, and what `backward_weights` needs for the rest (Lancet: the
    caller can send grad_x on before the weight GEMMs). `h_gate_NF is None`: the pre-activations are
    recomputed."""
    rows = Rows(counts_E, x_ND.shape[0])
    x_ND, grad_y_ND = x_ND.contiguous(), grad_y_ND.contiguous()  # an expanded (stride-0) grad is legal
    weights, biases = (w_gate_EFD, w_up_EFD, w_down_EDF), (b_gate_EF, b_up_EF, b_down_ED)
    if rows.per_expert(x_ND.shape[1], w_down_EDF.shape[2]):
        grad_x_ND, experts = backward_per_expert(rows, grad_y_ND, x_ND, h_gate_NF, h_up_NF, weights, biases,
                                                 activation, clamp_limit, alpha, None)
        return grad_x_ND, WeightGradInputs(rows, x_ND, grad_y_ND, None, None, None, weights, biases, experts)
    recomputed = h_gate_NF is None
    if h_gate_NF is None:
        h_gate_NF, h_up_NF = pre_activations(rows, x_ND, w_gate_EFD, w_up_EFD, b_gate_EF, b_up_EF)
    a_NF, grad_gate, grad_up = activation_grads(rows.mm(grad_y_ND, w_down_EDF), h_gate_NF, h_up_NF, activation,
                                                clamp_limit, alpha, fused_gate_up(w_up_EFD, activation), recomputed)
    grad_gate, grad_up = grad_gate.contiguous(), None if grad_up is None else grad_up.contiguous()
    grad_x_ND = rows.mm(grad_gate, w_gate_EFD)
    if grad_up is not None:
        assert w_up_EFD is not None
        grad_x_ND += rows.mm(grad_up, w_up_EFD)
    return grad_x_ND, WeightGradInputs(rows, x_ND, grad_y_ND, a_NF, grad_gate, grad_up,
                                       (w_gate_EFD, w_up_EFD, w_down_EDF), (b_gate_EF, b_up_EF, b_down_ED))


def backward_weights(work: WeightGradInputs) -> list[Tensor | None]:
    """Gradients for (w_gate, w_up, w_down, b_gate, b_up, b_down) from `backward_input`'s leftovers."""
    if work.experts is not None:
        grads = gradient_buffers(work.rows, work.weights, work.biases)
        for expert in work.experts:
            expert_weight_grads(expert, work.grad_y_ND, work.x_ND, grads)
        return list(grads)
    assert work.a_NF is not None and work.grad_gate is not None
    rows, (w_gate_EFD, w_up_EFD, w_down_EDF), (b_gate_EF, b_up_EF, b_down_ED) = work.rows, work.weights, work.biases
    grad_w_down = weight_grad(rows, work.grad_y_ND, work.a_NF, w_down_EDF)
    grad_b_down = rows.bias_grad(work.grad_y_ND, b_down_ED)
    grad_w_gate = weight_grad(rows, work.grad_gate, work.x_ND, w_gate_EFD)
    grad_b_gate = rows.bias_grad(work.grad_gate, b_gate_EF)
    grad_w_up = grad_b_up = None
    if work.grad_up is not None:
        assert w_up_EFD is not None
        grad_w_up = weight_grad(rows, work.grad_up, work.x_ND, w_up_EFD)
        grad_b_up = rows.bias_grad(work.grad_up, b_up_EF)
    return [grad_w_gate, grad_w_up, grad_w_down, grad_b_gate, grad_b_up, grad_b_down]


def backward(
    grad_y_ND: Tensor, x_ND: Tensor, h_gate_NF: Tensor | None, h_up_NF: Tensor | None, counts_E: Tensor,
    w_gate_EFD: Tensor, w_up_EFD: Tensor | None, w_down_EDF: Tensor, b_gate_EF: Tensor | None,
    b_up_EF: Tensor | None, b_down_ED: Tensor | None, activation: str, clamp_limit: float, alpha: float,
) -> list[Tensor | None]:
    """Gradients for (x, w_gate, w_up, w_down, b_gate, b_up, b_down); None for absent inputs.

    `h_gate_NF is None` means the forward kept only its inputs: the pre-activations are recomputed.
    """
    rows = Rows(counts_E, x_ND.shape[0])
    if rows.per_expert(x_ND.shape[1], w_down_EDF.shape[2]):  # each expert's input and weight gradients in turn
        weights, biases = (w_gate_EFD, w_up_EFD, w_down_EDF), (b_gate_EF, b_up_EF, b_down_ED)
        grads = gradient_buffers(rows, weights, biases)
        grad_x_ND, _ = backward_per_expert(rows, grad_y_ND.contiguous(), x_ND.contiguous(), h_gate_NF, h_up_NF,
                                           weights, biases, activation, clamp_limit, alpha, grads)
        return [grad_x_ND, *grads]
    grad_x_ND, work = backward_input(grad_y_ND, x_ND, h_gate_NF, h_up_NF, counts_E, w_gate_EFD, w_up_EFD,
                                     w_down_EDF, b_gate_EF, b_up_EF, b_down_ED, activation, clamp_limit, alpha)
    return [grad_x_ND, *backward_weights(work)]


# ----------------------------------------------------------------------------------------------
# Expert by expert (`Rows.per_expert`): the row counts in host memory, each expert's GEMMs and activation run
# on its own rows in turn, so an expert's [n, F] intermediates stay in cache from the GEMM that writes them to
# the ones that read them (the whole [N, F] ones, op after op, do not), and a bias is added as one row
# broadcast over the expert's rows (no [N, F] gather of bias rows).
# The same `mm`s per expert as the grouped engines; the split backward (Lancet) runs the same two per-expert
# functions as the whole one, so their gradients are equal bit for bit.
# ----------------------------------------------------------------------------------------------


def project(a_np: Tensor, w_qp: Tensor, b_q: Tensor | None, out_nq: Tensor | None = None) -> Tensor:
    """a_np @ w_qp^T (+ b_q), written into `out_nq` when given (autograd's way, `ffn_autograd`: a new tensor). With a
    bias, one `addmm` (the GEMM accumulates onto
    the bias rows): `nn.Linear`'s arithmetic on 2-D input, and neither the zero fill of a fresh product nor a second
    pass to add the bias (9.25 against 9.67 ms for a [3584, 256] x [256, 512] layer here); the grouped engines add
    the bias after the product, which rounds differently (within the parity tests' tolerance)."""
    if b_q is None:
        return torch.mm(a_np, w_qp.t(), out=out_nq)
    return torch.addmm(b_q, a_np, w_qp.t(), out=out_nq)


def of(t_E: Tensor | None, e: int) -> Tensor | None:
    return None if t_E is None else t_E[e]


def forward_per_expert(
    rows: Rows, x_ND: Tensor, weights: tuple[Tensor, Tensor | None, Tensor],
    biases: tuple[Tensor | None, Tensor | None, Tensor | None], activation: str, clamp_limit: float, alpha: float,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """`forward`, expert by expert: y_ND and the pre-activations written into whole [N, ...] tensors."""
    (w_gate_EFD, w_up_EFD, w_down_EDF), (b_gate_EF, b_up_EF, b_down_ED) = weights, biases
    N, fused = x_ND.shape[0], fused_gate_up(w_up_EFD, activation)
    h_gate = x_ND.new_empty(N, w_gate_EFD.shape[1])
    h_up = None if w_up_EFD is None else x_ND.new_empty(N, w_up_EFD.shape[1])
    y_ND = x_ND.new_empty(N, w_down_EDF.shape[1])
    for e, r in rows.spans:
        x_nD = x_ND[r]
        g_nF = project(x_nD, w_gate_EFD[e], of(b_gate_EF, e), h_gate[r])
        u_nF = None if h_up is None or w_up_EFD is None else project(x_nD, w_up_EFD[e], of(b_up_EF, e), h_up[r])
        a_nF = activation_output(g_nF, u_nF, activation, clamp_limit, alpha, fused)
        project(a_nF, w_down_EDF[e], of(b_down_ED, e), y_ND[r])
    rows.zero_tail(y_ND)
    return y_ND, h_gate, h_up


@dataclass
class ExpertGrads:
    """One expert's rows, activation output and pre-activation gradients: what its weight gradients need."""

    expert: int
    rows: slice
    a_nF: Tensor
    grad_gate: Tensor  # [n, F] (fused gate/up: [n, 2F])
    grad_up: Tensor | None


def expert_input_grads(
    e: int, r: slice, grad_y_ND: Tensor, x_ND: Tensor, h_gate_NF: Tensor | None, h_up_NF: Tensor | None,
    weights: tuple[Tensor, Tensor | None, Tensor], biases: tuple[Tensor | None, Tensor | None, Tensor | None],
    activation: str, clamp_limit: float, alpha: float, grad_x_ND: Tensor,
) -> ExpertGrads:
    """Expert e's rows of grad_x_ND (written in place), and what its weight gradients need. `h_gate_NF is None`:
    its pre-activations are recomputed (the forward's GEMMs on its rows)."""
    (w_gate_EFD, w_up_EFD, w_down_EDF), (b_gate_EF, b_up_EF, _) = weights, biases
    if h_gate_NF is None:
        x_nD = x_ND[r]
        g_nF = project(x_nD, w_gate_EFD[e], of(b_gate_EF, e))
        u_nF = None if w_up_EFD is None else project(x_nD, w_up_EFD[e], of(b_up_EF, e))
    else:
        g_nF, u_nF = h_gate_NF[r], None if h_up_NF is None else h_up_NF[r]
    a_nF, grad_gate, grad_up = activation_grads(torch.mm(grad_y_ND[r], w_down_EDF[e]), g_nF, u_nF, activation,
                                                clamp_limit, alpha, fused_gate_up(w_up_EFD, activation),
                                                h_gate_NF is None)
    torch.mm(grad_gate, w_gate_EFD[e], out=grad_x_ND[r])
    if grad_up is not None:
        assert w_up_EFD is not None
        grad_x_ND[r].add_(torch.mm(grad_up, w_up_EFD[e]))  # the two products added, as autograd sums them
    return ExpertGrads(e, r, a_nF, grad_gate, grad_up)


def backward_per_expert(
    rows: Rows, grad_y_ND: Tensor, x_ND: Tensor, h_gate_NF: Tensor | None, h_up_NF: Tensor | None,
    weights: tuple[Tensor, Tensor | None, Tensor], biases: tuple[Tensor | None, Tensor | None, Tensor | None],
    activation: str, clamp_limit: float, alpha: float, grads: list[Tensor | None] | None,
) -> tuple[Tensor, list[ExpertGrads]]:
    """grad_x_ND expert by expert; given `grads` (`gradient_buffers`) each expert's weight gradients are written
    right after its input gradient, else what they need is returned, one `ExpertGrads` per expert."""
    grad_x_ND, experts = x_ND.new_empty(x_ND.shape), []
    for e, r in rows.spans:
        expert = expert_input_grads(e, r, grad_y_ND, x_ND, h_gate_NF, h_up_NF, weights, biases, activation,
                                    clamp_limit, alpha, grad_x_ND)
        if grads is None:
            experts.append(expert)
        else:
            expert_weight_grads(expert, grad_y_ND, x_ND, grads)
    rows.zero_tail(grad_x_ND)
    return grad_x_ND, experts


def gradient_buffers(rows: Rows, weights: tuple[Tensor, Tensor | None, Tensor],
                     biases: tuple[Tensor | None, Tensor | None, Tensor | None]) -> list[Tensor | None]:
    """The (w_gate, w_up, w_down, b_gate, b_up, b_down) gradients to write expert by expert, each laid out as its
    tensor (`weight_grad`); the slices of experts without rows set to zero."""
    out: list[Tensor | None] = []
    for w in weights:
        if w is None:
            out.append(None)
            continue
        E, P, Q = w.shape
        flip = transposed(w)
        buffer = reusable_grad_buffer(w, (E, Q, P) if flip else (E, P, Q))
        out.append(gradient_like(w) if buffer is None else buffer.transpose(-2, -1) if flip else buffer)
    for e, n in enumerate(rows.sizes):
        if not n:
            for g in out:
                if g is not None:
                    g[e].zero_()
    return out + [None if b is None else b.new_zeros(b.shape) for b in biases]


def expert_weight_grads(expert: ExpertGrads, grad_y_ND: Tensor, x_ND: Tensor, grads: list[Tensor | None]) -> None:
    """Expert e's slices of the weight and bias gradients (`gradient_buffers`), as `F.linear`'s backward
    computes them: grad_out^T @ input, and the bias's the column sums of grad_out."""
    e, r = expert.expert, expert.rows
    grad_w_gate, grad_w_up, grad_w_down, grad_b_gate, grad_b_up, grad_b_down = grads
    x_nD, grad_y_nD = x_ND[r], grad_y_ND[r]
    assert grad_w_gate is not None and grad_w_down is not None
    torch.mm(grad_y_nD.t(), expert.a_nF, out=grad_w_down[e])
    torch.mm(expert.grad_gate.t(), x_nD, out=grad_w_gate[e])
    if expert.grad_up is not None:
        assert grad_w_up is not None
        torch.mm(expert.grad_up.t(), x_nD, out=grad_w_up[e])
    for grad_b, g_nq in ((grad_b_gate, expert.grad_gate), (grad_b_up, expert.grad_up), (grad_b_down, grad_y_nD)):
        if grad_b is not None and g_nq is not None:
            torch.sum(g_nq, 0, out=grad_b[e])
