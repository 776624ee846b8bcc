"""Communication as issue/wait pairs, autograd-correct, counted.

Ops (namespace `moe_comm`; each issue op returns a pending tensor that `moe_comm.wait` completes, so
a schedule pass can move the wait to overlap the transfer with compute):

    exchange_counts(counts_E, group_name)                        -> recv_counts_E   (issue, no grad)
    all_to_all(x_XD, send_counts_E, recv_counts_E, group_name, kind, out_rows) -> y_YD   (issue)
    equal_all_to_all(x_GS, group_name, kind)                     -> y_GS            (issue; equal splits)
    gather_counts(counts_E, group_name)                          -> counts_PE       (blocking, no grad)
    wait(t)                                                      -> t               (wait; grad passes)

Count layout: E = P*L entries blocked by peer (P ranks in the group, L experts each):
`send_counts_E[p*L + l]` rows go to local expert l of peer p; `recv_counts_E[p*L + l]` rows arrive
from peer p for this rank's local expert l. `all_to_all` sends the first sum(send_counts_E) rows of x
(rows past that — dropped assignments — stay home) and returns sum(recv_counts_E) rows, or
`out_rows` rows with a zero tail when out_rows >= 0. Its backward is the reverse all_to_all (counts
swapped) of the gradient, padded back to x's rows.

Host sync point (the only one here): `split_sizes` — one `.tolist()` of both count vectors, in the
issue op, to hand Python-int splits to the backend.

Fake implementations: the dynamic row count comes from `ctx.new_dynamic_size()` (Dynamo-friendly);
in a FakeTensorMode without a ShapeEnv (which cannot represent such a size) the send-side row count
stands in, so plain shape propagation still runs. Under Dynamo without fullgraph=True (its ShapeEnv
forbids dynamic output shapes) the op raises, so Dynamo graph-breaks around it rather than baking in a
wrong size.

Checks: with `MOEPASS_CHECK_COLLECTIVES=1` (the tests set it) every collective asserts that all its
tensors are on the input's device and that its split sizes are Python ints.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from moepass.envflags import flag
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


def _peers(group_name: str) -> tuple[Topology, list[int]]:
    try:
        return group_info(group_name)
    except KeyError:
        return Topology.from_env(), dist.get_process_group_ranks(_group(group_name))


def split_sizes(send_counts_E: Tensor, recv_counts_E: Tensor, peers: int) -> tuple[list[int], list[int]]:
    """SYNC POINT: per-peer rows to send and to receive, as Python ints (one device->host copy)."""
    both_2P = torch.stack([send_counts_E.view(peers, -1).sum(1), recv_counts_E.view(peers, -1).sum(1)])
    send, recv = both_2P.tolist()
    return [int(s) for s in send], [int(r) for r in recv]


def record_bytes(kind: str, group_name: str, send_splits: list[int], row_bytes: int) -> None:
    """Count the bytes this rank sends to each peer of the group, by link."""
    topology, ranks = _peers(group_name)
    me = dist.get_rank()
    by_link = {"self": 0, "intra": 0, "inter": 0}
    for peer, rows in zip(ranks, send_splits):
        by_link[topology.link(me, peer)] += rows * row_bytes
    stats.record(kind, intra=by_link["intra"], inter=by_link["inter"], self_bytes=by_link["self"])


def _issue(out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int], group_name: str,
           kind: str) -> None:
    """Launch all_to_all_single(out <- inp) asynchronously; `moe_comm.wait(out)` completes it."""
    if checks_enabled():
        assert out.device == inp.device, f"moe_comm {kind}: output on {out.device}, input on {inp.device}"
        for what, splits in (("output", out_splits), ("input", in_splits)):
            assert all(type(s) is int for s in splits), f"moe_comm {kind}: {what} splits {splits} are not ints"
    row_bytes = inp.element_size() * math.prod(inp.shape[1:])  # not inp[0]: a rank may send 0 rows
    record_bytes(kind, group_name, in_splits, row_bytes)
    work = scheduler.issue_collective(kind, group_name, sum(in_splits) * row_bytes, lambda: dist.all_to_all_single(
        out, inp, out_splits, in_splits, group=_group(group_name), async_op=True))  # tells the priority scheduler
    torch._C._distributed_c10d._register_work(out, work)


# ----------------------------------------------------------------------------------------------
# exchange_counts: equal-split all-to-all of per-expert counts (metadata).
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("moe_comm::exchange_counts", mutates_args=())
def exchange_counts(counts_E: Tensor, group_name: str) -> Tensor:
    peers = len(_peers(group_name)[1])
    E = counts_E.shape[0]
    if E % peers:
        raise ValueError(f"moe_comm.exchange_counts: {E} counts do not split over {peers} ranks")
    send = counts_E.contiguous()
    recv = torch.empty_like(send)
    _issue(recv, send, [E // peers] * peers, [E // peers] * peers, group_name, "counts")
    return recv


@exchange_counts.register_fake
def _(counts_E, group_name):
    return torch.empty_like(counts_E)


# ----------------------------------------------------------------------------------------------
# all_to_all: variable-split token exchange (dispatch / combine), differentiable.
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("moe_comm::all_to_all", mutates_args=())
def all_to_all(x_XD: Tensor, send_counts_E: Tensor, recv_counts_E: Tensor, group_name: str, kind: str,
               out_rows: int) -> Tensor:
    peers = len(_peers(group_name)[1])
    if checks_enabled():
        for t in (send_counts_E, recv_counts_E):
            assert t.device == x_XD.device, f"moe_comm {kind}: counts on {t.device}, x on {x_XD.device}"
    send_splits, recv_splits = split_sizes(send_counts_E, recv_counts_E, peers)  # host sync point
    n_send, n_recv = sum(send_splits), sum(recv_splits)
    if n_send > x_XD.shape[0]:
        raise ValueError(f"moe_comm.all_to_all[{kind}]: counts send {n_send} rows, x has {x_XD.shape[0]}")
    rows = n_recv if out_rows < 0 else out_rows
    if rows < n_recv:
        raise ValueError(f"moe_comm.all_to_all[{kind}]: out_rows={out_rows} < {n_recv} rows received")
    out = x_XD.new_empty((rows, *x_XD.shape[1:]))
    if rows > n_recv:
        out[n_recv:].zero_()
    _issue(out[:n_recv], x_XD[:n_send].contiguous(), recv_splits, send_splits, group_name, kind)
    return out


@all_to_all.register_fake
def _(x_XD, send_counts_E, recv_counts_E, group_name, kind, out_rows):
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
    x_XD, send_counts_E, recv_counts_E, group_name, kind, _out_rows = inputs
    ctx.save_for_backward(send_counts_E, recv_counts_E)
    ctx.options = (group_name, kind, x_XD.shape[0])


def _a2a_bwd(ctx, grad_YD):
    send_counts_E, recv_counts_E = ctx.saved_tensors
    group_name, kind, x_rows = ctx.options
    pending = torch.ops.moe_comm.all_to_all(grad_YD.contiguous(), recv_counts_E, send_counts_E, group_name,
                                            f"{kind}_bwd", x_rows)
    return torch.ops.moe_comm.wait(pending), None, None, None, None, None


all_to_all.register_autograd(_a2a_bwd, setup_context=_a2a_setup)


# ----------------------------------------------------------------------------------------------
# equal_all_to_all: balanced, fixed-shape exchange (FSEP weight restore, HP token exchange), differentiable.
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("moe_comm::equal_all_to_all", mutates_args=())
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
    _issue(recv, send, splits, splits, group_name, kind)
    return recv


@equal_all_to_all.register_fake
def _(x_GS, group_name, kind):
    return torch.empty_like(x_GS)


def _equal_setup(ctx, inputs, output):
    ctx.group_name, ctx.kind = inputs[1], inputs[2]


def _equal_bwd(ctx, grad_GS):
    pending = torch.ops.moe_comm.equal_all_to_all(grad_GS.contiguous(), ctx.group_name, f"{ctx.kind}_bwd")
    return torch.ops.moe_comm.wait(pending), None, None


equal_all_to_all.register_autograd(_equal_bwd, setup_context=_equal_setup)


@torch.library.custom_op("moe_comm::gather_counts", mutates_args=())
def gather_counts(counts_E: Tensor, group_name: str) -> Tensor:
    """Every rank's counts, stacked: [P, E] (blocking; metadata for FSEP's placement planner)."""
    ranks = _peers(group_name)[1]
    out = counts_E.new_empty(len(ranks) * counts_E.numel())  # flat: what every backend's all_gather accepts
    record_bytes("counts", group_name, [1] * len(ranks), counts_E.numel() * counts_E.element_size())
    dist.all_gather_into_tensor(out, counts_E.contiguous().view(-1), group=_group(group_name))
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
        torch.ops._c10d_functional.wait_tensor(t)
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def _wait_impl(t: Tensor) -> Tensor:
    return _Wait.apply(t)


_lib.impl("wait", _wait_impl, "CompositeImplicitAutograd")

EXCHANGE_COUNTS = torch.ops.moe_comm.exchange_counts.default
ALL_TO_ALL = torch.ops.moe_comm.all_to_all.default
EQUAL_ALL_TO_ALL = torch.ops.moe_comm.equal_all_to_all.default
GATHER_COUNTS = torch.ops.moe_comm.gather_counts.default
WAIT = torch.ops.moe_comm.wait.default


# ----------------------------------------------------------------------------------------------
# Gradient all-reduce (expert replicas across the DP dimension), counted.
# ----------------------------------------------------------------------------------------------


def all_reduce_sum_(t: Tensor, group: dist.ProcessGroup, kind: str = "grad_allreduce") -> Tensor:
    """In-place sum over `group` (blocking, with the group's timeout). Bytes counted as a ring would
    send them: 2(n-1)/n of the payload, attributed to inter-node if the group spans nodes."""
    topology, ranks = _peers(group.group_name)
    n = len(ranks)
    if n == 1:
        return t
    payload = 2 * (n - 1) * t.numel() * t.element_size() // n
    spans_nodes = len({topology.node_of(r) for r in ranks}) > 1
    stats.record(kind, intra=0 if spans_nodes else payload, inter=payload if spans_nodes else 0)
    dist.all_reduce(t, group=group)
    return t
