"""Head parallel with expert parallel inside (`Plan(form="hp", head_ep_size=P)`): HP across head groups,
EP inside each group, for a Multi-Head LatentMoE block.

Mesh and ranks (`moepass.runtime.topology.HeadEPGroups`): the ep_size = G*P ranks of a block (the world
unless Plan.ep_size says otherwise; W/(G*P) data-parallel replicas) on the mesh ("dp", "hp", "ep") of
shape (W/(G*P), G, P), rank = dp_index*G*P + g*P + p. EP is the inner dim: the P ranks of a head group
are consecutive (inside a node when P <= ranks_per_node), because the expert exchange is the one whose
bytes grow with K and follow the routing; the HP exchange (equal splits, flat in K) crosses nodes.

Sharding. The H heads are sharded over "hp" (H % G == 0, Hl = H/G heads per head group g: heads
[g*Hl, (g+1)*Hl)); the X = Hl*E experts of a group's heads (head-major, as the block stores them) are
sharded over "ep" (X % P == 0, L = X/P per rank): rank (g, p) keeps experts [(g*P+p)*L, (g*P+p+1)*L) of
the block's H*E — the DTensor placement (Replicate(), Shard(0), Shard(0)), whose flat shard index is
g*P+p, as under EP. The routers [H, E, h] and the selection bias [H, E] are sharded by heads only:
(Replicate(), Shard(0), Replicate()). w_in / w_out stay replicated.

Forward, rank (g, p), T tokens:

    z_TQ   = linear(x_TD, w_in)
    z_RQl  = wait(equal_all_to_all(tokens_to_heads(z_TQ, G), hp_group, "hp_dispatch"))
             # R = G*T tokens: those of the G ranks sharing p, sub-tokens of group g's Hl heads
    routing per head (the group's routers and selection bias), top-k, K-fold duplication: N = R*Hl*K rows
    update_selection_bias_over_group(...)          # train mode: the load summed over the head's replicas
    the expert exchange of `moepass.rewrite.exchange` inside the EP group (buckets = the group's X experts,
    L per rank): exchange_counts, dispatch, local permute, expert FFN over L experts, combine
    weighted sum over K → y_Gh [R*Hl, h]
    y_TQ   = heads_to_tokens(wait(equal_all_to_all(y_Gh.view(G*T, Hl*h), hp_group, "hp_combine")), G)
    out_TD = linear(y_TQ, w_out)

Bytes per rank and direction (elements; `cost_model.hp.hp_ep_exchange_elements`): HP T*H*h*(G-1)/G,
whatever K; EP N*h = T*H*K*h rows leave the permute, of which the rows for the P-1 other ranks of the
group travel (T*H*K*h*(P-1)/P under uniform routing). The dispatch needs the EP count exchange (P*L
counts) and its host sync for the split sizes, inside the group only; the HP exchange keeps none.

Gradient convention (DDP's, as the other forms): every head and expert weight's gradient is that of
the mean of the W ranks' losses. Reads of the router and expert shards carry `grad_scale(1/W)`; an
expert's rows come from every rank (the exchanges' backward brings them home), so its gradient is
complete on its owner, then summed over the dp replicas (`dp_group`, when W > G*P); a head's router
sees only the R tokens of its rank, so its gradient is summed over the dp*P ranks that hold the head
(`head_replica_group`). The selection bias is updated from the load summed over the same ranks, so it
stays one value per head — the global-batch update of the single-device block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, fx, nn
from torch.distributed.tensor import DTensor

from moepass import dialect
from moepass.canonical import GraphBuilder, MoEGraphModule
from moepass.errors import PlanError
from moepass.operands import operand
from moepass.passes import Effects, PassResult
from moepass.plan import Plan
from moepass.rewrite.exchange import insert_exchange, only
from moepass.rewrite.experts import shard_experts
from moepass.rewrite.hp import (
    back_to_token_ranks,
    bias_over_group,
    check_block,
    local_heads,
    read_local_shards,
    shard_router,
    to_head_ranks,
)
from moepass.runtime import collectives as comm
from moepass.runtime.hp import HPLayout
from moepass.runtime.topology import HeadEPGroups, head_ep_groups

PASS = "hp"


@dataclass
class HPEPLayout(HPLayout):
    """HP with EP inside: this rank's head group computes heads [first_head, first_head + local_heads);
    this rank keeps experts [first_expert, first_expert + local_experts) of the block's H*E."""

    local_experts: int = 0
    first_expert: int = 0

    def describe(self, gm: nn.Module) -> list[str]:
        g = self.groups
        assert isinstance(g, HeadEPGroups)
        last_head, last_expert = self.first_head + self.local_heads - 1, self.first_expert + self.local_experts - 1
        return [
            f"mesh ('dp', 'hp', 'ep') of shape ({g.dp_size}, {g.head_groups}, {g.head_ep}): {g.head_groups} head "
            f"groups (heads over 'hp') x {g.head_ep} ranks each (experts over 'ep', the inner dim: consecutive "
            f"ranks) x {g.dp_size} data-parallel replicas; this rank is (dp {g.dp_rank}, hp {g.hp_rank}, "
            f"ep {g.expert_rank})",
            f"heads {self.first_head}..{last_head} of {self.heads} on this rank's head group (routers and selection "
            f"bias, replicated over its {g.head_ep} ranks); HP exchange (equal splits) over ranks {g.hp_ranks}",
            f"experts {self.first_expert}..{last_expert} of {self.num_experts} (head-major) on this rank, sharded "
            f"over the 'hp' then the 'ep' dim; expert exchange (variable splits, count exchange) over ranks "
            f"{g.expert_ranks}; parameters: {self.expert_param_names()}",
        ]


