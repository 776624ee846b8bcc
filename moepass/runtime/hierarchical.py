"""The hierarchical (2D) all-to-all (`Plan(hierarchical_a2a=True)`): the token exchange of an EP group that
spans several nodes in two stages, intra-node then inter-node, as `moe_comm` ops built on
`moepass.runtime.collectives` (its issue/wait pairs, byte counts and checks).

    node_split_table(send_counts_B, recv_counts_B, node_counts, nodes) -> splits_2S (CPU; its host sync, no grad)
    intra_node_all_to_all(x_XD, splits_S, intra_group, kind, out_rows) -> x_SD   (issue; stage 1)
    inter_node_all_to_all(x_SD, splits_S, inter_group, kind, out_rows) -> y_YD   (issue; stage 2 = the flat result)
    node_all_to_all_backward(grad, splits_S, group, stage, kind, out_rows)        (a stage's reverse, blocking)

With it the block's host sync is `node_split_table` (the flat split table is not made): one device -> host
copy of [2, 3P] ints that every stage of the dispatch and the combine, and their backward, read from host
memory. Shape legend: B = P*L buckets blocked by peer, S split-table entries, X/Y/D rows and width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from moepass.runtime import collectives as comm

# ----------------------------------------------------------------------------------------------
# Hierarchical (2D) all-to-all: the variable-split token exchange of an EP group that spans n nodes of
# r ranks in two stages, so every row crosses the slow inter-node links once and each rank sends n-1
# inter-node messages (each aggregating the rows of its whole node) instead of P-r small ones.
#
#   group-local rank p = a*r + i (node a, local index i); B = P*L buckets blocked by peer, as above.
#   stage 1 "intra" (group: the r ranks of the node): rank (a,i) sends to (a,j) every row it has for
#           local rank j of any node b, node-major: (b, j) blocks in order b = 0..n-1.
#   stage 2 "inter" (group: the n ranks (b,j) sharing local index j): rank (a,j) sends to (b,j) the rows
#           its node's ranks (a,i) have for (b,j), source-major: i = 0..r-1.
#   The receiver (b,j) gets them from a = 0..n-1, each i = 0..r-1, each bucket-sorted: source order p =
#   a*r + i, exactly the flat all_to_all's output. Rows for the own node go intra in stage 1 and "self"
#   in stage 2; rows for another node go "self" or intra in stage 1 and inter in stage 2, once.
#
# The intermediate rank (a,j) must know how many rows each (a,i) has for each (b,j) (its node counts
# M[i, b]): one small equal-split `exchange_counts` of `node_count_totals` on the intra group, for the
# dispatch and the combine together. `node_split_table` then reads everything the four stages (and their
# backward) need on the host at once: one host sync per block and step.
# ----------------------------------------------------------------------------------------------

STAGES = ("intra", "inter")


def node_count_totals(send_counts_B: Tensor, recv_counts_B: Tensor, nodes: int, ranks_per_node: int) -> Tensor:
    """What a rank tells each rank of its node before the hierarchical exchanges of a block: [r*2*n] ints,
    block j (2n entries) = the rows it sends to (b, j), b < n, in the dispatch, then in the combine (the rows
    it received from (b, j)). `exchange_counts` over the intra-node group delivers block j to local rank j."""
    both_2NR = torch.stack([send_counts_B, recv_counts_B]).view(2, nodes, ranks_per_node, -1).sum(3)
    return both_2NR.permute(2, 0, 1).reshape(-1)


def _node_geometry(node_counts: Tensor, nodes: int) -> tuple[int, int]:
    """(P, r) of an exchanged `node_count_totals` vector [r*2n]."""
    r = node_counts.shape[0] // (2 * nodes)
    return r * nodes, r


@torch.library.custom_op("moe_comm::node_split_table", mutates_args=())
def node_split_table(send_counts_B: Tensor, recv_counts_B: Tensor, node_counts: Tensor, nodes: int) -> Tensor:
    """THE SYNC POINT of the hierarchical exchange: one device -> host copy of every split its stages need,
    [2, 3P] int64 on the CPU (P = r*n ranks): row 0 the dispatch's [rows sent per peer (P), rows received per
    peer (P), M (r*n, M[i*n + b]: rows local rank i of this node has for (b, this rank's local index))],
    row 1 the combine's (sent and received swapped, its own M). `node_counts`: the exchanged
    `node_count_totals` (block i from local rank i)."""
    P, r = _node_geometry(node_counts, nodes)
    if r * nodes * 2 != node_counts.shape[0] or send_counts_B.shape[0] % P:
        raise ValueError(f"moe_comm.node_split_table: {node_counts.shape[0]} node counts and {send_counts_B.shape[0]} "
                         f"counts do not fit {nodes} nodes")
    send_P, recv_P = send_counts_B.view(P, -1).sum(1), recv_counts_B.view(P, -1).sum(1)
    m_R2N = node_counts.view(r, 2, nodes)
    table_2S = torch.stack([torch.cat([send_P, recv_P, m_R2N[:, 0].reshape(-1)]),
                            torch.cat([recv_P, send_P, m_R2N[:, 1].reshape(-1)])])
    return table_2S.to("cpu", torch.int64)


@node_split_table.register_fake
def _(send_counts_B, recv_counts_B, node_counts, nodes):
    P, _ = _node_geometry(node_counts, nodes)
    return torch.empty((2, 3 * P), dtype=torch.int64, device="cpu")


@dataclass(frozen=True)
class StageSplits:
    """One stage on this rank, in Python ints: the input's row blocks (`sizes`, in input order), the order
    they are sent in (grouped by peer: `order[g*w:(g+1)*w]` go to peer g), rows per peer sent / received."""

    sizes: list[int]
    order: list[int]
    send: list[int]
    recv: list[int]

    @property
    def arrived_sizes(self) -> list[int]:
        """Block sizes in the order they are sent (and, in the reverse exchange, arrive)."""
        return [self.sizes[k] for k in self.order]


def stage_splits(stage: str, table_S: Tensor, peers: int) -> StageSplits:
    """A stage's splits from its direction's row of `node_split_table` (host memory: no device sync)."""
    if stage not in STAGES:
        raise ValueError(f"moe_comm hierarchical stage {stage!r} is invalid: use one of {list(STAGES)}")
    if table_S.device.type != "cpu" or table_S.dim() != 1 or table_S.shape[0] % (3 * peers):
        raise ValueError(f"moe_comm hierarchical {stage}: the split table must be a row of node_split_table (a CPU "
                         f"vector of 3*P entries, P a multiple of the group's {peers} ranks), got "
                         f"{tuple(table_S.shape)} on {table_S.device}")
    values = [int(v) for v in table_S.tolist()]
    P = len(values) // 3
    r, n = (peers, P // peers) if stage == "intra" else (P // peers, peers)
    sent_P, received_P, m = values[:P], values[P:2 * P], values[2 * P:]
    if stage == "intra":  # input blocks: destination p = b*r + j (flat order); sent to local rank j, node-major
        sizes, order = sent_P, [b * r + j for j in range(r) for b in range(n)]
        recv = [sum(m[i * n:(i + 1) * n]) for i in range(r)]
    else:  # input blocks: (i, b) as stage 1 delivered them; sent to node b, source-major
        sizes, order = m, [i * n + b for b in range(n) for i in range(r)]
        recv = [sum(received_P[a * r:(a + 1) * r]) for a in range(n)]
    width = len(order) // peers
    send = [sum(sizes[k] for k in order[g * width:(g + 1) * width]) for g in range(peers)]
    return StageSplits(sizes, order, send, recv)


def _stage_issue(stage: str, x_XD: Tensor, table_S: Tensor, group_name: str, kind: str, out_rows: int) -> Tensor:
    """Forward stage: reorder the input's blocks into send order, issue the exchange (see `collectives.issue`)."""
    splits = stage_splits(stage, table_S, len(comm.peers_of(group_name)))
    n_in, n_recv = sum(splits.sizes), sum(splits.recv)
    if n_in > x_XD.shape[0]:
        raise ValueError(f"moe_comm.{stage}_node_all_to_all[{kind}]: counts send {n_in} rows, x has {x_XD.shape[0]}")
    rows = n_recv if out_rows < 0 else out_rows
    if rows < n_recv:
        raise ValueError(f"moe_comm.{stage}_node_all_to_all[{kind}]: out_rows={out_rows} < {n_recv} rows received")
    blocks = x_XD[:n_in].split(splits.sizes)
    send = torch.cat([blocks[k] for k in splits.order])
    out = x_XD.new_empty((rows, *x_XD.shape[1:]))
    if rows > n_recv:
        out[n_recv:].zero_()
    comm.issue(out[:n_recv], send, splits.recv, splits.send, group_name, f"{kind}_{stage}", key=out)
    return out


def _fake_rows(x_XD: Tensor, out_rows: int) -> Tensor:
    """The fake output of a variable-split exchange (see the module doc on fake implementations)."""
    if out_rows >= 0:
        return x_XD.new_empty((out_rows, *x_XD.shape[1:]))
    ctx = torch.library.get_ctx()
    rows: int | torch.SymInt
    try:
        rows = ctx.new_dynamic_size()
    except DynamicOutputShapeException:
        if getattr(ctx, "_shape_env", None) is not None:
            raise  # Dynamo without dynamic output shapes: graph-break here (as all_to_all)
        rows = x_XD.shape[0]
    return x_XD.new_empty((rows, *x_XD.shape[1:]))


@torch.library.custom_op("moe_comm::intra_node_all_to_all", mutates_args=())
def intra_node_all_to_all(x_XD: Tensor, table_S: Tensor, group_name: str, kind: str, out_rows: int) -> Tensor:
    """Stage 1 of the hierarchical exchange (issue; group: this node's ranks): x's first rows (as many as the
    table says this rank sends), blocked by destination as `all_to_all`'s, go to the local rank of their
    destination. Returns the rows of every local rank i for this rank's counterparts (b, j), (i, b)-major:
    stage 2's input. `table_S`: this direction's row of `node_split_table`."""
    return _stage_issue("intra", x_XD, table_S, group_name, kind, out_rows)


@torch.library.custom_op("moe_comm::inter_node_all_to_all", mutates_args=())
def inter_node_all_to_all(x_SD: Tensor, table_S: Tensor, group_name: str, kind: str, out_rows: int) -> Tensor:
    """Stage 2 of the hierarchical exchange (issue; group: the ranks of this local index on every node): the
    rows stage 1 gathered go to their destination's node. Returns what the flat `all_to_all` returns: the
    received rows in source order (or `out_rows` rows with a zero tail)."""
    return _stage_issue("inter", x_SD, table_S, group_name, kind, out_rows)


@intra_node_all_to_all.register_fake
def _(x_XD, table_S, group_name, kind, out_rows):
    return _fake_rows(x_XD, out_rows)


@inter_node_all_to_all.register_fake
def _(x_SD, table_S, group_name, kind, out_rows):
    return _fake_rows(x_SD, out_rows)


@torch.library.custom_op("moe_comm::node_all_to_all_backward", mutates_args=())
def node_all_to_all_backward(grad_YD: Tensor, table_S: Tensor, group_name: str, stage: str, kind: str,
                             out_rows: int) -> Tensor:
    """The reverse of a stage (blocking: issued and waited here, as the flat exchange's backward is when
    traced): every received row's gradient goes back to the rank it came from and the blocks are put back
    in the stage's input order; `out_rows` rows (the forward input's) with a zero tail."""
    splits = stage_splits(stage, table_S, len(comm.peers_of(group_name)))
    n_in, n_back = sum(splits.recv), sum(splits.sizes)
    back = grad_YD.new_empty((n_back, *grad_YD.shape[1:]))
    comm.issue(back, grad_YD[:n_in].contiguous(), splits.send, splits.recv, group_name, f"{kind}_{stage}")
    back = comm.WAIT(back)
    arrived = back.split(splits.arrived_sizes)
    position = {k: pos for pos, k in enumerate(splits.order)}
    out = grad_YD.new_zeros((out_rows, *grad_YD.shape[1:]))
    out[:n_back] = torch.cat([arrived[position[k]] for k in range(len(splits.sizes))])
    return out


@node_all_to_all_backward.register_fake
def _(grad_YD, table_S, group_name, stage, kind, out_rows):
    return grad_YD.new_empty((out_rows, *grad_YD.shape[1:]))


def _stage_setup(ctx, inputs, output):
    x, table_S, group_name, kind, _out_rows = inputs
    ctx.save_for_backward(table_S)
    ctx.options = (group_name, kind, x.shape[0])


def _stage_bwd(stage: str):
    def backward(ctx, grad_YD):
        (table_S,) = ctx.saved_tensors
        group_name, kind, x_rows = ctx.options
        grad = torch.ops.moe_comm.node_all_to_all_backward(grad_YD.contiguous(), table_S, group_name, stage,
                                                           f"{kind}_bwd", x_rows)
        return grad, None, None, None, None

    return backward


intra_node_all_to_all.register_autograd(_stage_bwd("intra"), setup_context=_stage_setup)
inter_node_all_to_all.register_autograd(_stage_bwd("inter"), setup_context=_stage_setup)

NODE_SPLIT_TABLE = torch.ops.moe_comm.node_split_table.default
INTRA_NODE_ALL_TO_ALL = torch.ops.moe_comm.intra_node_all_to_all.default
INTER_NODE_ALL_TO_ALL = torch.ops.moe_comm.inter_node_all_to_all.default
NODE_ALL_TO_ALL_BACKWARD = torch.ops.moe_comm.node_all_to_all_backward.default


def hierarchical_all_to_all(x_XD: Tensor, table_S: Tensor, intra_group: str, inter_group: str, kind: str,
                            out_rows: int = -1) -> Tensor:
    """Eager composition: what the flat `all_to_all` + wait returns, in two stages (each issued and waited).
    `table_S`: the direction's row of `node_split_table` (0: the counts as given, 1: swapped)."""
    staged = comm.WAIT(intra_node_all_to_all(x_XD, table_S, intra_group, kind, -1))
    return comm.WAIT(inter_node_all_to_all(staged, table_S, inter_group, kind, out_rows))
