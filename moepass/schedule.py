"""The schedule pass: partitioned, pipelined all-to-all and expert compute (Lina), and expert packing.

Partitioning. The EP graph of a block sends all T tokens in one dispatch, computes, and sends them
back in one combine. This pass cuts the tokens into n chunks (`torch.tensor_split`, so any T works)
and clones the region from the token permute to its inverse once per chunk:

    x_TD_c{j}, experts_TK_c{j} = tensor_split(x_TD, n)[j], tensor_split(experts_TK, n)[j]
    permute_c{j} (all chunks) -> counts_nB = stack(counts_c0 .. c{n-1})
    recv_nPL = wait(exchange_counts(counts_nB)); splits_n2P = host_splits(counts_nB, recv_nPL)   (ONCE)
    dispatch_c{j}(splits_n2P[j]) -> local permute -> expert_ffn -> combine_c{j}(splits_n2P[j] flipped)
                 -> unpermute_c{j} (K)         and   y_TKD = cat(unpermute_c0 .. c{n-1})

so the graph holds ONE count exchange and ONE host split table (the block's only host sync, reused by
every chunk's dispatch and combine and by their backward: moepass/runtime/collectives.py), n dispatch
and n combine issue nodes and 2n + 1 waits. Pipelining is the order the clones are emitted in, with
the waits moved:

    permute (all chunks), exchange counts, wait, split table | issue dispatch 0 |
    for j: [issue dispatch j+1] [wait dispatch j, expert compute j, issue combine j] |
    wait every combine, unpermute

i.e. the transfer of chunk j+1 is in flight while chunk j computes. The region's nodes are put in
those phases by which wait they depend on (counts / dispatch / combine), so the rewrite is generic
over what EP put between permute and unpermute (capacity buckets, local permute, weight views).

Backward. The all-to-all backward is pipelined by the same order: a wait's backward issues the
reverse transfer and its issue's backward waits for it (moepass/runtime/collectives.py, "Pipelined
backward"); autograd runs the backward in reverse forward order, so every chunk's combine-backward
is issued as soon as the block's output gradient exists, chunk j's is waited after chunk j+1's
expert backward, and chunk j+1's dispatch-backward is in flight while chunk j's expert backward
computes. Nothing here is specific to the backward: where the forward puts an issue or a wait sets
where the backward waits or issues.

Exactness: permute, expert FFN rows, unpermute and combine are per token, so the chunked block gives
the same outputs and input gradients bit for bit in fp32, provided the BLAS computes a row the same
way whatever the number of rows of its GEMM. On this machine's MKL that holds for GEMMs of >= 4 rows
(1-3 rows take another kernel and round differently): tests keep every expert chunk >= 4 rows.
Weight gradients sum over rows in another order: equal within rtol 1e-6.

The chunk count: `Plan(a2a_chunks=n)`, or "auto": the cost model's `optimal_chunks(transfer, compute,
alpha)` (`cost_model.schedule`) for this block with `Plan.batch` tokens per rank, priced with
`Plan.hardware` (None: this machine's calibrated figures, `cost_model.presets.this_machine`; or a
preset such as "h100"; the figures' name is recorded in the pass stats), raised if needed so that
every chunk's dispatch tensor is at most `Plan.micro_op_bytes` (Lina's micro-op size, the same knob
as the gradient all-reduce micro-ops; `micro_op_chunks`: ceil(tokens * K * D * element bytes /
micro_op_bytes) at `Plan.batch` tokens per rank, at most one chunk per token; the combine carries
the same rows back). Without `Plan.batch` there is no basis: n = 1 (recorded in the pass stats). The
count is fixed at compile time (it is the graph's structure); a batch larger than `Plan.batch` makes
larger micro-ops.

Independent work (Lancet's idea, `overlap_independent`): nodes of the block that neither depend on a
collective nor feed one (a shared expert and its gate) move between the last combine issue and the
first combine wait: they compute while the combine is in flight, and their backward (reverse order)
while the combine-backward is. Any n, also unchunked; recorded as `overlapped_nodes` in the stats.

Weight gradients (Lancet, `defer_weight_grads`): each expert FFN's weight operands go through a
`moe_sched.defer_wgrad` node placed just before its dispatch wait. The FFN's backward then returns
the input gradient only, the dispatch-backward all-to-all is issued, and the weight-gradient GEMMs
run at those nodes (moepass.dialect.WeightGradSink), in the all-to-all's flight, before the dispatch
issue's backward waits: same GEMMs on the same operands, so the gradients are the same bit for bit,
and each weight still gets its gradient once through the same autograd edges (hooks, GradientSync).
Every EP schedule, any n, and the locality form's (its exchanges are EP's; it is not chunked: `a2a_chunks` is not a
locality option); `deferred_wgrad` in the stats counts the FFNs.

Marks. The pass also places `moe_sched.mark` identity nodes: "expert_in"/"expert_out" around every
expert FFN (compute regions for the event log) and "moe_combine" before the combine (on the experts'
outputs, before the unpermute that the combine lowering fuses with it; the block's output stays a tensor of its
own, which a caller may modify in place), whose backward, after the combine's, tells the priority scheduler that
an all-to-all is imminent (moepass.runtime.scheduler).

Expert packing (`Plan(packing=k)`): each device hosts k times the experts of plain EP: the experts
span ep_size/k ranks and are replicated k times (data parallel over the replicas; the EP pass
reduces their gradients over them). Tokens for co-located experts stay local, so the all-to-all
bytes fall by exactly the rows whose expert moved onto the sender. It is applied before the EP
rewrite (`pipeline.resolve`). "auto" doubles k from 1 while the cost model says expert
compute per micro-op < transfer per micro-op (dispatch + combine share the link: t_c < 2 t_a, on
`Plan.hardware`'s figures) and the EP degree still divides. k is FIXED AT COMPILE TIME from the cost model (it needs `Plan.batch`);
there is no run-time re-packing, so no parameter or optimizer-state migration.
"""

