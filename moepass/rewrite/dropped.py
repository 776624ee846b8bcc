"""Capacity-dropped assignments skip the experts (form="single", the graph run as it is).

The canonical graph of a block with an expert capacity (`MoESpec.capacity`: Switch, GShard) computes every
assignment's expert output and zeroes the dropped ones through their weight (`weights_TK * keep_TK`), so its
experts do the arithmetic of a dropless block. The block it replaces computes only what it keeps: Switch
Transformers at capacity 8 per expert and sequence runs its experts on 128 of 512 tokens (issue 29, item 8:
1.86x the original's forward+backward before this pass). Here the dropped assignments take the zero slot of
the zero-compute layout (`canonical.routed_experts`, `row_ops`; a spec has capacity or zero-compute experts,
never both):

    slots_TK = where(keep_TK, experts_TK, E + 1)
    x_ND, counts_J, order_N = moe.permute(x_TD, slots_TK, E + 2)    # kept rows first, by expert; dropped last
    x_MD = ffn_rows(x_ND, counts_J[:E]);  y_MD = moe.expert_ffn(x_MD, counts_J[:E], ...)
    y_ND = padded_rows(y_MD, x_ND)                                  # the dropped rows: zero

The values are the graph's: a dropped assignment's output was zero through its zero weight and is zero now,
the kept rows are the same rows in the same order (their GEMMs may round differently over fewer rows), and no
gradient reached a dropped row's input (its output gradient was zero times its weight). `ffn_rows` reads the
kept count on the host, once per block and step (on CUDA a device sync, as for zero-compute experts), so the
pass runs where the graph runs as it is (`moepass.compile`), not on a graph handed to an inner compiler
(`torch.compile(backend="moepass")`: `compile_block(traced=True)`), whose shapes must not depend on data.
The distributed forms drop before their exchange instead (`rewrite.exchange`: a bucket that is never sent).
"""

from __future__ import annotations

import operator

import torch

from moepass import dialect
from moepass.canonical import GraphBuilder, MoEGraphModule
from moepass.operands import operand, set_operand
from moepass.passes import PassResult
from moepass.plan import Plan
from moepass.rewrite.exchange import expert_compute_node, only
from moepass.row_ops import ffn_rows, padded_rows

PASS = "skip_dropped"


def skip_dropped_pass(gm: MoEGraphModule, plan: Plan) -> PassResult:
    skipped = skip_dropped(gm)
    return PassResult(gm, changed=bool(skipped), stats={"capacity_masks": skipped})


def skip_dropped(gm: MoEGraphModule) -> int:
    """Route the capacity-dropped assignments of `gm` around its experts (module doc); returns how many
    capacity masks now do (0: no capacity, or a graph whose experts' rows are not the permute's own)."""
    graph = gm.graph
    keeps = [n for n in graph.nodes if n.op == "call_function" and n.target is dialect.CAPACITY_KEEP]
    if len(keeps) != 1:
        return 0
    permute, ffn = only(graph, dialect.PERMUTE, "moe.permute"), expert_compute_node(graph)
    experts_TK, E = operand(permute, "experts_TK"), operand(permute, "num_experts")
    items = {user.args[1]: user for user in permute.users if user.target is operator.getitem}
    x_ND, counts = items.get(0), items.get(1)
    if (counts is None or not isinstance(E, int) or operand(ffn, "counts_E") is not counts
            or operand(ffn, "x_ND") is not x_ND or set(counts.users) != {ffn}):
        return 0
    b = GraphBuilder(PASS, gm.spec.path)
    b.graph = graph
    with graph.inserting_before(permute):
        slots_TK = b.fn(torch.where, keeps[0], experts_TK, E + 1, name="slots_TK")
    set_operand(permute, "experts_TK", slots_TK)
    set_operand(permute, "num_experts", E + 2)
    with graph.inserting_before(ffn):
        counts_E = b.fn(operator.getitem, counts, slice(0, E), name="kept_counts_E")
        x_MD = b.fn(ffn_rows, x_ND, counts_E, name="x_MD")
    set_operand(ffn, "x_ND", x_MD)
    set_operand(ffn, "counts_E", counts_E)
    with graph.inserting_after(ffn):
        y_ND = b.fn(padded_rows, ffn, x_ND, name="y_ND_dropped_zero")
    ffn.replace_all_uses_with(y_ND, delete_user_cb=lambda user: user is not y_ND)
    gm.recompile()
    return 1
