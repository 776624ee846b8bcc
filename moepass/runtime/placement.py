"""FSEP placement: which experts each device computes, how tokens reach them, and the planner choosing both.

Terms (the contract with `moepass.runtime.fsep_ops` and `moepass.rewrite.fsep`):

- W devices (ranks), node(n) = n // ranks_per_node; C slots per device; global slot g = n*C + c.
- A placement table `slot_expert` [W*C]: the expert each slot hosts. Valid iff every one of the E experts
  appears at least once; an expert may appear several times (replicas), even on one device.
- Lite routing, for the n_ie rows source rank i sends to expert e: R_e = the slots hosting e in increasing
  g; Local = those on node(i); Pref = Local if non-empty else R_e; m = len(Pref). Row j (0 <= j < n_ie)
  goes to Pref[(j*m) // n_ie], so Pref[q] receives ceil((q+1)*n/m) - ceil(q*n/m) rows (`lite_route_counts`).
- The planner (`plan`) prices two candidate tables on counts summed over the last `history` steps
  (`CountHistory`) with `cost_model.fsep.planner_cost` and keeps the cheaper. `planned_routing`: what it
  makes of a routing that repeats every step (its table and the rows lite routing sends), which the plan
  search and the simulator price FSEP with.

Determinism: every rank runs `plan` on identical counts and must get the identical table. Everything
that decides is exact: counts are int64, load-per-replica orderings use an exact integer key
(`_ratio_key`), ties fall to the lower index, the costs read three integer totals (so no float
reduction order matters), and nothing iterates a set or depends on a dict's history. No randomness,
no threads: the caller runs `plan` on a worker thread. torch's intra-op threads are process-wide; on a
busy host one is fastest (benchmarks/fsep_planner.py).

Shape letters: `moepass.spec.SHAPES` (here W ranks as sources and as devices, U = W*C global slots, n nodes, r
the ranks of one node as sources, u the r*C slots of one node, m residues modulo an expert's replica count).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from cost_model import ep as ep_cost
from cost_model import fsep as fsep_cost

CANDIDATES = ("even", "proportional")  # pricing order; on equal cost the earlier one is kept


# ---- the table -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlacementTable:
    """Expert per global slot: `slot_expert[n*slots + c]` is the expert in slot c of device n.

    `experts` (E) defaults to max(slot_expert) + 1; give it so that a missing top expert is caught.
    Constructing validates (see `validate`).
    """

    slot_expert: tuple[int, ...]
    world: int
    slots: int
    ranks_per_node: int
    experts: int | None = None
    replicas: tuple[int, ...] = field(init=False, repr=False, compare=False)
    expert_slots: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        values = self.slot_expert.tolist() if isinstance(self.slot_expert, torch.Tensor) else self.slot_expert
        object.__setattr__(self, "slot_expert", tuple(int(v) for v in values))
        if self.experts is None and self.slot_expert:
            object.__setattr__(self, "experts", max(self.slot_expert) + 1)
        self.validate()
        E = int(self.experts or 0)
        slots_of: list[list[int]] = [[] for _ in range(E)]
        for g, e in enumerate(self.slot_expert):
            slots_of[e].append(g)
        object.__setattr__(self, "expert_slots", tuple(tuple(s) for s in slots_of))
        object.__setattr__(self, "replicas", tuple(len(s) for s in slots_of))

    def validate(self) -> PlacementTable:
        """Raise ValueError naming the first problem: sizes, ranks_per_node, expert ids, a missing expert."""
        for name in ("world", "slots", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PlacementTable.{name}={value!r} is invalid: use a positive int")
        W, C, E = self.world, self.slots, self.experts
        if W % self.ranks_per_node:
            raise ValueError(f"PlacementTable.ranks_per_node={self.ranks_per_node} does not divide world={W}: "
                             f"ranks are node-major, so every node must hold the same number of ranks")
        if len(self.slot_expert) != W * C:
            raise ValueError(f"PlacementTable.slot_expert has {len(self.slot_expert)} entries, expected "
                             f"world*slots = {W}*{C} = {W * C}: one expert id per global slot g = n*slots + c")
        if isinstance(E, bool) or not isinstance(E, int) or E < 1:
            raise ValueError(f"PlacementTable.experts={E!r} is invalid: use the number of experts E >= 1")
        if W * C < E:
            raise ValueError(f"PlacementTable: world*slots = {W}*{C} = {W * C} slots < experts = {E}: every expert "
                             f"needs a slot; use slots >= ceil(E/world) = {-(-E // W)}")
        bad = [(g, e) for g, e in enumerate(self.slot_expert) if not 0 <= e < E]
        if bad:
            g, e = bad[0]
            raise ValueError(f"PlacementTable.slot_expert[{g}]={e} is not an expert id in [0, {E}) "
                             f"({len(bad)} such slot(s))")
        missing = sorted(set(range(E)) - set(self.slot_expert))
        if missing:
            raise ValueError(f"PlacementTable.slot_expert hosts no replica of expert(s) {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}: every expert needs at least one slot")
        return self

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def device_experts(self, n: int) -> tuple[int, ...]:
        """The C experts device n computes, in slot order."""
        return self.slot_expert[n * self.slots:(n + 1) * self.slots]

    def as_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """`slot_expert` as an int64 tensor [W*C] on `device`."""
        return torch.tensor(self.slot_expert, dtype=torch.int64, device=device)


# ---- lite routing ------------------------------------------------------------------------------------


def _rank_within(key_U: torch.Tensor) -> torch.Tensor:
    """[U] position of each entry among the entries with the same key, in increasing index."""
    order = torch.argsort(key_U, stable=True)
    sorted_key = key_U[order]
    idx = torch.arange(key_U.numel())
    start = torch.ones_like(sorted_key, dtype=torch.bool)
    start[1:] = sorted_key[1:] != sorted_key[:-1]
    first = torch.cummax(torch.where(start, idx, torch.zeros_like(idx)), dim=0).values
    rank = torch.empty_like(idx)
    rank[order] = idx - first
    return rank


def _as_counts(counts_WE: Any, W: int | None = None, E: int | None = None) -> torch.Tensor:
    """[W, E] counts as a contiguous int64 CPU tensor; ValueError on a wrong shape, negative or fractional counts."""
    counts = torch.as_tensor(counts_WE).detach().cpu()
    if counts.ndim != 2:
        raise ValueError(f"counts_WE has shape {tuple(counts.shape)}: expected [W, E] (source rank, expert)")
    if (W is not None and counts.shape[0] != W) or (E is not None and counts.shape[1] != E):
        raise ValueError(f"counts_WE has shape {tuple(counts.shape)}: expected [W, E] = [{W}, {E}]")
    if counts.is_floating_point():
        if not bool(torch.all(torch.isfinite(counts) & (counts == torch.round(counts)))):
            raise ValueError("counts_WE holds fractional or non-finite values: pass integer token counts")
        counts = counts.round()
    counts = counts.to(torch.int64).contiguous()
    if bool((counts < 0).any()):
        raise ValueError("counts_WE holds negative values: token counts are >= 0")
    return counts


class _SlotLayout(NamedTuple):
    """Per-slot facts of one table that lite routing reads (all [U] = [W*C] int64 unless noted)."""

    expert: torch.Tensor  # expert in slot g
    node: torch.Tensor  # node of slot g
    on_node_En: torch.Tensor  # [E, n] replicas of expert e on node n
    replicas: torch.Tensor  # replicas of slot g's expert (len(R_e))
    global_rank: torch.Tensor  # position of g in R_e
    local_rank: torch.Tensor  # position of g among R_e's slots on its node


def _slot_layout(table: PlacementTable) -> _SlotLayout:
    W, C, rpn, E = table.world, table.slots, table.ranks_per_node, int(table.experts or 0)
    N, n_slots = W // rpn, W * C
    expert = table.as_tensor()
    node = torch.arange(n_slots) // C // rpn
    on_node = torch.zeros(E * N, dtype=torch.int64).index_add_(0, expert * N + node,
                                                               torch.ones(n_slots, dtype=torch.int64))
    replicas = torch.bincount(expert, minlength=E)[expert]
    return _SlotLayout(expert, node, on_node.view(E, N), replicas, _rank_within(expert), _rank_within(expert * N + node))


def _split(q: torch.Tensor, n: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Rows Pref[q] receives of n rows split over m slots: ceil((q+1)*n/m) - ceil(q*n/m) (int64, broadcast)."""
    lo = q * n + (m - 1)
    return torch.div(lo + n, m, rounding_mode="floor") - torch.div(lo, m, rounding_mode="floor")


