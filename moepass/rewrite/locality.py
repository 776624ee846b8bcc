"""Locality-aware routing (LocMoE, IJCAI'24): a top-1 router that prefers the experts of its own node,
with a capacity floor, dispatched over expert parallel. A math change: only when `Plan(form="locality")`
names it.

    Plan(form="locality", gate="grap" | "learned", mu=..., alpha=0.01, capacity_factor=None | c_f)

`convert` (before any graph exists) makes the block's router top-1, drops its own selection bias, group
limit, renormalisation and capacity, and records the change as pass `convert:locality`. The pass then
rewrites the canonical graph (the experts and everything around the router stay the block's own):

    logits_TE  = linear(x_TD, w_router)                          "learned": the block's own router
               | grap_logits(x_TD, E)                            "grap": mean of the i-th block of D/E channels
    weights_T1, experts_T1, probs_TE = locality_route(logits_TE) ReLU -> softmax -> argmax; weight = the
                                                                 chosen probability (no renormalisation)
    keep_T1, floor_3 = moe_loc.floor_keep(x_TD, gate_ED, experts_T1, c_f)      only with a capacity factor
    ... EP exchange (`exchange.insert_exchange`): E/P consecutive experts per rank; dropped assignments go
        to an extra bucket that is never sent and contribute zero ...
    losses     = locality_losses(probs_TE, experts_T1, log_target_E, alpha, mu, training)
    self.locality(losses, floor_3, own_share)                    records them for `moepass.aux_loss(model)`

Losses (L_aux, L_loc, `moepass.aux_loss`) and the capacity floor (Theorem 1, `moe_loc.floor_keep`): what the
graph runs, `moepass.runtime.locality`, whose module doc gives the formulas.

Gradient convention as EP's (`moepass.rewrite.exchange`): expert gradients are those of the mean of the
ranks' losses; the router (replicated) holds its rank's gradient, averaged by DDP or
`moepass.runtime.grads.all_reduce_replicated_grads`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor, fx, nn

from moepass import canonical, dialect
from moepass.canonical import GraphBuilder, MoEGraphModule
from moepass.errors import PlanError
from moepass.operands import operand
from moepass.passes import Effects, PassResult
from moepass.plan import Plan
from moepass.rewrite import exchange
from moepass.rewrite.ep import EPLayout, experts_per_rank, local_weight
from moepass.rewrite.experts import shard_experts
from moepass.runtime.locality import (
    FLOOR_KEEP,
    LocalityRecord,
    grap_gate,
    grap_logits,
    locality_losses,
    locality_route,
    own_node_share,
)
from moepass.runtime.topology import EPGroups, ep_groups
from moepass.spec import MoESpec

PASS = "locality"
CONVERT = "convert:locality"
LOCAL_SMOOTHING = 0.1  # D_local = (1 - eps) * uniform(own-node experts) + eps * uniform(all experts)


# ----------------------------------------------------------------------------------------------
# The conversion (before any graph) and the pass.
# ----------------------------------------------------------------------------------------------


def convert(spec: MoESpec, block: nn.Module, plan: Plan) -> tuple[MoESpec, nn.Module, dict]:
    """The router change `Plan(form="locality")` names: top-1, softmax (the pass puts ReLU before it), no
    renormalisation, no selection bias or group limit, and the locality capacity rule instead of the
    block's own. Returns the spec the canonical graph is built from and the `convert:locality` record."""
    where = spec.path or "<root>"
    if spec.heads is not None:
        raise PlanError(f"Plan.form='locality' is not built for block {where}, a Multi-Head LatentMoE: its parallel "
                        f"form is form='hp'; or use form='single'.")
    E, D = spec.num_experts, spec.model_dim
    if plan.gate == "grap" and D % E:
        raise PlanError(f"Plan.gate='grap' is invalid for block {where}: the GrAP gate averages E={E} contiguous "
                        f"blocks of D/E channels, but D={D} is not a multiple of {E} (D % E = {D % E}); use "
                        f"gate='learned' (the block's own router), or leave this block alone with "
                        f"Plan(blocks={{{spec.path!r}: None}}).")
    r = spec.router
    router = dataclasses.replace(r, top_k=1, score_func="softmax", softmax_before_topk=True, renormalize=False,
                                 n_group=1, topk_group=1, routed_scaling_factor=1.0, selection_bias=None,
                                 bias_update_rate=0.0)
    assert plan.mu is not None  # Plan requires it with form="locality"
    was = spec.summary()
    new_spec = spec.replace(router=router, capacity=None)
    stats = {"math": "changed (top-1 locality routing with its losses, named by Plan.form='locality')",
             "was": was, "router": describe_router(plan.gate), "losses": describe_losses(plan.alpha, plan.mu),
             "capacity": describe_capacity(plan.capacity_factor, E, D)}
    return new_spec, block, {"pass": CONVERT, "seconds": 0.0, "changed": True, "stats": stats}


