"""Head parallel (HP): the canonical graph of a Multi-Head LatentMoE block → its head-parallel graph.

The H heads are sharded over the P ranks of the group (H % P == 0, Hl = H/P heads per rank, all E
experts of a head on that rank). The token projection and the output projection stay data parallel;
the sub-tokens of every rank's tokens travel to the rank of their heads *before* routing:

    z_TQ   = linear(x_TD, w_in)                                    # every head, this rank's T tokens
    z_RQl  = wait(equal_all_to_all(z_TQ.view(T, P, Ql).transpose(0, 1), "hp_dispatch"))
                                                                   # R = P*T tokens, this rank's Hl heads
    ... the canonical per-head region with Hl heads: routers, top-k, K-fold duplication, grouping,
        grouped expert FFN over Hl*E local experts, weighted sum  → y_Gh [R*Hl, h] ...
    y_TQ   = wait(equal_all_to_all(y_Gh.view(P, T, Ql), "hp_combine")).transpose(0, 1).reshape(T, Q)
    out_TD = linear(y_TQ, w_out)

So each rank sends T·Q·(P−1)/P elements per direction whatever K is, every pair exchanges exactly
T·Ql (balanced: no count exchange, no host sync, static shapes, deterministic); routing and the K-fold
duplication happen after the exchange, on the rank that owns the experts.

Parameters: the routers [H, E, h] and experts [H*E, ...] (head-major) are DTensors (Replicate(),
Shard(0)) on the ("dp", "ep") mesh — each rank its heads' rows, original names and full shapes —; the
aux-loss-free selection bias [H, E] is a DTensor buffer sharded the same way (each rank updates its
heads' rows, from all P*T tokens: the global-batch update). `w_in` / `w_out` are replicated.

`Plan(head_ep_size=P)` puts expert parallel inside groups of P ranks instead: `moepass.rewrite.hp_ep`.

Gradient convention (DDP's): a head's router and expert gradients sum every rank's tokens, so
`grad_scale` divides them by P at their reads (the gradient of the mean of the ranks' losses); w_in /
w_out hold each rank's local gradient, averaged by DDP or `all_reduce_replicated_grads`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor, fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from moepass import canonical
from moepass.canonical import GraphBuilder, MoEGraphModule
from moepass.errors import PlanError
from moepass.operands import set_operand
from moepass.passes import Effects, PassResult
from moepass.plan import Plan
from moepass.rewrite.exchange import grad_scale, named
from moepass.rewrite.experts import expert_grad_hook, local_shard, shard_experts
from moepass.runtime import collectives as comm
from moepass.runtime.hp import UPDATE_SELECTION_BIAS_OVER_GROUP, HPLayout, heads_to_tokens, tokens_to_heads
from moepass.runtime.topology import ep_groups
from moepass.spec import MoESpec

PASS = "hp"





def rewrite_hp(gm: MoEGraphModule, plan: Plan) -> PassResult:
    """The HP pass: shard the heads over the group, exchange sub-tokens before routing (see module doc)."""
    assert plan.head_ep_size == 1, "HP with EP inside is moepass.rewrite.hp_ep's pass (pipeline.REWRITES)"
    spec = gm.spec
    check_block(spec)
    device = next(iter(gm.parameters())).device
    groups = ep_groups(plan.topology, plan.ep_size, device.type)
    P, H, h, E = groups.ep_size, spec.heads.num_heads, spec.heads.head_dim, spec.router.num_experts
    if H % P:
        raise PlanError(f"Plan.form='hp' is invalid for block {spec.path or '<root>'}: its {H} heads do not split over "
                        f"{P} ranks; use Plan(heads=...) a multiple of {P} (conversion) or an ep_size dividing {H}.")
    Hl = H // P
    layout = HPLayout(num_experts=H * E, groups=groups, shard_dim=0, heads=H, local_heads=Hl,
                      first_head=groups.ep_rank * Hl)
    effects = Effects()
    attrs = shard_experts(gm, spec, layout, PASS, effects, replica_hooks=plan.grad_sync == "none")
    shard_router(gm, effects, layout, P, groups.ep_rank, groups.mesh, groups.placements(0),
                 expert_grad_hook(groups) if groups.dp_size > 1 else None)  # dp replicas: a head's router sums

    graph, world, group = gm.graph, groups.world_size, groups.ep_group.group_name
    b = GraphBuilder(PASS, spec.path)
    b.graph = graph

    # 1. sub-tokens to the ranks of their heads, before routing
    z_RQl = to_head_ranks(graph, b, group, P)

    # 2. the per-head region with this rank's heads: local shards, Hl heads, Hl*E experts; weights carry the 1/W
    #    of the mean loss
    read_local_shards(graph, b, [*attrs.values(), *layout.sharded, *effects.replaced_buffers],
                      scaled={*attrs.values(), *layout.sharded}, world=world)
    local_heads(graph, z_RQl, Hl, h, E)
    permute = next(n for n in graph.nodes if n.op == "call_function" and n.target is canonical.dialect.PERMUTE)
    set_operand(permute, "num_experts", Hl * E)
    if groups.dp_size > 1:  # the selection bias: updated from the load of every replica (the global batch)
        bias_over_group(graph, b, groups.dp_group.group_name, "update_selection_bias_over_replicas")

    # 3. outputs back to the tokens' ranks, then the data-parallel output projection
    back_to_token_ranks(graph, b, group, P, Hl * h)

    effects.form, effects.layout = PASS, layout
    stats = {"heads": H, "local_heads": Hl, "hp_size": P, "dp_size": groups.dp_size, "experts_per_head": E,
             "exchange_rows_per_peer": "T*Ql (equal)"}
    return PassResult(gm, changed=True, stats=stats, effects=effects)



# The steps HP and HP+EP (`rewrite.hp_ep`) share, on the canonical Multi-Head LatentMoE graph's named nodes.

def check_block(spec: MoESpec) -> None:
    """What form='hp' needs of a block: a Multi-Head LatentMoE without side outputs."""
    where = f"block {spec.path or '<root>'}"
    if spec.heads is None:
        raise PlanError(f"Plan.form='hp' needs a Multi-Head LatentMoE block; {where} has no heads (the pipeline "
                        f"converts standard blocks first: see moepass.rewrite.latent).")
    if spec.side_outputs:
        raise PlanError(f"Plan.form='hp' cannot keep {where}'s side outputs {list(spec.side_outputs)} (router "
                        f"logits live on the heads' ranks).")


def shard_router(gm: MoEGraphModule, effects: Effects, layout: HPLayout, parts: int, index: int, mesh: DeviceMesh,
                 placements: Sequence[Placement], grad_hook: Callable[[Tensor], Tensor] | None) -> None:
    """Cut the router weight and the selection bias by heads (dim 0 in `parts`, this rank's is `index`) into
    DTensors on `mesh`: the weight becomes a sharded parameter (with `grad_hook`, None: none), the bias a
    replaced buffer."""
    router = gm.spec.router
    for source, kind in ((router.weight, "parameter"), (router.selection_bias, "buffer")):
        if source is None:
            continue
        path = source.paths[0]
        full = gm.get_parameter(path) if kind == "parameter" else gm.get_buffer(path)
        local = full.detach().chunk(parts, 0)[index].clone()
        value = DTensor.from_local(local, mesh, placements, run_check=False)
        if kind == "parameter":
            effects.parameters[path] = nn.Parameter(value, requires_grad=full.requires_grad)
            layout.sharded.append(path)
            if grad_hook is not None:
                effects.grad_hooks.append((path, grad_hook))
        else:
            effects.replaced_buffers[path] = value.detach()


def to_head_ranks(graph: fx.Graph, b: GraphBuilder, group: str, ranks: int) -> fx.Node:
    """Sub-tokens to the `ranks` ranks of `group` holding their heads, before routing: z_TQ's users read the
    received rows z_RQl (an equal all-to-all) instead."""
    z_TQ = named(graph, "z_TQ")
    users = list(z_TQ.users)
    with graph.inserting_after(z_TQ):
        send = b.fn(tokens_to_heads, z_TQ, ranks, name="z_send")
    with graph.inserting_after(send):
        pending = b.fn(comm.EQUAL_ALL_TO_ALL, send, group, "hp_dispatch", name="hp_dispatch")
    with graph.inserting_after(pending):
        z_RQl = b.fn(comm.WAIT, pending, name="z_RQl")
    for user in users:
        user.replace_input_with(z_TQ, z_RQl)
    return z_RQl


def read_local_shards(graph: fx.Graph, b: GraphBuilder, names: list[str], scaled: set[str], world: int) -> None:
    """Each read of a sharded tensor (`names`) reads this rank's local shard; those in `scaled` (weights) pass
    their gradient through x 1/world, the ranks' mean."""
    for name in dict.fromkeys(names):
        node = next(n for n in graph.nodes if n.op == "get_attr" and n.target == name)
        with graph.inserting_after(node):
            shard = b.fn(local_shard, node, name=f"{node.name}_local")
        node.replace_all_uses_with(shard, delete_user_cb=lambda user: user is not shard)
        if name in scaled:
            with graph.inserting_after(shard):
                over_w = b.fn(grad_scale, shard, 1.0 / world, name=f"{node.name}_grad_over_W")
            shard.replace_all_uses_with(over_w, delete_user_cb=lambda user: user is not over_w)


def local_heads(graph: fx.Graph, z_RQl: fx.Node, local: int, h: int, experts_per_head: int) -> None:
    """The per-head region reshaped to this rank's `local` heads of width h over the received rows."""
    z_THh = named(graph, "z_THh")
    z_THh.args = (z_THh.args[0], -1, local, h)
    for n in [n for n in graph.nodes if n.name == "tokens"]:  # rows of the selection bias: one per received token
        n.args = (z_RQl, 0)
    ids = named(graph, "ids_GK")
    ids.args = (ids.args[0], local, experts_per_head)


def bias_over_group(graph: fx.Graph, b: GraphBuilder, group: str, name: str) -> None:
    """The selection bias updated from the load over `group` (the replicas of these heads)."""
    for update in [n for n in graph.nodes
                   if n.op == "call_function" and n.target is canonical.dialect.UPDATE_SELECTION_BIAS]:
        with graph.inserting_before(update):
            b.fn(UPDATE_SELECTION_BIAS_OVER_GROUP, *update.args, group, name=name)
        graph.erase_node(update)


def back_to_token_ranks(graph: fx.Graph, b: GraphBuilder, group: str, ranks: int, width: int) -> None:
    """The heads' outputs back to their tokens' ranks (an equal all-to-all over `group`), before the
    data-parallel output projection: y_TQ reads the gathered rows."""
    y_TQ = named(graph, "y_TQ")
    with graph.inserting_before(y_TQ):
        y_RQl = b.method("reshape", y_TQ.args[0], -1, width, name="y_RQl")
        back = b.fn(comm.EQUAL_ALL_TO_ALL, y_RQl, group, "hp_combine", name="hp_combine")
        y_back = b.fn(comm.WAIT, back, name="y_from_heads")
        y_new = b.fn(heads_to_tokens, y_back, ranks, name="y_TQ_gathered")
    y_TQ.replace_all_uses_with(y_new)
    graph.erase_node(y_TQ)