def head_grad_hook(groups: HeadEPGroups) -> Callable[[Tensor], Tensor]:
    """A router's gradient := its sum over the ranks holding its heads (the 1/W is already in it)."""

    def hook(grad: Tensor) -> Tensor:
        local = (grad.to_local() if isinstance(grad, DTensor) else grad).clone()  # a hook must not modify its argument
        comm.all_reduce_sum_(local, groups.head_replica_group)
        if isinstance(grad, DTensor):
            return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)
        return local

    return hook


def rewrite_hp_ep(gm: MoEGraphModule, plan: Plan) -> PassResult:
    """The HP pass with EP inside each head group (see module doc)."""
    spec = gm.spec
    check_block(spec)
    where = f"block {spec.path or '<root>'}"
    device = next(iter(gm.parameters())).device
    groups = head_ep_groups(plan.topology, plan.ep_size, plan.head_ep_size, device.type)
    G, P, W = groups.head_groups, groups.head_ep, groups.world_size
    H, h, E = spec.heads.num_heads, spec.heads.head_dim, spec.router.num_experts
    if H % G:
        raise PlanError(f"Plan.head_ep_size={P} is invalid for {where}: its {H} heads do not split over the {G} head "
                        f"groups ({groups.ep_size} ranks / head_ep_size {P}); use Plan(heads=...) a multiple of {G} "
                        f"(conversion), or a head_ep_size making {groups.ep_size}/head_ep_size divide {H}.")
    Hl = H // G
    X = Hl * E
    if X % P:
        raise PlanError(f"Plan.head_ep_size={P} is invalid for {where}: a head group's {Hl} heads x {E} experts = {X} "
                        f"experts do not split over its {P} ranks; use a head_ep_size dividing {X} (and "
                        f"{groups.ep_size}), or experts per head making {Hl}*E a multiple of {P}.")
    L = X // P
    layout = HPEPLayout(num_experts=H * E, groups=groups, shard_dim=0, heads=H, local_heads=Hl,
                        first_head=groups.hp_rank * Hl, local_experts=L, first_expert=groups.ep_rank * L)
    effects = Effects()
    attrs = shard_experts(gm, spec, layout, PASS, effects, replica_hooks=plan.grad_sync == "none")  # flat shard g*P+p; dp replicas sum (dp_group)
    shard_router(gm, effects, layout, G, groups.hp_rank, groups.mesh, groups.head_placements(0),
                 head_grad_hook(groups))

    graph = gm.graph
    b = GraphBuilder(PASS, spec.path)
    b.graph = graph
    hp_name, expert_name = groups.hp_group.group_name, groups.expert_group.group_name

    # 1. sub-tokens to the head group of their heads (the G ranks sharing this rank's ep index), before routing
    z_RQl = to_head_ranks(graph, b, hp_name, G)

    # 2. the group's heads: local shards of routers, bias and experts; weights carry the 1/W of the mean loss
    read_local_shards(graph, b, [*attrs.values(), *layout.sharded, *effects.replaced_buffers],
                      scaled={*attrs.values(), *layout.sharded}, world=W)
    local_heads(graph, z_RQl, Hl, h, E)
    bias_over_group(graph, b, groups.head_replica_group.group_name, "update_selection_bias_over_group")

    # 3. the expert exchange inside the EP group: buckets are the group's X experts, L on each rank. Its own
    #    gradient scaling is off (world=1): the weight reads above already carry the 1/W.
    ffn = only(graph, dialect.EXPERT_FFN, "moe.expert_ffn")
    ffn_weights = [a if isinstance(a, fx.Node) else None for a in (operand(ffn, name) for name in dialect.FFN_WEIGHT_NAMES)]
    insert_exchange(gm, b, buckets=X, local=L, group_name=expert_name, world=1, route=None,
                    issue_weights=lambda: (lambda: ffn_weights), axis="X")

    # 4. outputs back to the tokens' ranks, then the data-parallel output projection
    back_to_token_ranks(graph, b, hp_name, G, Hl * h)

    effects.form, effects.layout = PASS, layout
    stats = {"heads": H, "local_heads": Hl, "hp_size": G, "head_ep_size": P, "dp_size": groups.dp_size,
             "mesh": f"dp x hp x ep = {groups.dp_size} x {G} x {P}", "experts_per_head": E, "local_experts": L,
             "exchange_rows_per_peer": "HP: T*Ql (equal); EP: by routing"}
    return PassResult(gm, changed=True, stats=stats, effects=effects)