def lite_route_counts(counts_WE: Any, table: PlacementTable) -> torch.Tensor:
    """S [W, W*C] int64: rows source rank i sends to global slot g under lite routing (module docstring).

    Exact: every source's rows to expert e are split over its Pref slots with the integer formula, so
    S summed over the slots of e equals counts_WE[:, e]. Dense (W x W*C): the reference the runtime's
    routing is checked against; the planner prices with `route_totals`, which never builds S.
    """
    W, C, rpn = table.world, table.slots, table.ranks_per_node
    counts = _as_counts(counts_WE, W, table.experts)
    N, n_slots = W // rpn, W * C
    lay = _slot_layout(table)
    # per (source node, slot): is the slot in Pref, its position q in Pref, and m = len(Pref)
    local_m_nU = lay.on_node_En[lay.expert].T  # [n, U] replicas of slot g's expert on node n
    has_local = local_m_nU > 0
    same_node = lay.node[None, :] == torch.arange(N)[:, None]
    in_pref = torch.where(has_local, same_node, torch.ones_like(same_node))
    m_nU = torch.where(has_local, local_m_nU, lay.replicas[None, :])
    q_nU = torch.where(has_local, lay.local_rank[None, :], lay.global_rank[None, :])
    n_nrU = counts[:, lay.expert].view(N, rpn, n_slots)  # rows of each source (node, rank in node) for g's expert
    S = _split(q_nU[:, None, :], n_nrU, m_nU[:, None, :]) * in_pref[:, None, :]
    return S.view(W, n_slots)


