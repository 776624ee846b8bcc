"""The token exchange every distributed form puts around its expert compute (EP, FSEP).

A form that computes experts on other ranks replaces the canonical `moe.expert_ffn` node by

    x_ND, counts_U, order_N = moe.permute(x_TD, buckets_TK, U)        # the canonical permute, re-keyed
    recv_counts_U = wait(moe_comm.exchange_counts(counts_U))          # metadata all-to-all
    splits_2P     = moe_comm.host_splits(counts_U, recv_counts_U)     # the one host sync (rows per peer)
    x_RD          = wait(moe_comm.all_to_all(x_ND, counts_U, recv_counts_U, "dispatch", splits_2P))
    ids_R1        = moe_ep.local_expert_ids(recv_counts_U, L, R)      # rows arrive (source, bucket)-major
    x_MD, counts_L, order_R = moe.permute(x_RD, ids_R1, L)            # ... sort them bucket-major
    y_MD          = moe.expert_ffn(x_MD, counts_L, <the form's L local experts>)
    y_RD          = moe.unpermute(y_MD, order_R, 1)
    y_ND          = wait(moe_comm.all_to_all(y_RD, recv_counts_U, counts_U, "combine", out_rows=N,
                                         splits_2P.flip(0)))

Generic experts (`ExpertsSpec.kind="generic"`) put `generic_experts.run_experts` where `moe.expert_ffn` is:
the same rows, the local experts' counts and tensors; everything around it is the same.

The split table is read on the host once per block and step and reused by the combine and by both
backward exchanges (moepass/runtime/collectives.py); the schedule pass keeps one count exchange and
one table for all its chunks.

U = P*L buckets, L per rank of the P-rank group: EP's buckets are experts, FSEP's are expert slots.
What a form decides is how assignments map to buckets (`route`) and where the L local experts' weights
come from (`weights`). Capacity-dropped assignments go to an extra bucket U that is never sent.

Gradient convention (DDP's): an expert weight's gradient is that of the mean of the W ranks' local
losses. The dispatch/combine backward sums every rank's contribution; `grad_scale` nodes divide the
expert-weight gradients by W on the rows (the output gradient / W, the input gradient * W) rather than
on every weight.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import Tensor, fx

from moepass import dialect, eager, generic_experts
from moepass.canonical import GraphBuilder, MoEGraphModule
from moepass.errors import PlanError
from moepass.operands import operand, operands_from
from moepass.plan import Plan
from moepass.runtime import collectives as comm
from moepass.runtime import hierarchical as hier
from moepass.runtime.topology import EPGroups, NodeGroups, node_groups


@eager.custom_op("moe_ep::local_expert_ids", mutates_args=())
def local_expert_ids(recv_counts_E: Tensor, num_local: int, rows: int) -> Tensor:
    """Local bucket of each received row: rows arrive grouped by (source rank, local bucket)."""
    ids_E = torch.arange(recv_counts_E.shape[0], device=recv_counts_E.device) % num_local
    return torch.repeat_interleave(ids_E, recv_counts_E, output_size=rows).unsqueeze(1)


@local_expert_ids.register_fake
def _(recv_counts_E, num_local, rows):
    return recv_counts_E.new_empty((rows, 1), dtype=torch.int64)


LOCAL_EXPERT_IDS = torch.ops.moe_ep.local_expert_ids.default


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * ctx.scale, None


def grad_scale(x: Tensor, scale: float) -> Tensor:
    """Identity forward; the backward multiplies the gradient by `scale` (exact when it is a power of two,
    else within one rounding)."""
    return _GradScale.apply(x, scale)


def only(graph: fx.Graph, target: object, what: str) -> fx.Node:
    """The single `target` node of a canonical graph (a rewrite's anchor)."""
    found = [n for n in graph.nodes if n.op == "call_function" and n.target is target]
    if len(found) != 1:
        raise ValueError(f"the rewrite expects exactly one {what} node in the canonical graph, found {len(found)}")
    return found[0]


def named(graph: fx.Graph, name: str) -> fx.Node:
    """The canonical graph's node `name` (a rewrite's anchor by name, e.g. "y_TQ")."""
    for n in graph.nodes:
        if n.name == name:
            return n
    raise ValueError(f"the rewrite expects a node {name!r} in the canonical graph")


def expert_compute_node(graph: fx.Graph) -> fx.Node:
    """The canonical graph's one expert compute node: `moe.expert_ffn`, or `generic_experts.run_experts`
    for experts that are not a known FFN (same rows and counts in, same rows out)."""
    generic = [n for n in graph.nodes if n.op == "call_function" and n.target is generic_experts.run_experts]
    return generic[0] if len(generic) == 1 else only(graph, dialect.EXPERT_FFN, "moe.expert_ffn")


Weights = Callable[[], list[fx.Node | None]]


def insert_exchange(gm: MoEGraphModule, b: GraphBuilder, *, buckets: int, local: int, group_name: str, world: int,
                    route: Callable[[fx.Node], fx.Node] | None, issue_weights: Callable[[], Weights],
                    axis: str = "E", keep: fx.Node | None = None, hierarchy: NodeGroups | None = None) -> dict[str, int | str]:
    """Replace `gm`'s expert compute by dispatch / local compute / combine (in place; see module doc).

    The form's hooks add their nodes where they are called: `route(experts_TK)`, before the permute,
    maps each assignment to its bucket (None: the expert is the bucket; dropped assignments reach it as
    expert id E); `issue_weights()`, right after the dispatch is issued (communication a form needs for
    its weights starts behind the token exchange), returns `weights()`, called just before the local
    expert compute, which makes the six weight operands. `axis` names the bucket axis in node names.
    `keep` is the capacity mask [T, K] of a form that computes its own (locality's floor capacity);
    None: the graph's `moe.capacity_keep`, if any. `hierarchy` (`hierarchy_of`): the dispatch and combine
    as the two-stage hierarchical all-to-all (`split_by_node`); None: flat.
    """
    graph, E = gm.graph, gm.spec.num_experts
    b.graph = graph
    permute = only(graph, dialect.PERMUTE, "moe.permute")
    ffn = expert_compute_node(graph)
    keeps = [keep] if keep is not None else [
        n for n in graph.nodes if n.op == "call_function" and n.target is dialect.CAPACITY_KEEP]
    x_ND, counts = operand(ffn, "x_ND"), operand(ffn, "counts_E")
    x_TD, experts_TK, slots = (operand(permute, name) for name in ("x_TD", "experts_TK", "num_experts"))
    assert isinstance(experts_TK, fx.Node) and isinstance(x_ND, fx.Node) and isinstance(slots, int), permute.args
    zero_compute = slots - E  # slots past the FFN experts (identity / zero experts): sorted last, never sent
    if zero_compute and (route is not None or keeps):
        raise PlanError(f"block {gm.spec.path or '<root>'!r} has identity / zero experts, which this form does not "
                        f"support (its buckets are not the FFN experts, or it drops by capacity): use form='ep' "
                        f"without capacity, or leave the block alone.")
    if zero_compute:  # the dispatch sends the FFN rows, the leading ones: no host read of their count here
        x_ND = x_ND.args[0]
        assert isinstance(x_ND, fx.Node)

    with graph.inserting_before(permute):
        if keeps:  # dropped assignments go to bucket E (then B), sorted last and never sent
            experts_TK = b.fn(torch.where, keeps[0], experts_TK, E, name="experts_kept_TK")
        buckets_TK = experts_TK if route is None else route(experts_TK)
    permute.args = (x_TD, buckets_TK, buckets + 1 if keeps else buckets + zero_compute)

    with graph.inserting_before(ffn):
        counts_U = b.fn(operator.getitem, counts, slice(0, buckets), name=f"send_counts_{axis}") if keeps else counts
        recv_counts = b.fn(comm.WAIT, b.fn(comm.EXCHANGE_COUNTS, counts_U, group_name, name="exchange_counts"),
                           name=f"recv_counts_{axis}")
        splits_2P = b.fn(comm.HOST_SPLITS, counts_U, recv_counts, group_name, name="splits_2P")
        back_2P = b.method("flip", splits_2P, 0, name="combine_splits_2P")
        dispatch = b.fn(comm.ALL_TO_ALL, x_ND, counts_U, recv_counts, group_name, "dispatch", -1, splits_2P,
                        name="dispatch")
        weights = issue_weights()
        x_RD = b.fn(comm.WAIT, dispatch, name="x_RD")
        rows_R = b.method("size", x_RD, 0, name="rows_R")
        ids_R1 = b.fn(LOCAL_EXPERT_IDS, recv_counts, local, rows_R, name="local_experts_R1")
        sorted_ = b.fn(dialect.PERMUTE, x_RD, ids_R1, local, name="local_permute")
        x_MD, counts_L, order_R = b.item(sorted_, 0, "x_MD"), b.item(sorted_, 1, "counts_L"), b.item(sorted_, 2,
                                                                                                     "order_R")
        local_weights = weights()
        if world > 1:  # expert-weight gradients / W, the input gradient unchanged (see grad_scale)
            x_MD = b.fn(grad_scale, x_MD, float(world), name="x_MD_grad_times_W")
        if ffn.target is dialect.EXPERT_FFN:
            y_MD = b.fn(dialect.EXPERT_FFN, x_MD, counts_L, *local_weights, *operands_from(ffn, "activation"),
                        name="y_MD")
        else:  # generic experts: the same template and tensor names, the local experts' tensors
            y_MD = b.fn(ffn.target, x_MD, counts_L, operand(ffn, "template"), operand(ffn, "names"),
                        *local_weights, name="y_MD")
        if world > 1:
            y_MD = b.fn(grad_scale, y_MD, 1.0 / world, name="y_MD_grad_over_W")
        y_R1D = b.fn(dialect.UNPERMUTE, y_MD, order_R, 1, name="y_R1D")
        y_RD = b.method("flatten", y_R1D, 0, 1, name="y_RD")
        rows_N = b.method("size", x_ND, 0, name="rows_N")
        y_ND = b.fn(comm.WAIT, b.fn(comm.ALL_TO_ALL, y_RD, recv_counts, counts_U, group_name, "combine", rows_N,
                                    back_2P, name="combine"), name="y_ND_combined")
    ffn.replace_all_uses_with(y_ND)
    graph.erase_node(ffn)  # its weight reads are now dead: dropped when the pass's effects are applied
    if hierarchy is not None:
        split_by_node(graph, b, hierarchy)
    c = gm.spec.capacity
    capacity = (f"factor {c.capacity_factor:g} per (source rank, expert)" if c is not None and c.fixed is None
                else "its own" if keeps else "none (dropless)")
    return {"experts": E, "buckets": buckets, "local_buckets": local, "capacity": capacity}


def hierarchy_of(plan: Plan, groups: EPGroups) -> NodeGroups | None:
    """The node groups of the hierarchical exchange when the plan asks for it (`Plan.hierarchical_a2a`)."""
    return node_groups(groups) if plan.hierarchical_a2a else None


def split_by_node(graph: fx.Graph, b: GraphBuilder, hierarchy: NodeGroups) -> None:
    """Replace the flat dispatch and combine by the hierarchical all-to-all (in place):

        node_counts   = wait(moe_comm.exchange_counts(node_count_totals(counts_U, recv_counts_U), intra))
        node_splits   = moe_comm.node_split_table(counts_U, recv_counts_U, node_counts)   # the one host sync
        x_staged_ND   = wait(moe_comm.intra_node_all_to_all(x_ND, node_splits[0], intra, "dispatch"))
        dispatch      = moe_comm.inter_node_all_to_all(x_staged_ND, node_splits[0], inter, "dispatch")
        ...
        y_staged_ND   = wait(moe_comm.intra_node_all_to_all(y_RD, node_splits[1], intra, "combine"))
        combine       = moe_comm.inter_node_all_to_all(y_staged_ND, node_splits[1], inter, "combine", out_rows=N)

    The result is the flat exchange's, row for row; the flat nodes' waits now wait for stage 2 (on the staged
    rows stage 1 gathered). What only the flat nodes used (their split table) is dead and dropped with the
    pass's effects."""
    flat = {operand(n, "kind"): n for n in graph.nodes if n.op == "call_function" and n.target is comm.ALL_TO_ALL}
    dispatch, combine = flat["dispatch"], flat["combine"]
    counts_U, recv_counts = operand(dispatch, "send_counts_E"), operand(dispatch, "recv_counts_E")
    intra, inter = hierarchy.intra_group.group_name, hierarchy.inter_group.group_name
    with graph.inserting_before(dispatch):
        totals = b.fn(hier.node_count_totals, counts_U, recv_counts, hierarchy.nodes, hierarchy.ranks_per_node,
                      name="node_count_totals")
        node_counts = b.fn(comm.WAIT, b.fn(comm.EXCHANGE_COUNTS, totals, intra, name="exchange_node_counts"),
                           name="node_counts")
        tables = b.fn(hier.NODE_SPLIT_TABLE, counts_U, recv_counts, node_counts, hierarchy.nodes, name="node_splits")
    for row, (kind, a2a) in enumerate((("dispatch", dispatch), ("combine", combine))):
        x, out_rows = operand(a2a, "x_XD"), operand(a2a, "out_rows")
        with graph.inserting_before(a2a):
            table = b.fn(operator.getitem, tables, row, name=f"{kind}_node_splits")
            staged = b.fn(hier.INTRA_NODE_ALL_TO_ALL, x, table, intra, kind, -1, name=f"{kind}_intra")
            x_staged_ND = b.fn(comm.WAIT, staged, name=f"{kind}_staged_ND")
            stage2 = b.fn(hier.INTER_NODE_ALL_TO_ALL, x_staged_ND, table, inter, kind, out_rows, name=f"{kind}_inter")
        a2a.replace_all_uses_with(stage2)
        graph.erase_node(a2a)
