"""Expert parallel (EP): the canonical dialect graph of a block → its distributed graph.

Each of the P ranks of an EP group owns L = E/P consecutive experts (rank i: experts [i*L, (i+1)*L)).
The rewrite keeps everything around the expert compute (router, capacity, shared experts, side
outputs) and replaces the single `moe.expert_ffn` node by

    x_ND, counts_E, order_N = moe.permute(x_TD, experts_TK)          # unchanged (local routing)
    recv_counts_E = wait(moe_comm.exchange_counts(counts_E))          # metadata all-to-all
    x_RD          = wait(moe_comm.all_to_all(x_ND, counts_E, recv_counts_E, "dispatch"))
    ids_R1        = moe_ep.local_expert_ids(recv_counts_E, L, R)      # rows arrive (source, expert)-major
    x_MD, counts_L, order_R = moe.permute(x_RD, ids_R1, L)            # ... sort them expert-major
    y_MD          = moe.expert_ffn(x_MD, counts_L, <local expert slice of each weight>)
    y_RD          = moe.unpermute(y_MD, order_R, 1)
    y_ND          = wait(moe_comm.all_to_all(y_RD, recv_counts_E, counts_E, "combine", out_rows=N))
    y_TKD = moe.unpermute(y_ND, order_N, K); out_TD = moe.combine(y_TKD, weights_TK)   # unchanged

Capacity (what it means under EP, precisely): capacity is applied by each rank to its own tokens
before dispatch, i.e. per (source rank, expert): every rank keeps at most C assignments per expert
and capacity group, C computed from the rank's local group size (`moe.capacity_keep` exactly as the
single-device graph runs it, on the rank's slice). A model with per-sequence capacity (Switch) is
therefore unchanged by EP (ranks hold whole sequences); a model with per-batch capacity (GShard
sample) behaves as it would under plain data parallelism with the same per-rank batch — not as one
device running the concatenated global batch. `Plan(capacity_factor=cf)` sets the factor (on a
dropless model: GShard-style k-major priority, per-rank batch groups, dropped assignments contribute
zero). Dropped assignments are routed to an extra bucket E that is never sent: they cost no bytes.
Dropless (the default for dropless models) keeps every token.

The exchange around the expert compute is `moepass.rewrite.exchange` (shared with FSEP): EP's
buckets are the experts themselves.

Parameters (`moepass.rewrite.experts`): each rank keeps only its experts' rows of every expert weight,
as a DTensor on the ("dp", "ep") mesh with placements (Replicate(), Shard(0)) — the canonical [E, ...]
layout sharded on the expert dim, so names and logical shapes are the original ones for fused 3-D
weights. ModuleList experts (one tensor per expert) are stacked into fused parameters `ep_<role>` owned
by the rewritten block (the per-expert modules are removed); `moepass.logical_state_dict` maps them back.
Generic experts (not a known FFN: `moepass.generic_experts`) are stacked the same way, one parameter
`ep_<name>` per tensor of the expert (dots made underscores), and run on the local rows as they are.

Gradient convention (the same as DDP's): after backward, an expert parameter's gradient is the
gradient of the mean over all W ranks of their local losses (see `moepass.rewrite.exchange`), and a
hook on the parameter sums across DP replicas (`dp_group`, only when ep_size < world). Non-expert
parameters are replicated: average their gradients with DDP (expert parameters are excluded from it)
or `moepass.runtime.grads.all_reduce_replicated_grads`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import fx

from moepass import canonical
from moepass.canonical import GraphBuilder, MoEGraphModule
from moepass.errors import PlanError
from moepass.passes import Effects, PassResult
from moepass.plan import Plan
from moepass.rewrite import exchange
from moepass.rewrite.experts import local_shard, shard_experts
from moepass.runtime.layout import ExpertLayout
from moepass.runtime.topology import EPGroups, ep_groups
from moepass.spec import CapacitySpec, MoESpec, TensorSource

PASS = "ep"


@dataclass
class EPLayout(ExpertLayout):
    """EP's layout: this rank computes experts [first_expert, first_expert + local_experts)."""

    local_experts: int = 0  # L
    first_expert: int = 0


def ep_capacity(spec: MoESpec, plan: Plan) -> CapacitySpec | None:
    """The capacity the EP graph applies per (source rank, expert): see the module doc."""
    if plan.capacity_factor is None:
        return spec.capacity
    if spec.capacity is None:
        return CapacitySpec(capacity_factor=float(plan.capacity_factor))
    return dataclasses.replace(spec.capacity, capacity_factor=float(plan.capacity_factor), fixed=None)


def local_weight(b: GraphBuilder, attr: str, source: TensorSource, role: str, reads: dict[str, fx.Node]) -> fx.Node:
    """get_attr → local shard → the source's chunk / transpose (as the canonical graph reads it).

    A parameter several roles read (gate and up halves of one tensor) is read and chunked once.
    """
    if attr not in reads:
        reads[attr] = b.fn(local_shard, b.attr(attr, name=f"{role}_param"), name=f"{role}_local")
    return b.view(source, reads[attr], f"{role}_local")


def experts_per_rank(spec: MoESpec, plan: Plan, groups: EPGroups) -> int:
    """L = E/P experts per rank of the EP group; a PlanError naming the valid ep_size values otherwise."""
    E, P = spec.num_experts, groups.ep_size
    if E % P:
        world = groups.world_size
        given = f"Plan.ep_size={P}" if plan.ep_size is not None else f"Plan.ep_size=None (the world size, {P})"
        valid = [d for d in range(1, world + 1) if world % d == 0 and E % d == 0]
        raise PlanError(f"{given} is invalid for block {spec.path or '<root>'}: its {E} experts do not split evenly "
                        f"over {P} EP ranks; use an ep_size dividing both {E} and the world size {world} "
                        f"(valid: {valid}), or leave this block alone with Plan(blocks={{{spec.path!r}: None}}).")
    return E // P


def rewrite_ep(gm: MoEGraphModule, plan: Plan) -> PassResult:
    """The EP pass: shard the block's experts over the EP group and rewrite its graph (see module doc)."""
    spec = gm.spec
    device = next(iter(gm.parameters())).device
    groups = ep_groups(plan.topology, plan.ep_size, device.type)
    E, P = spec.num_experts, groups.ep_size
    assert spec.capacity == ep_capacity(spec, plan), "pipeline.resolve applies the EP capacity before canonical.build"
    L = experts_per_rank(spec, plan, groups)
    layout = EPLayout(num_experts=E, groups=groups, shard_dim=0, local_experts=L, first_expert=groups.ep_rank * L)
    effects = Effects()
    attrs = shard_experts(gm, spec, layout, PASS, effects, replica_hooks=plan.grad_sync == "none")
    b = GraphBuilder(PASS, spec.path)
    reads: dict[str, fx.Node] = {}

    def weights() -> list[fx.Node | None]:  # local shards: nothing to issue
        return canonical.expert_weights(b, spec.experts,
                                        lambda source, role: local_weight(b, attrs[role], source, role, reads))

    stats = exchange.insert_exchange(gm, b, buckets=E, local=L, group_name=groups.ep_group.group_name,
                                     world=groups.world_size, route=None, issue_weights=lambda: weights,
                                     hierarchy=exchange.hierarchy_of(plan, groups))
    stats = {"experts": E, "local_experts": L, "ep_size": P, "dp_size": groups.dp_size, "capacity": stats["capacity"]}
    effects.form, effects.layout = PASS, layout
    return PassResult(gm, changed=True, stats=stats, effects=effects)
