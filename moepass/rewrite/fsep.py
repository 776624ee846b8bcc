"""Fully sharded expert parallel (FSEP, LAER-MoE): the canonical dialect graph → its FSEP graph.

Storage (`moepass.rewrite.experts`, shard_dim=1): each of the P ranks of the group keeps slice p of
*every* expert — the canonical [E, a, ...] weight sharded on dim 1 (the row-major (E, P, S/P) view,
[:, p, :]) as a DTensor on the ("dp", "ep") mesh. Gradients and optimizer state live on shards only.

Each device computes C expert *slots* per step; a placement table `slot_expert` (P*C entries, slot
g = n*C + c on device n) says which expert each slot hosts — an expert may have several replicas. The
graph around the expert compute is the shared exchange (`moepass.rewrite.exchange`) with slots as
buckets, plus the restore of the weights:

    slot_expert_U  = self.fsep_placement()                     # this step's table (installs a due one)
    slots_TK       = moe_fsep.route_to_slots(experts_TK, slot_expert_U, rank, ranks_per_node, C, E)
    ... permute by slot, exchange counts, dispatch (as EP, buckets = P*C slots, L = C) ...
    send_Us        = cat_j(index_select(shard_j.flatten(1), 0, slot_expert_U))    # my slice of each slot's expert
    recv_Us        = wait(moe_comm.equal_all_to_all(send_Us, "restore"))           # issued after the dispatch
                                                    # (restore_issue: or the one an earlier block prefetched)
    restore_prefetch(...)                                                          # the next blocks' restores
    w_j            = assemble(recv_Us)[j]                                          # [C, a, ...]: C whole experts
    y = moe.expert_ffn(x_MD, counts_C, w_*) ... unpermute, combine (as EP)

The expert FFN keeps a `Restore` handle rather than the C whole experts: the backward restores them again
(kind "restore_again"), so restored weights live one layer at a time. `Plan(keep_restored=True)` keeps them
from the forward instead (C*S more elements alive per layer until its backward, one restore fewer).

`moe_comm.equal_all_to_all` (kind "restore") is a balanced, fixed-shape all_to_all: every pair exchanges
C·S/P elements, every step. In the backward each slot's gradient slice goes back to its owner (kind
"restore_bwd") and the replicas' contributions are summed into [E, S/P] (`slice_grads`: the reduce-scatter
of the technique). A new table changes only which rows the next restore gathers: no parameter or
optimizer byte moves.

At run time (`moepass.runtime.fsep`): the restore is one autograd node whose backward leaves the gradient
slices' reduction in flight behind the earlier layers' backward (`Plan.defer_expert_grads`), a block issues
the next blocks' restores behind its expert compute (`Plan.prefetch_depth`, linked by `chain_restores`), and
the block's `FSEPPlacement` child plans the next table on a worker thread (`Plan.planner`). The ops
(lite routing, gathering and assembling the slices) are `moepass.runtime.fsep_ops`.

Gradient convention: as EP (DDP's mean over ranks; `exchange.grad_scale`), plus a DP hook when the
group is smaller than the world.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor, fx, nn

from cost_model.presets import resolve_hardware
from moepass import canonical, dialect
from moepass.canonical import GraphBuilder, MoEGraphModule
from moepass.errors import PlanError
from moepass.passes import Effects, PassResult
from moepass.plan import Plan
from moepass.rewrite import exchange
from moepass.rewrite.experts import local_shard, shard_experts
from moepass.runtime import collectives as comm
from moepass.runtime import placement
from moepass.runtime.fsep import (
    CONTROLLER,
    FSEPLayout,
    FSEPPlacement,
    PrefetchChain,
    RestoreSource,
    observe_counts,
    restore_issue,
    restore_prefetch,
)
from moepass.runtime.fsep_ops import ROUTE_TO_SLOTS, Restore, assemble, expert_counts
from moepass.runtime.topology import ep_groups
from moepass.spec import TensorSource

PASS = "fsep"


def _node(name: str) -> str:
    return name.replace(".", "_")


def default_slots(num_experts: int, peers: int) -> int:
    """C when the plan leaves it out: every expert once, plus one slot per device for replicas."""
    return -(-num_experts // peers) + 1


def restore_reader(restore: Restore, index: int, chunk: tuple[int, int] | None, chunk_dim: int,
                   transpose: bool) -> Callable[[], Tensor]:
    """Graph node: how the backward gets one expert-FFN weight operand back (`dialect.rebuildable`): restore,
    then the role's view (the chunk / transpose of its TensorSource)."""
    source = TensorSource(paths=(), chunk=chunk, chunk_dim=chunk_dim, transpose=transpose)
    return lambda: canonical.view_of(source, restore.run()[index])


