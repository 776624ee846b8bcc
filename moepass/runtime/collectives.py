"""Communication as issue/wait pairs, autograd-correct, counted.

Ops (namespace `moe_comm`; each issue op returns a pending tensor that `moe_comm.wait` completes, so
a schedule pass can move the wait to overlap the transfer with compute):

    exchange_counts(counts_E | counts_nE, group_name)             -> recv_counts_E | recv_counts_nPL (issue, no grad)
    host_splits(send_counts_nE, recv_counts_nE, group_name)       -> splits_n2P (CPU; the host sync, no grad)
    all_to_all(x_XD, send_counts_E, recv_counts_E, group_name, kind, out_rows, splits_2P=None) -> y_YD   (issue)
    equal_all_to_all(x_GS, group_name, kind)                     -> y_GS            (issue; equal splits)
    gather_counts(counts_E, group_name)                          -> counts_PE       (blocking, no grad)
    wait(t)                                                      -> t               (wait; grad passes)

  the hierarchical (2D) all-to-all (`Plan(hierarchical_a2a=True)`) is in `moepass.runtime.hierarchical`.

Count layout: E = P*L entries blocked by peer (P ranks in the group, L experts each):
`send_counts_E[p*L + l]` rows go to local expert l of peer p; `recv_counts_E[p*L + l]` rows arrive
from peer p for this rank's local expert l. `all_to_all` sends the first sum(send_counts_E) rows of x
(rows past that — dropped assignments — stay home) and returns sum(recv_counts_E) rows, or
`out_rows` rows with a zero tail when out_rows >= 0. Its backward is the reverse all_to_all (counts
swapped) of the gradient, padded back to x's rows.

Counts of n chunks at once: `exchange_counts` of a [n, E] table sends peer p the [n, L] block of its
buckets in one message (`recv_counts_nPL[j, p, l]`: rows of chunk j from peer p for local bucket l;
chunk j's `recv_counts_E` is row j flattened), so a chunked block exchanges counts once, not per chunk.

Host sync point (the only one here): `host_split_table` — one device -> host copy of the per-peer
row totals of every chunk, both directions: [n, 2, P] int64 on the CPU (row 0 sent, row 1 received).
The `host_splits` op runs it once per block and step; each `all_to_all` gets its chunk's [2, P] rows
(`splits_2P`, the combine the flipped rows) and reads its Python-int splits from host memory, and its
autograd keeps them (flipped) for the backward exchange: no sync per chunk, none in the backward.
Without `splits_2P` the op syncs itself (`split_sizes`; callers outside the rewrites).
With `Plan(hierarchical_a2a=True)` the block's host sync is `node_split_table` instead (the flat table is
not made): one device -> host copy of [2, 3P] ints that every stage of the dispatch and the combine, and
their backward, read from host memory.

Pipelined backward (issue/wait pairs in both directions). autograd runs a node's backward once its
output gradients are ready, highest sequence number (latest forward op) first. A forward issue node
I and its wait W (I -> W) are two autograd nodes, so the backward is split the other way round: W's
backward ISSUES the reverse transfer (and hands I a placeholder gradient), I's backward WAITS for
it. Everything the forward ran between I and W runs, in the backward, between that issue and that
wait, i.e. overlaps the transfer. The schedule pass emits chunk j's combine issue before chunk j+1's
dispatch wait and expert compute (moepass/schedule.py), so in the backward the combine-backward of
every chunk is issued as soon as the block's output gradient exists and chunk j's is waited only
after chunk j+1's expert backward; chunk j+1's dispatch-backward is issued right after its expert
backward and waited after chunk j's. The order is the engine's, deterministic and the same on every
rank (same graph), so every rank issues the same collectives in the same order. Moving an issue or
wait node in the forward graph moves the matching wait or issue in the backward.
How I and W meet: the issue op registers its output tensor with its `Transfer` (the work, the
listeners' tokens, and, from autograd's setup, the reverse issue); W looks it up (weakly keyed by the
tensor; popped at the wait, so nothing outlives the step). The placeholder is an expanded zero of the
gradient's shape; I's backward uses the early transfer only if the gradient it receives IS that
placeholder (else something else also used the pending tensor: it waits the early transfer, discards
it and exchanges the full gradient, the same on every rank). Under tracing (fake tensors,
torch.compile) nothing is registered: the backward issues and waits in one step as before.

Fake implementations: the dynamic row count comes from `ctx.new_dynamic_size()` (Dynamo-friendly);
in a FakeTensorMode without a ShapeEnv (which cannot represent such a size) the send-side row count
stands in, so plain shape propagation still runs. Under Dynamo without fullgraph=True (its ShapeEnv
forbids dynamic output shapes) the op raises, so Dynamo graph-breaks around it rather than baking in a
wrong size.

Checks: with `MOEPASS_CHECK_COLLECTIVES=1` (the tests set it) every collective asserts that all its
tensors are on the input's device and that its split sizes are Python ints.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from moepass import eager
from moepass.envflags import flag
from moepass.process_state import TRANSFERS
from moepass.runtime import scheduler, stats
from moepass.runtime.topology import Topology, group_info

NAMESPACE = "moe_comm"
CHECK = flag("MOEPASS_CHECK_COLLECTIVES")


def checks_enabled() -> bool:
    """`CHECK`, or `MOEPASS_CHECK_COLLECTIVES` on now (`moepass.envflags`)."""
    return CHECK or flag("MOEPASS_CHECK_COLLECTIVES")


def _group(group_name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(group_name)  # type: ignore[arg-type]


def process_group(group_name: str) -> dist.ProcessGroup:
    """The process group a graph names (graphs carry group names, not group objects)."""
    return _group(group_name)


def peers_of(group_name: str) -> list[int]:
    """The global ranks of the process group a graph names, in group order."""
    return _peers(group_name)[1]


def _peers(group_name: str) -> tuple[Topology, list[int]]:
    try:
        return group_info(group_name)
    except KeyError:
        return Topology.from_env(), dist.get_process_group_ranks(_group(group_name))


def host_split_table(send_counts_nE: Tensor, recv_counts_nE: Tensor, peers: int) -> Tensor:
    """THE SYNC POINT: per-peer rows to send and to receive of every chunk, [n, 2, P] int64 on the CPU
    (one device -> host copy; [2, P] for 1-D counts)."""
    lead = send_counts_nE.shape[:-1]  # recv may be exchange_counts' [n, P, L]: same totals per (chunk, peer)
    send_nP = send_counts_nE.reshape(*lead, peers, -1).sum(-1)
    recv_nP = recv_counts_nE.reshape(*lead, peers, -1).sum(-1)
    return torch.stack([send_nP, recv_nP], dim=-2).to("cpu", torch.int64)


def split_sizes(send_counts_E: Tensor, recv_counts_E: Tensor, peers: int) -> tuple[list[int], list[int]]:
    """Per-peer rows to send and to receive, as Python ints (syncs: `host_split_table`)."""
    return _splits_of(host_split_table(send_counts_E, recv_counts_E, peers))


def _splits_of(splits_2P: Tensor) -> tuple[list[int], list[int]]:
    """Python ints from a host split table row pair (host memory: no device sync)."""
    send, recv = splits_2P.tolist()
    return [int(s) for s in send], [int(r) for r in recv]


def record_bytes(kind: str, group_name: str, send_splits: list[int], row_bytes: int) -> None:
    """Count the bytes this rank sends to each peer of the group, by link."""
    topology, ranks = _peers(group_name)
    me = dist.get_rank()
    by_link = {"self": 0, "intra": 0, "inter": 0}
    for peer, rows in zip(ranks, send_splits):
        by_link[topology.link(me, peer)] += rows * row_bytes
    stats.record(kind, intra=by_link["intra"], inter=by_link["inter"], self_bytes=by_link["self"])


@dataclass
class Transfer:
    """One issued exchange, from its issue op to its `moe_comm.wait` (see "Pipelined backward")."""

    issued: list[tuple[Any, Any]] = field(default_factory=list)  # (listener, token): `scheduler.notify_waited`
    reverse: Callable[[Tensor], Tensor] | None = None  # grad of the output -> pending grad of the input
    placeholder: Tensor | None = None  # what the wait's backward handed the issue's backward
    pending: Tensor | None = None  # the reverse transfer in flight
    kind: str = "?"  # what it is (dispatch, combine, restore, ...), for errors
    group_name: str = "?"


def peer_lost(kind: str, group_name: str, err: Exception) -> Exception:
    """The error a rank raises when a collective it waits for fails (a peer died, or stalled past the group's
    timeout): the backend's message with what moepass was doing, on which ranks, and what to do. Same type as
    the backend's error (gloo / NCCL raise `torch.distributed.DistBackendError`, a RuntimeError)."""
    try:
        ranks: list[int] | str = _peers(group_name)[1]
    except Exception:  # a group that is gone: name it only
        ranks = "?"
    message = (f"moepass: the {kind!r} collective on process group {group_name} (ranks {ranks}) failed on rank "
               f"{dist.get_rank() if dist.is_initialized() else '?'}: a peer rank died or did not join within the "
               f"group's timeout (Plan(topology=Topology(..., timeout=seconds))). Look for the first error in the "
               f"other ranks' logs; raise the timeout only if a peer is merely slow. Backend: {err}")
    try:
        return type(err)(message)
    except Exception:
        return RuntimeError(message)


