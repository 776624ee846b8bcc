"""FSEP's ops (`moepass.rewrite.fsep` builds the graph, `moepass.runtime.fsep` drives them): lite routing to
slots (`moe_fsep.route_to_slots`), the restore's send buffer (`gather_slices`: this rank's slice of the
expert in every slot) and the C whole experts assembled from what it receives (`assemble`), the restore
run again in the backward (`Restore`), and the per-expert counts the planner observes.

Lite routing (`route_to_slots`): the assignments of rank i to expert e go to e's replicas on i's node
if there are any, else to all of e's replicas, split evenly in order (the j-th of n to replica
floor(j*m/n) of the m) — the rule `moepass.runtime.placement` prices with.

Shape letters: `moepass.spec.SHAPES` (here U = P*C global slots, slot u = n*C + c on device n; s the
elements of one slot's slice of every weight).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moepass.runtime import collectives as comm


@torch.library.custom_op("moe_fsep::route_to_slots", mutates_args=())
def route_to_slots(experts_TK: Tensor, slot_expert_U: Tensor, rank: int, ranks_per_node: int, slots: int,
                   num_experts: int) -> Tensor:
    """The slot of each assignment under lite routing (see module doc); expert id E (dropped) -> slot P*C."""
    E, U = num_experts, slot_expert_U.shape[0]
    device = experts_TK.device
    slot_ids = torch.arange(U, device=device)
    hosts_EU = slot_expert_U.unsqueeze(0) == torch.arange(E, device=device).unsqueeze(1)
    local_EU = hosts_EU & ((slot_ids // slots) // ranks_per_node == rank // ranks_per_node).unsqueeze(0)
    pref_EU = torch.where(local_EU.any(1, keepdim=True), local_EU, hosts_EU)
    replicas_E = pref_EU.sum(1)
    ordered_EU = torch.where(pref_EU, slot_ids, U).sort(1).values  # each expert's preferred slots first, in order
    flat = experts_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)  # occurrence index j of each assignment within its expert
    counts = torch.bincount(flat, minlength=E + 1)
    starts = torch.cumsum(counts, 0) - counts
    j = torch.empty_like(flat)
    j[order] = torch.arange(flat.shape[0], device=device) - starts[flat[order]]
    kept = flat < E
    e = torch.where(kept, flat, 0)
    q = (j * replicas_E[e]) // counts[e].clamp(min=1)
    slot = ordered_EU[e, q.clamp(max=U - 1)]
    return torch.where(kept, slot, U).view_as(experts_TK)


@route_to_slots.register_fake
def _(experts_TK, slot_expert_U, rank, ranks_per_node, slots, num_experts):
    return torch.empty_like(experts_TK)


ROUTE_TO_SLOTS = torch.ops.moe_fsep.route_to_slots.default


def slice_grads(grad_Us: Tensor, slot_expert_U: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
    """Each shard's gradient from the gradient slices of the slots ([P*C, s], weights side by side): every
    slot's slice summed into its expert's row (replicas add up), one `index_add_` per weight."""
    grads, offset = [], 0
    for shape in shapes:
        width = int(torch.Size(shape[1:]).numel())
        rows = grad_Us.new_zeros(shape[0], width).index_add_(0, slot_expert_U, grad_Us[:, offset:offset + width])
        grads.append(rows.view(shape))
        offset += width
    return grads


class _GatherSlices(torch.autograd.Function):
    """The restore's send buffer; its backward sums each slot's gradient slice into its expert's row
    (`slice_grads`)."""

    @staticmethod
    def forward(ctx, slot_expert_U, *shards):  # type: ignore[override]
        ctx.save_for_backward(slot_expert_U)
        ctx.shapes = [shard.shape for shard in shards]
        return torch.cat([shard.flatten(1).index_select(0, slot_expert_U) for shard in shards], 1)

    @staticmethod
    def backward(ctx, grad_Us):  # type: ignore[override]
        (slot_expert_U,) = ctx.saved_tensors
        return (None, *slice_grads(grad_Us, slot_expert_U, ctx.shapes))


def gather_slices(shards: list[Tensor], slot_expert_U: Tensor) -> Tensor:
    """[P*C, s]: this rank's slice of the expert in every slot, all weights side by side (the send buffer)."""
    return _GatherSlices.apply(slot_expert_U, *shards)


def _peer_widths(shapes: tuple[tuple[int, ...], ...], peers: int) -> list[int]:
    """Elements of one expert's slice of each weight, as the restore lays them side by side."""
    return [(shape[0] // peers) * int(torch.Size(shape[1:]).numel()) for shape in shapes]


class _Assemble(torch.autograd.Function):
    """The C restored experts of every weight from the restore's output; the backward writes the weights'
    gradients straight into one gradient send buffer (no zero-filled per-weight buffers to add up)."""

    @staticmethod
    def forward(ctx, recv_Us, peers, shapes):  # type: ignore[override]
        ctx.peers, ctx.shapes = peers, shapes
        slices = recv_Us.view(peers, -1, recv_Us.shape[1])  # [P, C, s]
        out, offset = [], 0
        for shape, width in zip(shapes, _peer_widths(shapes, peers)):
            out.append(slices[:, :, offset:offset + width].permute(1, 0, 2).reshape(-1, *shape))
            offset += width
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        P, shapes = ctx.peers, ctx.shapes
        some = next(g for g in grads if g is not None)
        widths = _peer_widths(shapes, P)
        C = some.shape[0]
        buffer = some.new_empty(P, C, sum(widths))
        offset = 0
        for width, grad in zip(widths, grads):
            if grad is None:
                buffer[:, :, offset:offset + width].zero_()
            else:
                buffer[:, :, offset:offset + width].copy_(grad.reshape(C, P, width).transpose(0, 1))
            offset += width
        return buffer.view(P * C, sum(widths)), None, None


def assemble(recv_Us: Tensor, peers: int, shapes: tuple[tuple[int, ...], ...]) -> tuple[Tensor, ...]:
    """Every weight of the C restored experts, [C, *shape] each, from the restore's output (peer-major)."""
    return _Assemble.apply(recv_Us, peers, tuple(tuple(s) for s in shapes))


class Restore:
    """One layer-step's restore, runnable again in the backward (`dialect.rebuildable`): the expert FFN then
    keeps this handle instead of the C whole experts, so restored weights live one layer at a time, as
    the technique's memory formula (E·S)/W + C·S assumes. The first weight the backward asks for runs the
    exchange once more (same shards, same table: the values of the forward); the others reuse it."""

    def __init__(self, shards: list[Tensor], slot_expert_U: Tensor, group_name: str, shapes: tuple, peers: int):
        self.shards, self.slot_expert_U, self.group_name = shards, slot_expert_U, group_name
        self.shapes, self.peers = shapes, peers
        self.weights: list[Tensor] | None = None

    def run(self) -> list[Tensor]:
        if self.weights is None:
            with torch.no_grad():
                send = gather_slices([s.detach() for s in self.shards], self.slot_expert_U)
                recv = comm.WAIT(comm.EQUAL_ALL_TO_ALL(send, self.group_name, "restore_again"))
                self.weights = list(assemble(recv, self.peers, self.shapes))
        return self.weights


def expert_counts(experts_TK: Tensor, num_experts: int) -> Tensor:
    """Assignments per expert ([E]; dropped ones, id E, not counted)."""
    flat = experts_TK.reshape(-1)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))[:num_experts]  # static shape (bincount's is not)