def rewrite_fsep(gm: MoEGraphModule, plan: Plan) -> PassResult:
    """The FSEP pass: shard every expert over the group, restore C slots per device, route to them."""
    spec = gm.spec
    device = next(iter(gm.parameters())).device
    groups = ep_groups(plan.topology, plan.ep_size, device.type)
    E, P = spec.num_experts, groups.ep_size
    C = plan.slots_per_device or default_slots(E, P)
    if P * C < E:
        raise PlanError(f"Plan.slots_per_device={C} is invalid for block {spec.path or '<root>'}: {P} devices x {C} "
                        f"slots cannot host its {E} experts; use slots_per_device >= {-(-E // P)}.")
    rpn = min(groups.topology.ranks_per_node, P)
    layout = FSEPLayout(num_experts=E, groups=groups, shard_dim=1, slots=C)
    effects = Effects()
    attrs = shard_experts(gm, spec, layout, PASS, effects, replica_hooks=plan.grad_sync == "none")
    params = list(dict.fromkeys(attrs.values()))
    shapes = {name: tuple(effects.parameters[name].shape[1:]) for name in params}
    x = spec.experts
    config = placement.PlannerConfig.from_hardware(resolve_hardware(plan.hardware), E=E, W=P, C=C, ranks_per_node=rpn,
                                                   D=x.hidden_dim, F=x.ffn_dim, gated=x.gated,
                                                   recompute=plan.expert_recompute)
    table = placement.even_table(E, P, C, rpn)
    source = RestoreSource(tuple(params), groups.ep_group.group_name)
    controller = FSEPPlacement(spec.path or "<root>", config, groups.ep_rank, plan.planner, table, source,
                               plan.prefetch_depth, plan.defer_expert_grads, device)
    effects.modules[CONTROLLER] = controller
    group_name = groups.ep_group.group_name

    b = GraphBuilder(PASS, spec.path)
    b.graph = gm.graph
    first = next(iter(gm.graph.nodes))
    while first.op == "placeholder":
        first = first.next
    with gm.graph.inserting_before(first):
        slot_expert = b.module(CONTROLLER, name="slot_expert_U")

    def route(experts_TK: fx.Node) -> fx.Node:
        if controller.observes:
            counts_E = b.fn(expert_counts, experts_TK, E, name="expert_counts_E")
            counts_PE = b.fn(comm.GATHER_COUNTS, counts_E, group_name, name="expert_counts_PE")
            b.fn(observe_counts, b.attr(CONTROLLER, name="placement"), counts_PE, name="observe_counts")
        return b.fn(ROUTE_TO_SLOTS, experts_TK, slot_expert, groups.ep_rank, rpn, C, E, name="slots_TK")

    def issue_restore() -> exchange.Weights:
        """The restore is issued right behind the token dispatch and waited just before the experts."""
        shards = [b.fn(local_shard, b.attr(name, name=f"{_node(name)}_param"), name=f"{_node(name)}_shard")
                  for name in params]
        placement_ = b.attr(CONTROLLER, name="restore_placement")
        pending = b.fn(restore_issue, placement_, shards, slot_expert, name="restore")

        def weights() -> list[fx.Node | None]:
            recv = b.fn(comm.WAIT, pending, name="restore_recv")
            if plan.prefetch_depth:
                b.fn(restore_prefetch, placement_, recv, name="restore_prefetch")
            experts = b.fn(assemble, recv, P, tuple(shapes[n] for n in params), name="restored")
            restored = {name: b.item(experts, j, f"{_node(name)}_slots") for j, name in enumerate(params)}
            if plan.keep_restored:  # autograd keeps the C whole experts until this layer's backward
                return canonical.expert_weights(
                    b, spec.experts, lambda source, role: b.view(source, restored[attrs[role]], f"{role}_w"))
            # the backward restores again rather than keeping every layer's C whole experts alive
            again = b.fn(Restore, shards, slot_expert, group_name, tuple(shapes[n] for n in params), P,
                         name="restore_again")

            def read(source: TensorSource, role: str) -> fx.Node:
                view = b.view(source, restored[attrs[role]], f"{role}_slots")
                rebuild = b.fn(restore_reader, again, params.index(attrs[role]), source.chunk, source.chunk_dim,
                               source.transpose, name=f"{role}_rebuild")
                return b.fn(dialect.rebuildable, view, rebuild, name=f"{role}_w")

            return canonical.expert_weights(b, spec.experts, read)

        return weights

    counts = exchange.insert_exchange(gm, b, buckets=P * C, local=C, group_name=group_name, world=groups.world_size,
                                      route=route, issue_weights=issue_restore, axis="U")
    stats: dict[str, Any] = {"experts": E, "slots_per_device": C, "fsep_size": P, "dp_size": groups.dp_size,
             "replicas": P * C - E, "planner": plan.planner if isinstance(plan.planner, str) else "callable",
             "backward_restore": "kept from the forward" if plan.keep_restored else "restored again",
             "expert_grads": "deferred" if plan.defer_expert_grads else "waited",
             "capacity": counts["capacity"]}
    effects.form, effects.layout = PASS, layout
    return PassResult(gm, changed=True, stats=stats, effects=effects)


def chain_restores(model: nn.Module) -> int:
    """Link the FSEP blocks of `model` (module order) so each prefetches the next ones' restores; returns the
    number of blocks linked. Called once by `moepass.compile` after every block is rewritten."""
    members = []
    for module in model.modules():
        if isinstance(module, MoEGraphModule) and isinstance(module.layout, FSEPLayout):
            controller = module.get_submodule(module.layout.controller)
            assert isinstance(controller, FSEPPlacement) and controller.restore is not None
            controller.restore.block = weakref.ref(module)
            members.append(controller)
    chain = PrefetchChain(members)
    for position, controller in enumerate(members):
        controller.chain, controller.position = chain, position
    return len(members)


def controllers(model: nn.Module) -> dict[str, FSEPPlacement]:
    """Block path -> the FSEP placement controller of every FSEP block in `model`."""
    found = {}
    for path, module in model.named_modules():
        if isinstance(module, MoEGraphModule) and isinstance(module.layout, FSEPLayout):
            controller = module.get_submodule(module.layout.controller)
            assert isinstance(controller, FSEPPlacement)
            found[path] = controller
    return found