from __future__ import annotations

import functools
import math
import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from moepass import dialect
from moepass.canonical import MoEGraphModule
from moepass.detect.capture import downstream, upstream
from moepass.errors import PlanError
from moepass.operands import operand, operands_from, set_operand
from moepass.passes import PassResult
from moepass.plan import Plan
from moepass.runtime import collectives as comm
from moepass.runtime.scheduler import COMBINE_REGION, DEFER_WGRAD, MARK
from moepass.spec import MoESpec

PASS = "schedule"
COUNTS, DISPATCH, COMBINE = 1, 2, 3  # phases: depends on the counts / dispatch / combine wait


# ----------------------------------------------------------------------------------------------
# Cost model: how many chunks, how much packing.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerTimes:
    """Forward seconds of one MoE layer on one rank: all-to-all transfer per direction, expert compute."""

    transfer: float
    compute: float
    alpha: float
    hardware: str = ""  # name of the figures priced with (`Plan.hardware`)

    def chunks(self) -> int:
        from cost_model.schedule import optimal_chunks

        return optimal_chunks(self.transfer, self.compute, self.alpha)

    def compute_bound(self, n: int) -> bool:
        """Expert compute per micro-op >= transfer per micro-op (dispatch and combine share the link)."""
        return self.compute / n >= 2 * (self.alpha + self.transfer / n)


def layer_times(spec: MoESpec, tokens: int, ep: int, ranks_per_node: int, hardware: Any = None) -> LayerTimes:
    """`hardware`: what `Plan.hardware` accepts (None: this machine's profile, else CPU defaults)."""
    from cost_model.ep import a2a_bytes, expert_flops, matmuls
    from cost_model.presets import resolve_hardware

    hw = resolve_hardware(hardware)
    x = hw.values()
    K, D, F = spec.top_k, spec.experts.hidden_dim, spec.experts.ffn_dim
    phi = spec.experts.ffn_fraction  # zero-compute experts' rows are neither sent nor computed
    intra, inter = a2a_bytes(tokens, K, D, ep, ranks_per_node, x["b"], factor=phi) if ep > 1 else (0.0, 0.0)
    transfer = intra / x["B_intra"] + inter / x["B_inter"]
    compute = expert_flops(tokens * K * phi, D, F, matmuls(spec.experts.gated)) / (x["R"] * x["eta"])
    return LayerTimes(float(transfer), float(compute), float(x["alpha"]), hw.name)