class RouteTotals(NamedTuple):
    """What the planner's cost reads from lite routing, exact: rows sent within / across nodes (summed
    over sources, own-device rows in neither) and [W] rows each device computes."""

    q_intra: int
    q_inter: int
    loads: torch.Tensor


def route_totals(counts_WE: Any, table: PlacementTable) -> RouteTotals:
    """`RouteTotals` of lite routing without building S (equal to reducing `lite_route_counts`).

    On-node rows: each node's sources and slots only ([n, r, u]). Off-node rows (expert e has no
    replica on the source's node) split over all of R_e: slot q of e receives sum_i ceil((q+1) n_i/m) -
    ceil(q n_i/m), and sum_i ceil(q n_i/m) = (q * sum_i n_i + sum_i ((-q * (n_i mod m)) mod m)) / m, so a
    histogram of n_i mod m per expert replaces the [sources, slots] matrix.
    """
    W, C, rpn = table.world, table.slots, table.ranks_per_node
    E = int(table.experts or 0)
    counts = _as_counts(counts_WE, W, E)
    N, n_slots, node_slots = W // rpn, W * C, rpn * C
    lay = _slot_layout(table)
    counts_nrE = counts.view(N, rpn, E)
    off_node_nE = lay.on_node_En.T == 0  # [n, E] expert e has no replica on node n
    q_inter = int((counts_nrE.sum(dim=1) * off_node_nE).sum())
    # on-node part: node n's sources to node n's slots
    expert_nu = lay.expert.view(N, node_slots)
    n_local = counts_nrE.gather(2, expert_nu[:, None, :].expand(N, rpn, node_slots))  # [n, r, u]
    m_local = lay.on_node_En[lay.expert, lay.node].view(N, 1, node_slots)
    rows_local = _split(lay.local_rank.view(N, 1, node_slots), n_local, m_local)
    own = int(rows_local.view(N, rpn, rpn, C).diagonal(dim1=1, dim2=2).sum())
    q_intra = int(counts.sum()) - q_inter - own
    slot_rows = rows_local.sum(dim=1).reshape(n_slots)
    # off-node part, per expert with off-node sources
    has_off_E = off_node_nE.any(dim=0)
    if bool(has_off_E.any()):
        m_E = torch.bincount(lay.expert, minlength=E)
        M = int(m_E[has_off_E].max())  # residues n_i mod m_e < M for every expert with off-node sources
        off_nrE = off_node_nE[:, None, :].expand(N, rpn, E)
        residue = torch.where(off_nrE, counts_nrE % m_E, 0)
        hist_Em = torch.zeros(E * M, dtype=torch.int64).index_add_(
            0, (torch.arange(E) * M + residue).flatten(), off_nrE.to(torch.int64).flatten()).view(E, M)
        sum_E = (counts_nrE.sum(dim=1) * off_node_nE).sum(dim=0)  # off-node rows to each expert
        g = torch.nonzero(has_off_E[lay.expert]).flatten()  # slots whose expert has off-node sources
        e_g, q_g, m_g = lay.expert[g], lay.global_rank[g], m_E[lay.expert[g]]
        rho = torch.arange(M)

        def ceil_sum(q: torch.Tensor) -> torch.Tensor:  # m * sum_i ceil(q n_i / m), per slot
            return q * sum_E[e_g] + (hist_Em[e_g] * torch.remainder(-q[:, None] * rho, m_g[:, None])).sum(dim=1)

        slot_rows[g] += torch.div(ceil_sum(q_g + 1) - ceil_sum(q_g), m_g, rounding_mode="floor")
    return RouteTotals(q_intra, q_inter, slot_rows.view(W, C).sum(dim=1))