def describe_router(gate_name: str) -> str:
    gate = ("GrAP (fixed: logit i = mean of the i-th block of D/E channels)" if gate_name == "grap"
            else "the block's learned router")
    return f"{gate} -> ReLU -> softmax -> argmax (top-1); weight = the chosen probability, not renormalised"


def describe_losses(alpha: float, mu: float) -> str:
    return (f"L_aux = {alpha:g}*E*sum f_i*P_i; L_loc = {mu:g}*KL(mean softmax || D_local), D_local = "
            f"{1 - LOCAL_SMOOTHING:g}*uniform(own-node experts) + {LOCAL_SMOOTHING:g}*uniform(E); train mode, "
            f"summed by moepass.aux_loss(model)")


def describe_capacity(capacity_factor: float | None, num_experts: int, dim: int) -> str:
    if capacity_factor is None:
        return "dropless (Plan.capacity_factor=None): no capacity, so no floor is measured"
    from cost_model.locality import capacity_floor

    return (f"per (source rank, expert): max(ceil(ec_min(delta)), ceil(T*{capacity_factor:g}/E)) clamped to "
            f"T; delta = min cos(token, chosen gate vector) measured each forward (one host sync per layer per "
            f"step); ec_min(delta=0) = {capacity_floor(0.0, num_experts, dim):.4g} tokens")


@dataclass
class LocalityLayout(EPLayout):
    """EP's placement plus the routing settings and this rank's node-local experts."""

    gate: str = "learned"
    alpha: float = 0.0
    mu: float = 0.0
    capacity_factor: float | None = None
    dim: int = 0
    own_experts: list[int] = field(default_factory=list)  # experts on this rank's node

    def describe(self, gm: nn.Module) -> list[str]:
        lines = [*super().describe(gm),
                 "locality routing (changes the model's math: named by Plan.form='locality'): "
                 + describe_router(self.gate),
                 f"losses: {describe_losses(self.alpha, self.mu)}; this rank's node holds experts {self.own_experts}",
                 f"capacity: {describe_capacity(self.capacity_factor, self.num_experts, self.dim)}"]
        record = getattr(gm, "locality", None)
        if isinstance(record, LocalityRecord) and record.floor_stats is not None:
            s = record.locality_state()
            lines.append(f"last forward: delta={s['delta']:.4g}, ec_min={s['floor']:.4g}, capacity={s['capacity']}")
        return lines