def _eager(t: Tensor) -> bool:
    """A real tensor outside any tracing (fake tensors, torch.compile): only then are transfers linked."""
    return type(t) is Tensor and not torch.compiler.is_compiling()


def issue(out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int], group_name: str,
           kind: str, key: Tensor | None = None) -> None:
    """Launch all_to_all_single(out <- inp) asynchronously; `moe_comm.wait(key)` completes it (`key`:
    the tensor the op returns, `out` or a tensor whose rows `out` is)."""
    if checks_enabled():
        assert out.device == inp.device, f"moe_comm {kind}: output on {out.device}, input on {inp.device}"
        for what, splits in (("output", out_splits), ("input", in_splits)):
            assert all(type(s) is int for s in splits), f"moe_comm {kind}: {what} splits {splits} are not ints"
    row_bytes = inp.element_size() * math.prod(inp.shape[1:])  # not inp[0]: a rank may send 0 rows
    record_bytes(kind, group_name, in_splits, row_bytes)
    transfer = Transfer(kind=kind, group_name=group_name)
    try:
        work = scheduler.issue_collective(kind, group_name, sum(in_splits) * row_bytes, lambda: dist.all_to_all_single(
            out, inp, out_splits, in_splits, group=_group(group_name), async_op=True),  # tells the priority scheduler
            issued=transfer.issued)
    except RuntimeError as err:  # a peer already gone (a connection closed) fails the launch itself
        raise peer_lost(kind, group_name, err) from err
    torch._C._distributed_c10d._register_work(out, work)
    key = out if key is None else key
    if _eager(key):
        TRANSFERS[key] = transfer


