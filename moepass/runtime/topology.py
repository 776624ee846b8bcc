"""Topology (nodes × ranks per node) and the process groups of one EP layout.

Ranks are numbered node-major: rank r lives on node r // ranks_per_node (torchrun's numbering). On
one machine the "nodes" are simulated by that grouping; byte counters classify every peer as self,
intra-node or inter-node with it.

EP layout over W ranks with EP degree P (P divides W; data parallel over the other W/P):

    mesh = DeviceMesh(("dp", "ep"), shape (W/P, P)),   rank = dp_index * P + ep_index

so each EP group is P consecutive ranks (inside a node when P <= ranks_per_node) and each DP group
holds the ranks that own the same experts. Three sets of groups, never shared:
  - the mesh's own groups (DTensor: clip_grad_norm_, full_tensor, DCP),
  - `ep_group`: the expert all-to-all and the count exchange,
  - `dp_group`: the expert-gradient all-reduce across replicas.
(DDP, if the user wraps the model, runs on its own group, by default the world.) The all-to-all and
gradient groups are created with the topology's timeout, so a dead peer becomes an error.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from moepass.errors import PlanError
from moepass.plan_options import TopologyLike
from moepass.process_state import WORLD_GROUPS

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Topology:
    """`nodes` × `ranks_per_node` ranks; `timeout` (seconds) bounds every moepass collective."""

    nodes: int
    ranks_per_node: int
    timeout: float = field(default=DEFAULT_TIMEOUT_S, compare=False)

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"Topology.{name}={value!r} is invalid: use a positive int.")
        if not self.timeout > 0:
            raise PlanError(f"Topology.timeout={self.timeout!r} is invalid: use a positive number of seconds.")

    @classmethod
    def from_env(cls, timeout: float = DEFAULT_TIMEOUT_S) -> Topology:
        """From torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE; else the initialised world as one node."""
        world = int(os.environ.get("WORLD_SIZE", "0")) or (dist.get_world_size() if dist.is_initialized() else 1)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or world
        if world % local:
            raise PlanError(f"LOCAL_WORLD_SIZE={local} does not divide WORLD_SIZE={world}: pass "
                            f"moepass.Topology(nodes, ranks_per_node) explicitly.")
        return cls(world // local, local, timeout)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def link(self, rank: int, peer: int) -> str:
        """"self", "intra" or "inter": how bytes from `rank` to `peer` travel."""
        if rank == peer:
            return "self"
        return "intra" if self.node_of(rank) == self.node_of(peer) else "inter"


@dataclass
class EPGroups:
    """The mesh and process groups of one (world, ep_size) layout, as seen from this rank."""

    topology: Topology
    ep_size: int
    dp_size: int
    rank: int
    mesh: DeviceMesh  # dims ("dp", "ep")
    ep_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    ep_ranks: list[int]  # global ranks of this rank's EP group, in EP order
    dp_ranks: list[int]

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.ep_size

    @property
    def world_size(self) -> int:
        return self.ep_size * self.dp_size

    def placements(self, shard_dim: int) -> list[Placement]:
        """DTensor placements, one per mesh dim, of a tensor whose dim `shard_dim` the group shards."""
        return [Replicate(), Shard(shard_dim)]


class _WorldCache:
    """The groups made here, valid for ONE default process group (the "world").

    Process groups die with their world (`destroy_process_group`; `explain` builds on a fake world
    and destroys it), and group names are reused by the next world. So the cache is tied to the
    identity of the default group it was filled under, through a weak reference: any other world
    (or a dead one, whose address a new group may reuse) finds an empty cache. Nothing has to be
    cleared by hand.
    """

    def __init__(self, world: dist.ProcessGroup | None) -> None:
        self.world = None if world is None else weakref.ref(world)
        self.groups: dict[tuple, EPGroups] = {}  # (world, ep_size, device, topology, timeout) -> groups
        self.info: dict[str, tuple[Topology, list[int]]] = {}  # group name -> (topology, global ranks)

    def belongs_to(self, world: dist.ProcessGroup | None) -> bool:
        return world is not None and self.world is not None and self.world() is world


def _cache() -> _WorldCache:
    """The cache of the current world (`process_state.WORLD_GROUPS`); a fresh one when the world changed since
    it was filled."""
    world = dist.group.WORLD if dist.is_initialized() else None
    cache = WORLD_GROUPS.value
    if cache is None or not cache.belongs_to(world):
        cache = _WorldCache(world)
        WORLD_GROUPS.set(cache)
    return cache


def group_info(group_name: str) -> tuple[Topology, list[int]]:
    """Topology and global ranks of a group made here (collectives use it for byte accounting)."""
    info = _cache().info
    if group_name not in info:
        raise KeyError(f"process group {group_name!r} was not made by moepass in the current world "
                       f"(its world was destroyed, or it is a user group): make it with moepass, or "
                       f"call moepass.runtime.topology.register_group(group, topology)")
    return info[group_name]


def resolve(given: TopologyLike | None, ep_size: int | None) -> tuple[Topology, int]:
    """Validate a plan's topology and EP degree against the initialised world."""
    if not dist.is_initialized():
        raise PlanError("Plan(form='ep') needs torch.distributed initialised (init_process_group) on every rank; "
                        "run under torchrun or torch.multiprocessing.spawn.")
    world = dist.get_world_size()
    topology = (Topology.from_env() if given is None else given if isinstance(given, Topology)
                else Topology(given.nodes, given.ranks_per_node))
    if topology.world_size != world:
        raise PlanError(f"Plan.topology={topology} is invalid: it has {topology.world_size} ranks but the world "
                        f"has {world}; use Topology(nodes, ranks_per_node) with nodes*ranks_per_node={world}.")
    ep_size = world if ep_size is None else ep_size
    if world % ep_size:
        raise PlanError(f"Plan.ep_size={ep_size} is invalid: it must divide the world size {world}.")
    return topology, ep_size