def _tokens(plan: Plan) -> int | None:
    return None if plan.batch is None else int(plan.batch[0]) * int(plan.batch[1])


def micro_op_chunks(spec: MoESpec, tokens: int, micro_op_bytes: int, element_bytes: float) -> int:
    """Fewest chunks whose dispatch tensor (the tokens * K * `ExpertsSpec.ffn_fraction` rows of D elements per rank
    that reach FFN experts, cut along tokens) is at most `micro_op_bytes` each; at most one chunk per token."""
    total = tokens * spec.top_k * spec.experts.ffn_fraction * spec.experts.hidden_dim * element_bytes
    return max(1, min(tokens, math.ceil(total / micro_op_bytes)))


def choose_chunks(spec: MoESpec, plan: Plan, ep: int, ranks_per_node: int) -> tuple[int, str]:
    if plan.a2a_chunks != "auto":
        return int(plan.a2a_chunks), "plan"
    tokens = _tokens(plan)
    if tokens is None or ep == 1:
        return 1, "auto: no Plan.batch, no basis for the cost model" if tokens is None else "auto: ep=1"
    from cost_model.presets import resolve_hardware

    times = layer_times(spec, tokens, ep, ranks_per_node, hardware=plan.hardware)
    floor = micro_op_chunks(spec, tokens, plan.micro_op_bytes, float(resolve_hardware(plan.hardware).values()["b"]))
    why = (f"auto: cost model on {times.hardware} transfer={times.transfer * 1e3:.3g} ms compute="
           f"{times.compute * 1e3:.3g} ms alpha={times.alpha * 1e6:.3g} us")
    if floor > times.chunks():
        return floor, f"{why}; raised to {floor} so each dispatch micro-op <= micro_op_bytes={plan.micro_op_bytes}"
    return times.chunks(), why