# ----------------------------------------------------------------------------------------------
# exchange_counts: equal-split all-to-all of per-expert counts (metadata).
# ----------------------------------------------------------------------------------------------


@eager.custom_op("moe_comm::exchange_counts", mutates_args=())
def exchange_counts(counts_E: Tensor, group_name: str) -> Tensor:
    """[E] -> [E]; [n, E] (n chunks) -> [n, P, L], a view of the [P, n, L] receive buffer: entry
    [j, p, l] = rows of chunk j peer p sends to local bucket l. One message per peer either way."""
    peers = len(_peers(group_name)[1])
    E = counts_E.shape[-1]
    if E % peers or counts_E.dim() not in (1, 2):
        raise ValueError(f"moe_comm.exchange_counts: counts of shape {tuple(counts_E.shape)} do not split over "
                         f"{peers} ranks: use [E] or [n, E] counts with E divisible by {peers}")
    if counts_E.dim() == 1:
        send = counts_E.contiguous()
        recv = torch.empty_like(send)
        issue(recv, send, [E // peers] * peers, [E // peers] * peers, group_name, "counts")
        return recv
    n = counts_E.shape[0]
    send_PnL = counts_E.reshape(n, peers, E // peers).transpose(0, 1).contiguous()  # peer p's buckets, every chunk
    recv_PnL = torch.empty_like(send_PnL)
    out_nPL = recv_PnL.transpose(0, 1)
    per = n * (E // peers)
    issue(recv_PnL.view(-1), send_PnL.view(-1), [per] * peers, [per] * peers, group_name, "counts", key=out_nPL)
    return out_nPL


@exchange_counts.register_fake
def _(counts_E, group_name):
    if counts_E.dim() == 1:
        return torch.empty_like(counts_E)
    peers = len(_peers(group_name)[1])
    n, E = counts_E.shape
    return counts_E.new_empty((peers, n, E // peers)).transpose(0, 1)


@eager.custom_op("moe_comm::host_splits", mutates_args=())
def host_splits(send_counts_E: Tensor, recv_counts_E: Tensor, group_name: str) -> Tensor:
    """The block's one host sync: [n, 2, P] (or [2, P] for 1-D counts) int64 CPU split table
    (`host_split_table`); `recv_counts_E` as `exchange_counts` returns it."""
    return host_split_table(send_counts_E, recv_counts_E, len(_peers(group_name)[1]))


@host_splits.register_fake
def _(send_counts_E, recv_counts_E, group_name):
    peers = len(_peers(group_name)[1])
    return torch.empty((*send_counts_E.shape[:-1], 2, peers), dtype=torch.int64, device="cpu")


# ----------------------------------------------------------------------------------------------
# all_to_all: variable-split token exchange (dispatch / combine), differentiable.
# ----------------------------------------------------------------------------------------------


@eager.custom_op("moe_comm::all_to_all", mutates_args=())
def all_to_all(x_XD: Tensor, send_counts_E: Tensor, recv_counts_E: Tensor, group_name: str, kind: str,
               out_rows: int, splits_2P: Tensor | None = None) -> Tensor:
    """`splits_2P`: this exchange's rows per peer, sent (row 0) and received (row 1), on the CPU
    (`host_splits`); None: read from the counts here (a host sync)."""
    peers = len(_peers(group_name)[1])
    if checks_enabled():
        for t in (send_counts_E, recv_counts_E):
            assert t.device == x_XD.device, f"moe_comm {kind}: counts on {t.device}, x on {x_XD.device}"
        assert splits_2P is None or (splits_2P.device.type == "cpu" and tuple(splits_2P.shape) == (2, peers)), (
            f"moe_comm {kind}: splits_2P must be a [2, {peers}] CPU table, got {splits_2P.shape} on {splits_2P.device}")
    if splits_2P is None:
        send_splits, recv_splits = split_sizes(send_counts_E, recv_counts_E, peers)  # host sync point
    else:
        send_splits, recv_splits = _splits_of(splits_2P)  # host memory
    n_send, n_recv = sum(send_splits), sum(recv_splits)
    if n_send > x_XD.shape[0]:
        raise ValueError(f"moe_comm.all_to_all[{kind}]: counts send {n_send} rows, x has {x_XD.shape[0]}")
    rows = n_recv if out_rows < 0 else out_rows
    if rows < n_recv:
        raise ValueError(f"moe_comm.all_to_all[{kind}]: out_rows={out_rows} < {n_recv} rows received")
    out = x_XD.new_empty((rows, *x_XD.shape[1:]))
    if rows > n_recv:
        out[n_recv:].zero_()
    issue(out[:n_recv], x_XD[:n_send].contiguous(), recv_splits, send_splits, group_name, kind, key=out)
    return out


@all_to_all.register_fake
def _(x_XD, send_counts_E, recv_counts_E, group_name, kind, out_rows, splits_2P=None):
    if out_rows >= 0:
        rows = out_rows
    else:
        ctx = torch.library.get_ctx()
        try:
            rows = ctx.new_dynamic_size()
        except DynamicOutputShapeException:
            if getattr(ctx, "_shape_env", None) is not None:
                # a ShapeEnv that forbids dynamic output shapes (Dynamo without fullgraph=True or
                # capture_dynamic_output_shape_ops): a stand-in size would be baked into the graph and
                # fail at run time, so let Dynamo graph-break here and run this op eagerly
                raise
            rows = x_XD.shape[0]  # no ShapeEnv: the send-side rows stand in (see module doc)
    return x_XD.new_empty((rows, *x_XD.shape[1:]))


def _a2a_setup(ctx, inputs, output):
    x_XD, send_counts_E, recv_counts_E, group_name, kind, _out_rows, splits_2P = inputs
    ctx.save_for_backward(send_counts_E, recv_counts_E)
    # the reverse exchange sends what this one received: the same table, rows swapped (no sync in backward)
    ctx.options = (group_name, kind, x_XD.shape[0], None if splits_2P is None else splits_2P.flip(0))
    ctx.transfer = TRANSFERS.get(output) if _eager(output) else None
    if ctx.transfer is not None:
        ctx.transfer.reverse = functools.partial(_reverse_a2a, ctx)


def _reverse_a2a(ctx, grad_YD: Tensor) -> Tensor:
    """Issue the backward exchange of `grad_YD` (pending: `moe_comm.wait` completes it)."""
    send_counts_E, recv_counts_E = ctx.saved_tensors
    group_name, kind, x_rows, back_2P = ctx.options
    return eager.call(ALL_TO_ALL, grad_YD.contiguous(), recv_counts_E, send_counts_E, group_name, f"{kind}_bwd",
                      x_rows, back_2P)


def _a2a_bwd(ctx, grad_YD):
    pending = early_transfer(ctx.transfer, grad_YD)
    ctx.transfer = None  # (the transfer's reverse holds this ctx: no cycle left behind)
    if pending is None:  # not issued by the wait's backward (see "Pipelined backward"): issue now
        pending = _reverse_a2a(ctx, grad_YD)
    return eager.call(WAIT, pending), None, None, None, None, None, None


def early_transfer(transfer: Transfer | None, grad: Tensor) -> Tensor | None:
    """The reverse transfer the wait's backward issued for this gradient, or None (then an issued one
    whose gradient was not the whole story is completed and dropped: every rank does the same)."""
    if transfer is None or transfer.pending is None:
        return None
    pending, placeholder = transfer.pending, transfer.placeholder
    transfer.pending = transfer.placeholder = None
    if grad is placeholder:
        return pending
    eager.call(WAIT, pending)
    return None


eager.register_autograd(all_to_all, _a2a_bwd, setup_context=_a2a_setup)


# ----------------------------------------------------------------------------------------------
# equal_all_to_all: balanced, fixed-shape exchange (FSEP weight restore, HP token exchange), differentiable.
# ----------------------------------------------------------------------------------------------


@eager.custom_op("moe_comm::equal_all_to_all", mutates_args=())
def equal_all_to_all(x_GS: Tensor, group_name: str, kind: str) -> Tensor:
    """All-to-all with equal splits: G rows, block p (G/P rows) goes to peer p, and block p of the result is
    what peer p sent. Same shape every step: no counts, no host sync. Its backward is the same exchange of
    the gradient (the exchange is its own inverse's transpose).

    FSEP's restore sends a rank's slices of the experts each receiver's slots host (kind "restore");
    head parallel sends every rank's tokens to the rank of their heads (kinds "hp_dispatch", "hp_combine")."""
    peers = len(_peers(group_name)[1])
    if x_GS.shape[0] % peers:
        raise ValueError(f"moe_comm.equal_all_to_all[{kind}]: {x_GS.shape[0]} rows do not split over {peers} ranks")
    send = x_GS.contiguous()
    recv = torch.empty_like(send)
    splits = [send.shape[0] // peers] * peers
    issue(recv, send, splits, splits, group_name, kind)
    return recv


@equal_all_to_all.register_fake
def _(x_GS, group_name, kind):
    return torch.empty_like(x_GS)


def _equal_setup(ctx, inputs, output):
    ctx.group_name, ctx.kind = inputs[1], inputs[2]


def _equal_bwd(ctx, grad_GS):
    pending = eager.call(EQUAL_ALL_TO_ALL, grad_GS.contiguous(), ctx.group_name, f"{ctx.kind}_bwd")
    return eager.call(WAIT, pending), None, None


eager.register_autograd(equal_all_to_all, _equal_bwd, setup_context=_equal_setup)


ALL_GATHER_SINGLE = scheduler.ALL_GATHER_SINGLE  # torch 2.13's all_gather_single, else all_gather_into_tensor


@eager.custom_op("moe_comm::gather_counts", mutates_args=())
def gather_counts(counts_E: Tensor, group_name: str) -> Tensor:
    """Every rank's counts, stacked: [P, E] (blocking; metadata for FSEP's placement planner)."""
    ranks = _peers(group_name)[1]
    out = counts_E.new_empty(len(ranks) * counts_E.numel())  # flat: what every backend's all_gather accepts
    record_bytes("counts", group_name, [1] * len(ranks), counts_E.numel() * counts_E.element_size())
    ALL_GATHER_SINGLE(out, counts_E.contiguous().view(-1), group=_group(group_name))
    return out.view(len(ranks), *counts_E.shape)


@gather_counts.register_fake
def _(counts_E, group_name):
    return counts_E.new_empty((len(_peers(group_name)[1]), *counts_E.shape))


# ----------------------------------------------------------------------------------------------
# wait: completes an issued collective. Returns its input (an alias), so it is defined with the
# low-level Library API (custom_op forbids aliasing outputs); gradients pass through unchanged.
# ----------------------------------------------------------------------------------------------

_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
_lib.define("wait(Tensor(a) t) -> Tensor(a)")


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor) -> Tensor:
        transfer = TRANSFERS.pop(t, None) if _eager(t) else None
        if transfer is not None:
            scheduler.notify_waited(transfer.issued)
        try:
            torch.ops._c10d_functional.wait_tensor(t)
        except RuntimeError as err:
            kind, group = (transfer.kind, transfer.group_name) if transfer is not None else ("moe_comm", "?")
            raise peer_lost(kind, group, err) from err
        ctx.transfer = transfer if transfer is not None and transfer.reverse is not None else None
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        transfer = ctx.transfer
        if transfer is None or transfer.reverse is None or not _eager(grad):
            return grad
        # issue the reverse exchange now; the issue op's backward waits for it (module doc)
        transfer.pending, transfer.reverse = transfer.reverse(grad), None
        transfer.placeholder = grad.new_zeros(()).expand_as(grad)
        return transfer.placeholder


def _wait_impl(t: Tensor) -> Tensor:
    return _Wait.apply(t)


_lib.impl("wait", _wait_impl, "CompositeImplicitAutograd")
eager.register(torch.ops.moe_comm.wait.default, eager.EagerOp(torch.ops.moe_comm.wait.default, _wait_impl))

EXCHANGE_COUNTS = torch.ops.moe_comm.exchange_counts.default
HOST_SPLITS = torch.ops.moe_comm.host_splits.default
ALL_TO_ALL = torch.ops.moe_comm.all_to_all.default
EQUAL_ALL_TO_ALL = torch.ops.moe_comm.equal_all_to_all.default
GATHER_COUNTS = torch.ops.moe_comm.gather_counts.default
WAIT = torch.ops.moe_comm.wait.default


# ----------------------------------------------------------------------------------------------
# Gradient all-reduce (expert replicas across the DP dimension), counted.
# ----------------------------------------------------------------------------------------------


def all_reduce_sum_(t: Tensor, group: dist.ProcessGroup, kind: str = "grad_allreduce") -> Tensor:
    """In-place sum over `group` (blocking, with the group's timeout). Bytes counted as a ring would
    send them: 2(n-1)/n of the payload, attributed to inter-node if the group spans nodes. Launched
    through the collective registry (category "all_reduce"), so the event log sees it; it is not a
    priority-scheduler micro-op (it blocks where it is called)."""
    topology, ranks = _peers(group.group_name)
    n = len(ranks)
    if n == 1:
        return t
    payload = 2 * (n - 1) * t.numel() * t.element_size() // n
    spans_nodes = len({topology.node_of(r) for r in ranks}) > 1
    stats.record(kind, intra=0 if spans_nodes else payload, inter=payload if spans_nodes else 0)
    issued: list[tuple[Any, Any]] = []
    work = scheduler.issue_collective(kind, group.group_name, payload, lambda: dist.all_reduce(
        t, group=group, async_op=True), category=scheduler.ALL_REDUCE, issued=issued)
    scheduler.notify_waited(issued)
    try:
        work.wait()
    except RuntimeError as err:
        raise peer_lost(kind, group.group_name, err) from err
    return t