def device_rows(rows_WU: torch.Tensor, slots: int) -> torch.Tensor:
    """[W, W] rows source rank i sends to device k, from the per-slot rows S [W, W*C]."""
    W = rows_WU.shape[0]
    return rows_WU.view(W, W, slots).sum(dim=2)


def device_loads(rows_WU: torch.Tensor, slots: int) -> torch.Tensor:
    """[W] rows each device computes (all sources, all its slots)."""
    return device_rows(rows_WU, slots).sum(dim=0)


def max_over_mean(loads: Any) -> float:
    """max / mean of per-device rows (1.0 when nothing is routed)."""
    loads_t = torch.as_tensor(loads, dtype=torch.float64)
    mean = float(loads_t.mean())
    return float(loads_t.max()) / mean if mean > 0 else 1.0


# ---- the configuration and the count history -----------------------------------------------------------


@dataclass(frozen=True)
class PlannerConfig:
    """What the planner prices with. E experts, W ranks, C slots per device, ranks_per_node (node-major);
    counts are summed over `history` steps; bytes_per_token (D*b), time_per_token (forward expert GEMM
    seconds per routed row), intra_bw / inter_bw (bytes/s); `recompute`: extra forward passes the backward
    spends recomputing (0, or (m-1)/m with `Plan.expert_recompute`). The defaults of the four figures are
    units (a cost in rows): `from_hardware` gives real ones."""

    E: int
    W: int
    C: int
    ranks_per_node: int
    history: int = 5
    bytes_per_token: float = 1.0
    time_per_token: float = 1.0
    intra_bw: float = 1.0
    inter_bw: float = 1.0
    recompute: float = 0.0

    def __post_init__(self) -> None:
        for name in ("E", "W", "C", "ranks_per_node", "history"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PlannerConfig.{name}={value!r} is invalid: use a positive int")
        if self.W % self.ranks_per_node:
            raise ValueError(f"PlannerConfig.ranks_per_node={self.ranks_per_node} does not divide W={self.W}: "
                             f"use the number of ranks on each node (ranks are node-major)")
        if self.W * self.C < self.E:
            raise ValueError(f"PlannerConfig: W*C = {self.W}*{self.C} = {self.W * self.C} slots < E = {self.E} "
                             f"experts: every expert needs a slot; raise C to >= ceil(E/W) = {-(-self.E // self.W)}")
        for name in ("bytes_per_token", "time_per_token", "intra_bw", "inter_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PlannerConfig.{name}={getattr(self, name)!r} is invalid: use a positive number")
        if not self.recompute >= 0:
            raise ValueError(f"PlannerConfig.recompute={self.recompute!r} is invalid: use a number >= 0")

    @property
    def nodes(self) -> int:
        return self.W // self.ranks_per_node

    @classmethod
    def from_hardware(cls, hw: Any, *, E: int, W: int, C: int, ranks_per_node: int, D: int, F: int,
                      gated: bool = True, history: int = 5, recompute: bool | None = None) -> PlannerConfig:
        """From a `cost_model.presets.Hardware` and the expert FFN's dims (D wide, F hidden, gated or not).

        bytes_per_token = D*b, time_per_token = 2*m*D*F / (flops * efficiency), the two bandwidths as given;
        `recompute` None takes the hardware's figure (`Hardware.recompute`).
        """
        v = hw.values()
        m = 3 if gated else 2
        r_c = v["r_c"] if recompute is None else float(recompute)
        return cls(
            E=E, W=W, C=C, ranks_per_node=ranks_per_node, history=history,
            bytes_per_token=float(fsep_cost.token_bytes(D, v["b"])),
            time_per_token=float(fsep_cost.token_time(D, F, m, v["R"], v["eta"])),
            intra_bw=v["B_intra"], inter_bw=v["B_inter"], recompute=r_c * (m - 1) / m,
        )


class CountHistory:
    """Ring buffer of the last `history` [W, E] count matrices; `total()` is their exact int64 sum."""

    def __init__(self, history: int, W: int, E: int) -> None:
        if history < 1:
            raise ValueError(f"CountHistory.history={history!r} is invalid: use a positive int")
        self.history, self.W, self.E = history, W, E
        self._buf = torch.zeros(history, W, E, dtype=torch.int64)
        self._next = 0
        self._filled = 0

    def push(self, counts_WE: Any) -> None:
        """Record one step's counts (replaces the oldest once `history` steps are held)."""
        self._buf[self._next] = _as_counts(counts_WE, self.W, self.E)
        self._next = (self._next + 1) % self.history
        self._filled = min(self._filled + 1, self.history)

    def total(self) -> torch.Tensor:
        """[W, E] counts summed over the steps held (zeros before the first push)."""
        return self._buf.sum(dim=0)

    def __len__(self) -> int:
        return self._filled

    def state(self) -> dict[str, Any]:
        """What `load_state` needs to continue bit for bit (a checkpoint): the ring, its cursor and fill."""
        return {"buf": self._buf.clone(), "next": self._next, "filled": self._filled}

    def load_state(self, state: dict[str, Any]) -> None:
        buf = state["buf"]
        if tuple(buf.shape) != tuple(self._buf.shape):
            raise ValueError(f"CountHistory.load_state: a ring of shape {tuple(buf.shape)} does not fit this one's "
                             f"{tuple(self._buf.shape)} (history, W, E): load it at the world size and expert count "
                             f"it was saved at")
        self._buf.copy_(buf)
        self._next, self._filled = int(state["next"]), int(state["filled"])


# ---- candidates: replicas per expert -----------------------------------------------------------------


def even_replicas(loads_E: Sequence[int], total: int) -> list[int]:
    """total // E replicas each; the total % E left over go to the most loaded experts (ties: lower index)."""
    E = len(loads_E)
    base, extra = divmod(total, E)
    reps = [base] * E
    for e in sorted(range(E), key=lambda e: (-loads_E[e], e))[:extra]:
        reps[e] += 1
    return reps


def proportional_replicas(loads_E: Sequence[int], total: int, start: int = 1) -> list[int]:
    """`start` replicas each, then +1 to the expert with the largest load / replicas until `total`.

    Ties (equal load / replicas, compared exactly): fewer replicas first, then lower index, so that
    equal loads (all zero, say) share the spare slots round-robin.
    """
    E = len(loads_E)
    if start * E > total:
        raise ValueError(f"proportional_replicas: start={start} replicas for each of {E} experts exceed total={total}")
    reps = [start] * E
    scale = total * total  # key(L, r) = L * scale // r orders L/r exactly for r <= total (see _ratio_key)
    heap = [(-_ratio_key(loads_E[e], start, scale), start, e) for e in range(E)]
    heapq.heapify(heap)
    for _ in range(total - start * E):
        _, r, e = heapq.heappop(heap)
        reps[e] = r + 1
        heapq.heappush(heap, (-_ratio_key(loads_E[e], r + 1, scale), r + 1, e))
    return reps


def _ratio_key(load: int, r: int, scale: int) -> int:
    """An integer that orders load / r exactly among ratios with denominators r <= sqrt(scale).

    Distinct ratios a/b > c/d differ by >= 1/(b*d) >= 1/scale, so floor(x*scale) keeps them apart and in
    order; equal ratios give equal keys. Python ints: no overflow.
    """
    return int(load) * scale // r


# ---- candidates: placing the replicas ---------------------------------------------------------------------


def place(replicas_E: Sequence[int], loads_E: Sequence[int], W: int, C: int, ranks_per_node: int) -> list[int]:
    """slot_expert [W*C] for the given replicas per expert (sum = W*C).

    Replica units go in decreasing per-replica load L_e / r_e (exact; ties: lower expert index), so all
    units of one expert are consecutive. Each unit goes to a node holding the fewest replicas of its
    expert among nodes with a free slot, and there to the least-loaded device with a free slot (ties:
    lower device index). Unit j of expert e carries ceil((j+1)L/r) - ceil(jL/r) of its load: integer
    device loads, the split lite routing makes. A device fills its slots c = 0, 1, ... in placement order.
    """
    E, n_slots = len(replicas_E), W * C
    if sum(replicas_E) != n_slots or min(replicas_E) < 1:
        raise ValueError(f"place: replicas {list(replicas_E)} must be >= 1 each and sum to W*C = {n_slots}")
    rpn = ranks_per_node
    N = W // rpn
    scale = n_slots * n_slots
    order = sorted(range(E), key=lambda e: (-_ratio_key(loads_E[e], replicas_E[e], scale), e))
    load = [0] * W
    filled = [0] * W
    slot_expert = [-1] * n_slots
    dev_heaps = [[(0, d) for d in range(n * rpn, (n + 1) * rpn)] for n in range(N)]  # (load, device), free devices
    # nodes with a free slot, keyed by their least-loaded free device (load, device)
    node_heap = [(dev_heaps[n][0][0], dev_heaps[n][0][1], n) for n in range(N)]
    heapq.heapify(node_heap)
    for e in order:
        r, L = replicas_E[e], int(loads_E[e])
        used: list[tuple[int, int, int]] = []  # nodes given a replica of e in this round
        for j in range(r):
            if not node_heap:  # every node with a free slot holds one more replica of e: next round
                node_heap, used = used, []
                heapq.heapify(node_heap)
            _, d, n = heapq.heappop(node_heap)
            heapq.heappop(dev_heaps[n])
            slot_expert[d * C + filled[d]] = e
            filled[d] += 1
            load[d] += -(-(j + 1) * L // r) - -(-j * L // r)
            if filled[d] < C:
                heapq.heappush(dev_heaps[n], (load[d], d))
            if dev_heaps[n]:
                used.append((dev_heaps[n][0][0], dev_heaps[n][0][1], n))
        for item in used:
            heapq.heappush(node_heap, item)
    return slot_expert


def even_table(E: int, W: int, C: int, ranks_per_node: int) -> PlacementTable:
    """The static placement before any counts: the "even" candidate under uniform load (node-spreading:
    each expert's C*W/E replicas spread over the nodes, the leftover W*C % E slots to the lowest experts)."""
    PlannerConfig(E=E, W=W, C=C, ranks_per_node=ranks_per_node)  # validates the sizes
    replicas = even_replicas([1] * E, W * C)
    return PlacementTable(tuple(place(replicas, replicas, W, C, ranks_per_node)), W, C, ranks_per_node, E)


def candidate_tables(counts_WE: Any, config: PlannerConfig) -> dict[str, PlacementTable]:
    """The two candidates for these counts, in `CANDIDATES` order."""
    counts = _as_counts(counts_WE, config.W, config.E)
    loads = counts.sum(dim=0).tolist()
    total = config.W * config.C
    start = config.nodes if total >= config.E * config.nodes else 1  # one replica per node when W*C allows
    replicas = {"even": even_replicas(loads, total), "proportional": proportional_replicas(loads, total, start)}
    return {name: PlacementTable(tuple(place(replicas[name], loads, config.W, config.C, config.ranks_per_node)),
                                 config.W, config.C, config.ranks_per_node, config.E)
            for name in CANDIDATES}


# ---- the planner ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """The planner's choice for one layer and what it compared.

    costs: candidate -> planner cost in seconds for the counts given (a `history`-step sum);
    max_over_mean / ep_max_over_mean: per-device rows of the chosen table under lite routing, and of
    plain EP (`cost_model.fsep.ep_device_rows`, EP degree `ep_size`) for the same counts.
    """

    table: PlacementTable
    candidate: str
    costs: dict[str, float]
    max_over_mean: float
    ep_max_over_mean: float
    ep_size: int
    solve_s: float

    def summary(self) -> str:
        costs = ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in self.costs.items())
        return (f"{self.candidate} (costs: {costs}); max/mean {self.max_over_mean:.3f} vs EP "
                f"{self.ep_max_over_mean:.3f} (ep={self.ep_size}); solved in {self.solve_s * 1e3:.3g} ms")


def table_cost(counts_WE: Any, table: PlacementTable, config: PlannerConfig) -> tuple[float, torch.Tensor]:
    """(planner cost in seconds, [W] rows per device) of `table` under lite routing of `counts_WE`."""
    totals = route_totals(counts_WE, table)
    cost = fsep_cost.planner_cost(totals.q_intra, totals.q_inter, int(totals.loads.max()), config.bytes_per_token,
                                  config.time_per_token, config.intra_bw, config.inter_bw, recompute=config.recompute)
    return float(cost), totals.loads


def plan(counts_WE: Any, config: PlannerConfig) -> Decision:
    """Price both candidates on `counts_WE` [W, E] (token counts summed over the last `history` steps)
    and return the cheaper (on equal cost: the earlier in `CANDIDATES`)."""
    start = time.perf_counter()
    counts = _as_counts(counts_WE, config.W, config.E)
    best: tuple[float, str, PlacementTable, torch.Tensor] | None = None
    costs: dict[str, float] = {}
    for name, table in candidate_tables(counts, config).items():
        cost, loads = table_cost(counts, table, config)
        costs[name] = cost
        if best is None or cost < best[0]:
            best = (cost, name, table, loads)
    assert best is not None
    _, name, table, loads = best
    ep_size = max(d for d in range(1, config.W + 1) if config.W % d == 0 and config.E % d == 0)
    ep_rows = fsep_cost.ep_device_rows(counts, ep_size)
    return Decision(table, name, costs, max_over_mean(loads), max_over_mean(torch.as_tensor(ep_rows)), ep_size,
                    time.perf_counter() - start)


# ---- what the planner makes of a steady routing (the plan search and the simulator price FSEP with it) -----


@dataclass(frozen=True)
class PlannedRouting:
    """The planner's decision for a steady routing and the rows lite routing sends under its table.

    decision: the planner's `Decision` (table, candidate, max/mean vs plain EP's);
    rows_PP: [W, W] int64 rows source rank i sends to device k (own-device rows on the diagonal).
    """

    decision: Decision
    rows_PP: np.ndarray

    @property
    def mean_rows(self) -> float:
        """Routed rows per rank (T*K*phi: the FFN rows): the mean a device computes."""
        return float(self.rows_PP.sum()) / self.rows_PP.shape[0]

    @property
    def max_over_mean(self) -> float:
        """The busiest device's rows over the mean (1.0 when nothing is routed)."""
        mean = self.mean_rows
        return float(self.rows_PP.sum(axis=0).max()) / mean if mean > 0 else 1.0

    def busiest_a2a_rows(self, ranks_per_node: int, B_intra: float, B_inter: float) -> tuple[float, float]:
        """(intra-node, inter-node) rows of the token all-to-all's slowest rank and direction (sending the
        dispatch or receiving it; the combine is its transpose), over the mean routed rows per rank."""
        a2a = ep_cost.exact_a2a(self.rows_PP, 1, 1, ranks_per_node)
        mean = self.mean_rows or 1.0
        ends = [(a2a.sent_intra, a2a.sent_inter), (a2a.recv_intra, a2a.recv_inter)]
        intra, inter = max(((float(i[k]), float(o[k])) for i, o in ends for k in range(len(i))),
                           key=lambda io: io[0] / B_intra + io[1] / B_inter)
        return intra / mean, inter / mean


def planned_routing(counts_WE: Any, hw: Any, *, C: int, ranks_per_node: int, D: int, F: int, gated: bool,
                    recompute: bool | None = None, history_aWE: Any = None) -> PlannedRouting:
    """What FSEP does with [W source ranks, E experts] routed rows: the table `plan` picks from them (summed
    over its history, as the runtime does; costs from `hw`, a `cost_model.presets.Hardware`) and the rows lite
    routing sends under it. Float counts are rounded per row (`cost_model.fsep.integer_rows`). `history_aWE`:
    the earlier steps' counts the planner plans from, when the routing moves (the table is then priced on
    `counts_WE`, the step after them); without it the same routing repeats on each step of its history."""
    counts = fsep_cost.integer_rows(counts_WE)
    W, E = counts.shape
    config = PlannerConfig.from_hardware(hw, E=E, W=W, C=C, ranks_per_node=ranks_per_node, D=D, F=F, gated=gated,
                                         recompute=recompute)
    seen = counts * config.history if history_aWE is None else sum(fsep_cost.integer_rows(h) for h in history_aWE)
    decision = plan(seen, config)
    rows_PP = device_rows(lite_route_counts(counts, decision.table), C).numpy()
    return PlannedRouting(decision, rows_PP)


__all__ = [
    "CANDIDATES", "CountHistory", "Decision", "PlacementTable", "PlannedRouting", "PlannerConfig", "candidate_tables",
    "device_loads", "device_rows", "even_replicas", "even_table", "lite_route_counts", "max_over_mean", "place", "plan",
    "planned_routing", "proportional_replicas", "route_totals", "table_cost",
]