def choose_packing(spec: MoESpec, plan: Plan, ep: int, ranks_per_node: int) -> int:
    """k for `Plan(packing="auto")`: double while compute per micro-op < transfer per micro-op."""
    tokens = _tokens(plan)
    if tokens is None:
        raise PlanError(f"Plan.packing='auto' needs Plan.batch=(batch, seq) tokens per rank for the cost model "
                        f"(block {spec.path or '<root>'}); pass it, or give packing as an int.")
    k = 1
    while True:
        times = layer_times(spec, tokens, ep // k, ranks_per_node, hardware=plan.hardware)
        n = plan.a2a_chunks if isinstance(plan.a2a_chunks, int) else times.chunks()
        nxt = ep // (2 * k)
        if times.compute_bound(n) or ep % (2 * k) or nxt < 1 or spec.num_experts % nxt:
            return k
        k *= 2


def resolve_packing(spec: MoESpec, plan: Plan) -> Plan:
    """Before the EP rewrite: packing k -> experts over ep_size/k ranks (see the module doc)."""
    if plan.form != "ep" or plan.packing == 1:
        return plan
    from moepass.runtime.topology import resolve

    topology, ep = resolve(plan.topology, plan.ep_size)
    k = choose_packing(spec, plan, ep, topology.ranks_per_node) if plan.packing == "auto" else int(plan.packing)
    where = f"Plan.packing={plan.packing!r} is invalid for block {spec.path or '<root>'}"
    if ep % k:
        raise PlanError(f"{where}: packing {k} spreads the experts over ep_size/{k} ranks, and ep_size {ep} is not "
                        f"divisible by {k}; use a packing dividing {ep}.")
    if spec.num_experts % (ep // k):
        raise PlanError(f"{where}: its {spec.num_experts} experts do not split evenly over the {ep // k} ranks "
                        f"packing {k} leaves; use a packing k with {spec.num_experts} divisible by {ep}/k.")
    return plan.replace(ep_size=ep // k, packing=k)


# ----------------------------------------------------------------------------------------------
# The graph rewrite.
# ----------------------------------------------------------------------------------------------


def _calls(graph: fx.Graph, target: Any) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def _stamp(node: fx.Node, block: str, **extra: Any) -> fx.Node:
    node.meta["moepass"] = {"pass": PASS, "block": block, **extra}
    return node


def _mark_before(graph: fx.Graph, node: fx.Node, operand_name: str, name: str, block: str) -> fx.Node:
    """A mark `name` on `node`'s operand `operand_name`, which `node` then reads through it."""
    with graph.inserting_before(node):
        value = operand(node, operand_name)
        mark = _stamp(graph.create_node("call_function", MARK, (value, name), name=f"{value.name}_{name}"), block)
    set_operand(node, operand_name, mark)
    return mark


def _mark_after(graph: fx.Graph, node: fx.Node, name: str, block: str) -> fx.Node:
    with graph.inserting_after(node):
        mark = _stamp(graph.create_node("call_function", MARK, (node, name), name=f"{node.name}_{name}"), block)
    node.replace_all_uses_with(mark, delete_user_cb=lambda user: user is not mark)
    return mark


def _region(permute: fx.Node, unpermute: fx.Node) -> list[fx.Node] | None:
    """Nodes between the token permute and its inverse (both included), in graph order; None if a
    node depending on the permute escapes the region other than through the inverse."""
    down, up = downstream(permute), upstream(unpermute)
    region = down & up
    beyond = downstream(unpermute)
    if down - region - beyond:
        return None
    return [n for n in permute.graph.nodes if n in region]


def _phases(region: list[fx.Node]) -> dict[fx.Node, int]:
    inside = set(region)
    phase: dict[fx.Node, int] = {}
    for n in region:
        p = max((phase[i] for i in n.all_input_nodes if i in inside), default=0)
        if n.op == "call_function" and n.target is comm.WAIT:
            issue = operand(n, "t")
            if issue.target is comm.EXCHANGE_COUNTS:
                p = max(p, COUNTS)
            elif issue.target is comm.ALL_TO_ALL:
                p = max(p, DISPATCH if operand(issue, "kind") == "dispatch" else COMBINE)
        phase[n] = p
    return phase


def _renamed(env: dict[fx.Node, fx.Node], node: fx.Node) -> fx.Node:
    """`node`'s clone in this chunk, or `node` itself when it lies outside the chunked region."""
    return env.get(node, node)


def pipeline_order(n: int) -> list[tuple[int, int]]:
    """(phase, chunk) in emission order: see the module doc."""
    order = [(0, j) for j in range(n)] + [(COUNTS, 0)]
    for j in range(n):
        if j + 1 < n:
            order.append((COUNTS, j + 1))
        order.append((DISPATCH, j))
    return order + [(COMBINE, j) for j in range(n)]


def _shared_exchange(region: list[fx.Node]) -> tuple[fx.Node, fx.Node, fx.Node]:
    """The region's count exchange, its wait and the host split table: emitted once for every chunk."""
    exchange = [n for n in region if n.op == "call_function" and n.target is comm.EXCHANGE_COUNTS]
    if len(exchange) != 1:
        raise ValueError(f"schedule: expected one count exchange in the dispatch/combine region, found {len(exchange)}")
    waits = [u for u in exchange[0].users if u.target is comm.WAIT]
    tables = [u for w in waits for u in w.users if u.target is comm.HOST_SPLITS]
    if len(waits) != 1 or len(tables) != 1:
        raise ValueError("schedule: the count exchange must feed one wait and one moe_comm.host_splits "
                         f"(found {len(waits)} waits, {len(tables)} split tables)")
    return exchange[0], waits[0], tables[0]


def _emit_shared(graph: fx.Graph, block: str, shared: tuple[fx.Node, fx.Node, fx.Node],
                 clones: list[dict[fx.Node, fx.Node]]) -> None:
    """One count exchange of the [n, B] counts and one host split table; each chunk reads its row."""
    exchange, wait, table = shared
    counts_U, group_name = exchange.args
    assert isinstance(counts_U, fx.Node), counts_U

    def node(target: Any, args: tuple, name: str, op: str = "call_function", **extra: Any) -> fx.Node:
        return _stamp(graph.create_node(op, target, args, name=name), block, **extra)

    counts_nB = node(torch.stack, ([env[counts_U] for env in clones], 0), f"{counts_U.name}_nB")
    issued = node(comm.EXCHANGE_COUNTS, (counts_nB, group_name), f"{exchange.name}_n")
    recv_nPL = node(comm.WAIT, (issued,), f"{wait.name}_nPL")
    table_n2P = node(comm.HOST_SPLITS, (counts_nB, recv_nPL, group_name), f"{table.name}_n")
    for j, env in enumerate(clones):
        row = node(operator.getitem, (recv_nPL, j), f"{wait.name}_PL_c{j}", chunk=j)
        env[wait] = node("reshape", (row, -1), f"{wait.name}_c{j}", op="call_method", chunk=j)
        env[table] = node(operator.getitem, (table_n2P, j), f"{table.name}_c{j}", chunk=j)


def chunk_graph(gm: MoEGraphModule, n: int) -> dict[str, int]:
    """Cut the dispatch / expert compute / combine of an EP graph into n pipelined chunks (in place)."""
    graph, block = gm.graph, gm.spec.path
    dispatch = [a for a in _calls(graph, comm.ALL_TO_ALL) if operand(a, "kind") == "dispatch"]
    if len(dispatch) != 1:
        raise ValueError(f"schedule: expected one dispatch all-to-all in block {block or '<root>'}, "
                         f"found {len(dispatch)} (already chunked?)")
    permute = operand(dispatch[0], "x_XD").args[0]  # the dispatched rows: getitem 0 of the permute
    assert isinstance(permute, fx.Node) and permute.target is dialect.PERMUTE, permute
    order = [u for u in permute.users if u.args[1] == 2]
    inverses = [u for o in order for u in o.users if u.target is dialect.UNPERMUTE]
    assert len(inverses) == 1, inverses
    unpermute: fx.Node = inverses[0]
    region = _region(permute, unpermute)
    if region is None:
        raise ValueError(f"schedule: a node of block {block or '<root>'} uses the routed rows outside the "
                         "dispatch/compute/combine region; cannot chunk it")
    phase = _phases(region)
    shared = _shared_exchange(region)
    x_TD, experts_TK = operand(permute, "x_TD"), operand(permute, "experts_TK")
    clones: list[dict[fx.Node, fx.Node]] = [{} for _ in range(n)]
    with graph.inserting_before(unpermute):
        pieces = []
        for what, src in (("x_TD", x_TD), ("experts_TK", experts_TK)):
            split = _stamp(graph.create_node("call_function", torch.tensor_split, (src, n, 0), name=f"{what}_chunks"),
                           block)
            items = []
            for j in range(n):
                item = _stamp(graph.create_node("call_function", operator.getitem, (split, j), name=f"{what}_c{j}"),
                              block, chunk=j)
                items.append(item)
            pieces.append(items)
        by_phase: dict[int, list[fx.Node]] = defaultdict(list)
        for node in region:
            if node not in shared:
                by_phase[phase[node]].append(node)
        for p, j in pipeline_order(n):
            if (p, j) == (COUNTS, 0):  # every chunk's counts are known: exchange them at once
                _emit_shared(graph, block, shared, clones)
            env = clones[j]
            for node in by_phase[p]:
                if node is permute:
                    args = (pieces[0][j], pieces[1][j], *operands_from(permute, "num_experts"))
                else:
                    args = fx.map_arg(node.args, functools.partial(_renamed, env))
                kwargs = fx.map_arg(node.kwargs, functools.partial(_renamed, env))
                new = graph.create_node(node.op, node.target, args, kwargs, name=f"{node.name}_c{j}")
                env[node] = _stamp(new, block, chunk=j)
        cat = _stamp(graph.create_node("call_function", torch.cat, ([env[unpermute] for env in clones], 0),
                                       name="y_TKD_chunked"), block)
    unpermute.replace_all_uses_with(cat)
    for node in reversed(region):
        graph.erase_node(node)
    graph.lint()
    return {"region_nodes": len(region)}


def add_marks(gm: MoEGraphModule) -> int:
    """moe_sched.mark nodes around every expert FFN (see module doc); before chunking, which copies them."""
    graph, block = gm.graph, gm.spec.path
    count = 0
    for ffn in _calls(graph, dialect.EXPERT_FFN):
        _mark_before(graph, ffn, "x_ND", "expert_in", block)
        _mark_after(graph, ffn, "expert_out", block)
        count += 2
    return count


def mark_combines(gm: MoEGraphModule) -> int:
    """A moe_sched.mark node before every combine (see module doc); after chunking (one per combine)."""
    graph, block = gm.graph, gm.spec.path
    count = 0
    for combine in _calls(graph, dialect.COMBINE):
        # before it, not on its output: the block's output stays combine's own tensor (a mark's output is a view,
        # which a caller may not modify in place); before an unpermute feeding it, which the combine lowering fuses
        if operand(combine, "y_TKD").target is dialect.UNPERMUTE:
            _mark_before(graph, operand(combine, "y_TKD"), "y_ND", COMBINE_REGION, block)
        else:
            _mark_before(graph, combine, "y_TKD", COMBINE_REGION, block)
        count += 1
    return count


def overlap_independent(gm: MoEGraphModule) -> int:
    """Lancet's idea where the graph allows it: the block's work that neither depends on the token
    exchange nor feeds it (a shared expert, its gate) moves from after the combine to between the last
    combine issue and the first combine wait, so it computes while the combine is in flight (forward),
    and, by the backward's reverse order, its backward runs between the issue and the wait of the
    combine-backward. Returns how many nodes moved."""
    graph = gm.graph
    combines = [a for a in _calls(graph, comm.ALL_TO_ALL) if operand(a, "kind") == "combine"]
    pos = {node: i for i, node in enumerate(graph.nodes)}
    waits = [u for c in combines for u in c.users if u.target is comm.WAIT]
    if not combines or not waits:
        return 0
    last_issue, first_wait = max(combines, key=pos.__getitem__), min(waits, key=pos.__getitem__)
    if pos[first_wait] < pos[last_issue]:
        return 0
    exchanged, todo = set(), [n for n in graph.nodes if n.op == "call_function" and
                              getattr(n.target, "namespace", None) == comm.NAMESPACE]
    while todo:  # everything that depends on a collective of the block
        node = todo.pop()
        if node not in exchanged:
            exchanged.add(node)
            todo.extend(node.users)
    movable: dict[fx.Node, None] = {}  # in graph order
    for node in list(graph.nodes)[pos[first_wait] + 1:]:
        if (node.op in ("call_function", "call_method", "call_module") and node not in exchanged
                and not node.is_impure()
                and all(pos[i] < pos[first_wait] or i in movable for i in node.all_input_nodes)):
            movable[node] = None
    for node in movable:
        first_wait.prepend(node)
        node.meta.setdefault("moepass", {})["overlaps"] = "combine"
    return len(movable)


def _dispatch_wait(ffn: fx.Node) -> fx.Node | None:
    """The wait of the dispatch all-to-all whose rows the expert FFN computes (None: no such wait)."""
    seen, todo = set(), [operand(ffn, "x_ND")]
    while todo:
        node = todo.pop()
        if not isinstance(node, fx.Node) or node in seen:
            continue
        seen.add(node)
        if node.target is comm.WAIT:
            issue = operand(node, "t")
            if isinstance(issue, fx.Node) and issue.target is comm.ALL_TO_ALL and operand(issue, "kind") == "dispatch":
                return node
        todo.extend(node.all_input_nodes)
    return None


def _hoist_before(anchor: fx.Node, node: fx.Node) -> bool:
    """Move `node` and its ancestors that come after `anchor` to just before it, if none of them is
    `anchor` or a collective (a weight view made after the dispatch wait); False where impossible."""
    pos = {n: i for i, n in enumerate(anchor.graph.nodes)}
    later, todo = set(), [node]
    while todo:
        n = todo.pop()
        if pos[n] > pos[anchor] and n not in later:
            later.add(n)
            todo.extend(n.all_input_nodes)
    if anchor in later or any(n.op == "placeholder" or getattr(n.target, "namespace", None) == comm.NAMESPACE
                              for n in later) or any(anchor in n.all_input_nodes for n in later):
        return False
    for n in sorted(later, key=pos.__getitem__):
        anchor.prepend(n)
    return True


def defer_weight_grads(gm: MoEGraphModule) -> int:
    """Lancet: every expert FFN's weight operands pass through `moe_sched.defer_wgrad`, placed just
    before the wait of the FFN's dispatch all-to-all. Autograd runs ready nodes latest-created first,
    so in the backward: the FFN gives grad_x (its weight GEMMs left at the sinks), the dispatch wait's
    backward issues the dispatch-backward all-to-all, then the sinks' nodes (created just before that
    wait) run the weight GEMMs while it is in flight, before the dispatch issue's backward waits for
    it. A weight view made after that wait (unchunked EP's `local_shard`) moves before it with its
    inputs; an FFN whose weight operand depends on a collective (FSEP's restored shards) is left as it
    is. Returns how many FFNs defer."""
    graph, block = gm.graph, gm.spec.path
    count = 0
    for ffn in _calls(graph, dialect.EXPERT_FFN):
        wait = _dispatch_wait(ffn)
        weights = [(i, a) for i, a in enumerate(ffn.args) if 2 <= i < 8 and isinstance(a, fx.Node)]
        if wait is None or not weights or not all(_hoist_before(wait, a) for _, a in weights):
            continue
        args = list(ffn.args)
        for i, weight in weights:
            with graph.inserting_before(wait):
                args[i] = _stamp(graph.create_node("call_function", DEFER_WGRAD, (weight,),
                                                   name=f"{weight.name}_wgrad_{ffn.name}"), block)
        ffn.args = tuple(args)
        count += 1
    return count


def schedule_pass(gm: MoEGraphModule, plan: Plan) -> PassResult:
    """Chunk and pipeline the block's all-to-all and expert compute; place the scheduler's marks."""
    layout = gm.layout
    if gm.form not in ("ep", "fsep", "locality") or layout is None:
        why = "its all-to-alls are not chunked or scheduled" if gm.form == "hp" else "no all-to-all to schedule"
        return PassResult(gm, changed=False, stats={"reason": f"form {gm.form!r}: {why}"})
    if gm.form == "locality":  # its exchanges are EP's; not chunked (a2a_chunks is not a locality option)
        n, why = 1, "locality: not chunked"
    else:
        n, why = choose_chunks(gm.spec, plan, layout.groups.ep_size, layout.groups.topology.ranks_per_node)
    if plan.hierarchical_a2a and n > 1:  # chunking handles the flat exchange only (Plan refuses an int > 1)
        n, why = 1, f"hierarchical_a2a: not chunked ({why}: {n} chunks)"
    stats: dict[str, Any] = {"chunks": n, "chunks_from": why, "packing": plan.packing,
                             "ep_size": layout.groups.ep_size}
    stats["marks"] = add_marks(gm)
    if n > 1:
        stats.update(chunk_graph(gm, n))
    stats["marks"] += mark_combines(gm)
    stats["overlapped_nodes"] = overlap_independent(gm)
    stats["deferred_wgrad"] = defer_weight_grads(gm)
    counts = {name: len(_calls(gm.graph, t)) for name, t in
              (("exchange_counts", comm.EXCHANGE_COUNTS), ("all_to_all", comm.ALL_TO_ALL), ("wait", comm.WAIT))}
    stats.update(counts)
    gm.recompile()
    return PassResult(gm, changed=True, stats=stats)