def node_experts(groups: EPGroups, local_experts: int) -> list[int]:
    """The experts whose EP owner shares this rank's node (node-major ranks, E/P consecutive per rank)."""
    topology, node = groups.topology, groups.topology.node_of(groups.rank)
    return [e for e in range(groups.ep_size * local_experts)
            if topology.node_of(groups.ep_ranks[e // local_experts]) == node]


def local_target(num_experts: int, own: list[int]) -> Tensor:
    """D_local [E] (module doc): uniform over the node's experts `own`, smoothed with LOCAL_SMOOTHING."""
    assert own, "under EP every rank hosts E/P >= 1 experts"
    target_E = torch.full((num_experts,), LOCAL_SMOOTHING / num_experts)
    target_E[own] += (1.0 - LOCAL_SMOOTHING) / len(own)
    return target_E


def rewrite_locality(gm: MoEGraphModule, plan: Plan) -> PassResult:
    """The locality pass (module doc): top-1 locality router, floor capacity, losses, EP dispatch."""
    spec = gm.spec
    assert spec.top_k == 1 and spec.capacity is None, "locality.convert runs before canonical.build"
    assert plan.mu is not None  # Plan validates it for form="locality"
    device = next(iter(gm.parameters())).device
    groups = ep_groups(plan.topology, plan.ep_size, device.type)
    E, D = spec.num_experts, spec.model_dim
    L = experts_per_rank(spec, plan, groups)
    own = node_experts(groups, L)
    layout = LocalityLayout(num_experts=E, groups=groups, shard_dim=0, local_experts=L,
                            first_expert=groups.ep_rank * L, gate=plan.gate, alpha=float(plan.alpha),
                            mu=float(plan.mu), capacity_factor=plan.capacity_factor, dim=D, own_experts=own)
    effects = Effects()
    attrs = shard_experts(gm, spec, layout, PASS, effects, replica_hooks=plan.grad_sync == "none")
    on_node_E = torch.zeros(E, dtype=torch.bool, device=device)
    on_node_E[own] = True
    grap_ED = grap_gate(E, D).to(device) if plan.gate == "grap" and plan.capacity_factor is not None else None
    effects.modules["locality"] = LocalityRecord(spec.path, local_target(E, own).log().to(device), on_node_E, grap_ED)

    graph = gm.graph
    b = GraphBuilder(PASS, spec.path)
    b.graph = graph
    route = exchange.only(graph, dialect.ROUTE, "moe.route")
    old = {user.args[1]: user for user in route.users}  # getitem 0: weights, 1: experts
    x_TD, logits = exchange.named(graph, "x_TD"), operand(route, "logits_TE")
    assert isinstance(logits, fx.Node)
    with graph.inserting_before(route):
        if plan.gate == "grap":  # the block's router is no longer read; the side output shows the GrAP logits
            grap = b.fn(grap_logits, x_TD, E, name="grap_logits_TE")
            output = next(n for n in graph.nodes if n.op == "output")
            for side in ("logits_TE", "router_logits"):
                found = [n for n in graph.nodes if n.name == side]
                if found:
                    output.replace_input_with(found[0], grap)
            logits = grap
            weight = gm.get_parameter(spec.router.weight.paths[0]) if spec.router.logits_from == "linear" else None
            for path, param in gm.named_parameters():  # frozen: nothing reads it (checkpoints keep it)
                if param is weight or (weight is None and path.startswith(spec.router.module_path + ".")):
                    effects.parameters[path] = nn.Parameter(param.detach(), requires_grad=False)
        routed = b.fn(locality_route, logits, name="locality_route")
        weights_T1 = b.item(routed, 0, "weights_T1")
        experts_T1 = b.item(routed, 1, "experts_T1")
        probs_TE = b.item(routed, 2, "probs_TE")

        keep_T1 = floor_3 = None
        if plan.capacity_factor is not None:
            gate_ED = (b.attr("locality.gate_ED") if plan.gate == "grap"
                       else b.tensor(spec.router.weight, "gate_vectors_ED"))
            kept = b.fn(FLOOR_KEEP, b.method("detach", x_TD, name="x_TD_detached"),
                        b.method("detach", gate_ED, name="gate_ED_detached"), experts_T1,
                        float(plan.capacity_factor), name="floor_keep")
            keep_T1, floor_3 = b.item(kept, 0, "keep_T1"), b.item(kept, 1, "floor_stats")
    for index, new in ((0, weights_T1), (1, experts_T1)):  # the block's top-k routing is gone
        if index in old:
            old[index].replace_all_uses_with(new)
            graph.erase_node(old[index])
    graph.erase_node(route)
    if keep_T1 is not None:  # dropped tokens contribute zero
        with graph.inserting_after(keep_T1):
            kept_weights = b.fn(torch.mul, weights_T1, keep_T1, name="kept_weights_T1")
        weights_T1.replace_all_uses_with(kept_weights, delete_user_cb=lambda u: u is not kept_weights)

    reads: dict[str, fx.Node] = {}

    def weights() -> list[fx.Node | None]:  # local shards: nothing to issue
        return canonical.expert_weights(b, spec.experts,
                                        lambda source, role: local_weight(b, attrs[role], source, role, reads))

    exchange.insert_exchange(gm, b, buckets=E, local=L, group_name=groups.ep_group.group_name,
                             world=groups.world_size, route=None, issue_weights=lambda: weights, keep=keep_T1,
                             hierarchy=exchange.hierarchy_of(plan, groups))

    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        losses = b.fn(locality_losses, probs_TE, experts_T1, b.attr("locality.log_target_E"), float(plan.alpha),
                      float(plan.mu), b.attr("training"), name="locality_losses")
        share = b.fn(own_node_share, experts_T1, b.attr("locality.on_node_E"), name="own_node_share")
        b.module("locality", losses, floor_3, share, name="locality_record")
    effects.form, effects.layout = PASS, layout
    stats = {"experts": E, "local_experts": L, "ep_size": groups.ep_size, "dp_size": groups.dp_size,
             "gate": plan.gate, "own_node_experts": own, "capacity": "floor rule" if keep_T1 is not None else "dropless"}
    return PassResult(gm, changed=True, stats=stats, effects=effects)