def ep_groups(topology: TopologyLike | None, ep_size: int | None, device_type: str) -> EPGroups:
    """The (cached) mesh and groups for this layout. Collective: every rank must call it, in order."""
    topology, ep_size = resolve(topology, ep_size)
    world, rank = dist.get_world_size(), dist.get_rank()
    cache = _cache()  # this world's groups only: a destroyed world's groups are never handed out
    key = (world, ep_size, device_type, topology, topology.timeout)
    if key in cache.groups:
        return cache.groups[key]
    dp_size = world // ep_size
    timeout = timedelta(seconds=topology.timeout)
    mesh = init_device_mesh(device_type, (dp_size, ep_size), mesh_dim_names=("dp", "ep"))
    ep_lists = [[d * ep_size + i for i in range(ep_size)] for d in range(dp_size)]
    dp_lists = [[d * ep_size + i for d in range(dp_size)] for i in range(ep_size)]
    ep_group, _ = dist.new_subgroups_by_enumeration(ep_lists, timeout=timeout, group_desc="moepass_ep_a2a")
    dp_group, _ = dist.new_subgroups_by_enumeration(dp_lists, timeout=timeout, group_desc="moepass_expert_grad")
    groups = EPGroups(topology, ep_size, dp_size, rank, mesh, ep_group, dp_group,
                      ep_lists[rank // ep_size], dp_lists[rank % ep_size])
    cache.info[ep_group.group_name] = (topology, groups.ep_ranks)
    cache.info[dp_group.group_name] = (topology, groups.dp_ranks)
    cache.groups[key] = groups
    return groups


@dataclass
class HeadEPGroups(EPGroups):
    """HP with EP inside (`Plan(form="hp", head_ep_size=P)`): a block's ep_size = G*P ranks as G head
    groups of P ranks each, on the mesh ("dp", "hp", "ep") of shape (W/(G*P), G, P):

        rank = dp_index * G*P + hp_index * P + ep_index

    The P ranks of an EP group (one head group) are consecutive: inside a node when P <= ranks_per_node,
    so the expert exchange, whose bytes grow with K and follow the routing, stays on the fast links. The
    HP exchange (equal splits, flat in K) runs between the G ranks sharing (dp_index, ep_index), across
    nodes when G*P > ranks_per_node. Inherited fields keep their EP meaning: ep_size = G*P ranks shard
    the block's experts (ep_rank = hp_index*P + ep_index), ep_group holds them, dp_group the replicas of
    this rank's shards. Groups of their own:
      - `hp_group` (G ranks): the equal-split HP exchange;
      - `expert_group` (P ranks): the variable-split expert exchange and its count exchange, and the
        selection bias's load sum;
      - `head_replica_group` (dp*P ranks holding this rank's heads): the router gradient sum.
    """

    head_groups: int  # G
    head_ep: int  # P
    hp_group: dist.ProcessGroup
    expert_group: dist.ProcessGroup
    head_replica_group: dist.ProcessGroup
    hp_ranks: list[int]
    expert_ranks: list[int]
    head_replica_ranks: list[int]

    @property
    def hp_rank(self) -> int:
        return self.ep_rank // self.head_ep

    @property
    def expert_rank(self) -> int:
        return self.ep_rank % self.head_ep

    def placements(self, shard_dim: int) -> list[Placement]:
        """Sharded over "hp", then each part over "ep": the flat shard index is ep_rank (as under EP)."""
        return [Replicate(), Shard(shard_dim), Shard(shard_dim)]

    def head_placements(self, shard_dim: int) -> list[Placement]:
        """A tensor sharded by heads only (routers, selection bias): replicated over "ep"."""
        return [Replicate(), Shard(shard_dim), Replicate()]


def _subgroups(lists: dict[str, list[list[int]]], topology: Topology, rank: int,
               desc: str) -> dict[str, tuple[dist.ProcessGroup, list[int]]]:
    """name -> (this rank's group, its ranks) for each enumeration of rank lists, registered in this world's
    cache for the byte counters. Collective: every rank makes every group, in order."""
    cache, timeout = _cache(), timedelta(seconds=topology.timeout)
    made = {}
    for what, enumeration in lists.items():
        group, _ = dist.new_subgroups_by_enumeration(enumeration, timeout=timeout, group_desc=desc.format(what))
        ranks = next(members for members in enumeration if rank in members)
        cache.info[group.group_name] = (topology, ranks)
        made[what] = (group, ranks)
    return made


def head_ep_groups(topology: TopologyLike | None, ep_size: int | None, head_ep_size: int,
                   device_type: str) -> HeadEPGroups:
    """The (cached) mesh and groups of HP with EP inside (see `HeadEPGroups`). Collective: every rank
    must call it, in order."""
    topology, ep_size = resolve(topology, ep_size)
    if ep_size % head_ep_size:
        raise PlanError(f"Plan.head_ep_size={head_ep_size} is invalid: it must divide the {ep_size} ranks of a block "
                        f"(Plan.ep_size, None: the world size) into head groups; use a divisor of {ep_size}.")
    world, rank = dist.get_world_size(), dist.get_rank()
    cache = _cache()
    key = ("hp_ep", world, ep_size, head_ep_size, device_type, topology, topology.timeout)
    if key in cache.groups:
        return cache.groups[key]  # type: ignore[return-value]
    dp, G, P = world // ep_size, ep_size // head_ep_size, head_ep_size
    mesh = init_device_mesh(device_type, (dp, G, P), mesh_dim_names=("dp", "hp", "ep"))
    lists = {
        "block": [[d * ep_size + i for i in range(ep_size)] for d in range(dp)],
        "dp": [[d * ep_size + i for d in range(dp)] for i in range(ep_size)],
        "hp": [[d * ep_size + g * P + p for g in range(G)] for d in range(dp) for p in range(P)],
        "expert": [[d * ep_size + g * P + p for p in range(P)] for d in range(dp) for g in range(G)],
        "head_replica": [[d * ep_size + g * P + p for d in range(dp) for p in range(P)] for g in range(G)],
    }
    made = _subgroups(lists, topology, rank, "moepass_hp_ep_{}")
    groups = HeadEPGroups(topology, ep_size, dp, rank, mesh, made["block"][0], made["dp"][0], made["block"][1],
                          made["dp"][1], G, P, made["hp"][0], made["expert"][0], made["head_replica"][0],
                          made["hp"][1], made["expert"][1], made["head_replica"][1])
    cache.groups[key] = groups
    return groups


def reset_groups() -> None:
    """Forget every cached group now. Not needed for correctness (a new world never sees the groups
    of a destroyed one, see `_WorldCache`); it only drops the references early."""
    WORLD_GROUPS.clear()


def register_group(group: dist.ProcessGroup, topology: Topology) -> None:
    """Make a user-made group usable by moepass collectives (byte accounting needs its ranks)."""
    _cache().info[group.group_name] = (topology, dist.get_process_group_ranks(group))


@dataclass
class NodeGroups:
    """The two groups of the hierarchical all-to-all (`Plan(hierarchical_a2a=True)`) of an EP group that
    spans `nodes` whole nodes of `ranks_per_node` ranks (group-local rank p = a*r + i: node a, local index i):

      - `intra_group`: the r ranks of this rank's node in the EP group (stage 1, fast links);
      - `inter_group`: the n ranks with this rank's local index on each node of the EP group (stage 2).
    """

    nodes: int  # n
    ranks_per_node: int  # r
    intra_group: dist.ProcessGroup
    inter_group: dist.ProcessGroup
    intra_ranks: list[int]
    inter_ranks: list[int]


def node_groups(groups: EPGroups) -> NodeGroups:
    """The (cached) groups of the hierarchical all-to-all over `groups`' EP groups. Collective: every rank
    must call it, in order. PlanError unless each EP group covers >= 2 whole nodes of >= 2 ranks (else
    one of the two stages would be empty and the exchange the flat one)."""
    topology, P = groups.topology, groups.ep_size
    r = topology.ranks_per_node
    if r < 2 or P % r or P // r < 2:
        why = (f"with {r} rank per node the intra-node stage is empty" if r < 2 else
               f"the EP group of {P} ranks lies inside one node of {r} ranks: every link is intra-node" if P <= r else
               f"the EP group of {P} ranks does not cover whole nodes of {r} ranks")
        raise PlanError(f"Plan.hierarchical_a2a=True is invalid for Plan.topology=Topology(nodes={topology.nodes}, "
                        f"ranks_per_node={r}) and ep_size={P}: {why}. "
                        f"It needs an EP group of >= 2 whole nodes with >= 2 ranks each (ep_size a multiple of "
                        f"ranks_per_node, >= 2*ranks_per_node); otherwise leave it False (the flat exchange).")
    world, rank = groups.world_size, groups.rank
    cache = _cache()
    key = ("nodes", world, P, topology, topology.timeout)
    if key in cache.groups:
        return cache.groups[key]  # type: ignore[return-value]
    n = P // r
    lists = {
        "intra": [[d * P + a * r + i for i in range(r)] for d in range(groups.dp_size) for a in range(n)],
        "inter": [[d * P + a * r + i for a in range(n)] for d in range(groups.dp_size) for i in range(r)],
    }
    made = _subgroups(lists, topology, rank, "moepass_a2a_{}_node")
    node = NodeGroups(n, r, made["intra"][0], made["inter"][0], made["intra"][1], made["inter"][1])
    cache.groups[key] = node  # type: ignore[assignment]
    return node
