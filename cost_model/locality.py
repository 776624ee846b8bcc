"""Locality-aware routing (LocMoE): the capacity floor of its Theorem 1, and the inter-node / intra-node
split of the token all-to-all as a function of the locality ratio.

Capacity floor. With tokens uniform on the unit sphere S^{D-1} and E mutually orthogonal gate vectors, a
token "belongs" to expert i when cos(theta) >= delta with its gate vector (delta: the cosine of the largest
angular deviation between a gate vector and the tokens routed to it, measured). cos^2(theta) of a uniform
token follows Beta(1/2, (D-1)/2), so the probability mass of the two caps |cos(theta)| >= delta is
1 - I_{delta^2}(1/2, (D-1)/2) (I the regularized incomplete beta), and the smallest expert capacity that
keeps the tokens belonging to an expert, as a token count, is

    ec_min = 1 / (E * (1 - I_{delta^2}(1/2, (D-1)/2)))  ~=  1 / (E * erfc(sqrt(delta^2 * D / (2 - delta^2))))

The capacity of an expert is then max(ceil(ec_min), ceil(T * c_f / E)), clamped to T.

Communication (top-1). W = N x G ranks, node-major (rank r on node r // G); E experts; T tokens per rank;
a row is D elements of b bytes. `Placement` gives every expert one home node:

- N <= E (N | E): node n holds the k = E/N consecutive experts [n*k, (n+1)*k). Inside it, E/W consecutive
  experts per rank when G | k; when k < G (k | G), expert j of the node on G/k consecutive ranks
  (replicas: every rank hosts one expert).
- N > E (E | N), "nodes > experts": expert e lives on node e*N/E, replicated on its G ranks; the other
  N - E nodes hold no expert. Their tokens all cross nodes whatever the router: locality stops paying
  there (the known limit of LocMoE). Replicating experts on every node (data parallel over EP groups,
  EP's ep < W) would give every node local experts; that is EP's layout, priced by `cost_model.ep`.

A token of rank r for expert e stays on r when r hosts e, else goes to replica (r mod c) of e's c ranks:
the same local rank on another node (rail-aligned), spread evenly inside its own node.

Locality ratio lam: the fraction of a node's tokens routed to experts on its own node. The routing model
is node-symmetric: a node with k local experts sends lam/k of its tokens to each of them and
(1 - lam)/(E - k) to each other expert; a node with no expert sends 1/E to each (its lam is 0).

  hash router    uniform by construction: lam = k/E (1/N when N <= E; 1/E on an expert's node when N > E)
  switch router  learned top-1 with the aux loss: uniform in expectation, lam = k/E, unless the scenario
                 gives the system a `locality_ratio`
  LocMoE         lam = 1 - f*(1 - k/E): the locality loss keeps a fraction 1 - f of the uniform router's
                 inter-node rows on the node. f defaults to MEASURED_INTER_FACTOR = 0.327, our own
                 measurement (benchmarks/results/locality.json, goals.inter_bytes_ratio: mu = 0.1, W = 2 as
                 two nodes, E = 8, dropless, the 'domain' data where each node trains on another domain);
                 the paper's own per-node figure is not recorded in this repository. With iid data per node
                 the same benchmark measured f = 1.0: the gain needs node-dependent data.

Bytes one rank sends per all-to-all direction (the dispatch; the combine is its reverse), h experts hosted
by the rank, C rows kept per (source rank, expert) (capacity; dropless: C = inf):

  intra = (k - h) * min(T*lam/k, C) * D*b                 dropless: T*D*b * lam * (1 - h/k)
  inter = (E - k) * min(T*(1 - lam)/(E - k), C) * D*b     dropless: T*D*b * (1 - lam)
  a rank of a node with no expert: inter = E * min(T/E, C) * D*b, intra = 0

Received: when N <= E every node is alike, so a rank receives what it sends. When N > E a rank of an
expert's node (k = h = 1) receives inter = [(E - 1)*min(T*(1 - lam)/(E - 1), C) + (N - E)*min(T/E, C)]*D*b
and an expert-less rank nothing. With capacity the bytes are bounded by C rows per (source rank, expert);
the floor of Theorem 1 sets C's minimum (`expert_capacity`).

Shape letters: `moepass.spec.SHAPES` (here P: the W ranks, as sources and as destinations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mpmath
import numpy as np

from cost_model.symbols import smin

ROUTERS = ("hash", "switch", "locmoe")
MEASURED_INTER_FACTOR = 0.327  # LocMoE's inter-node rows / the switch router's: benchmarks/results/locality.json


def capacity_floor(delta: float, num_experts: int, dim: int) -> float:
    """ec_min of Theorem 1 (a token count, not rounded). delta <= 0: every token lies in the caps, 1/E;
    delta >= 1: the caps are empty, no finite floor (inf: the capacity becomes T); dim == 1: S^0 is two
    points on the axis, cos^2 = 1, 1/E."""
    if num_experts < 1 or dim < 1:
        raise ValueError(f"capacity_floor: num_experts={num_experts} and dim={dim} must be >= 1")
    if delta >= 1.0:
        return math.inf
    if delta <= 0.0 or dim == 1:
        return 1.0 / num_experts
    # 1 - I_x(a, b) = I_{1-x}(b, a): the tail without the cancellation of 1 - I (which leaves nothing of a
    # mass of 1e-12 or below at 15 digits); 30 digits for the incomplete beta itself
    with mpmath.workdps(30):
        mass = mpmath.betainc(mpmath.mpf(dim - 1) / 2, 0.5, 0, 1 - mpmath.mpf(delta) ** 2, regularized=True)
        return float(1 / (num_experts * mass)) if mass > 0 else math.inf


def capacity_floor_erfc(delta: float, num_experts: int, dim: int) -> float:
    """The erfc approximation of `capacity_floor` (large D), for comparison."""
    if delta >= 1.0:
        return math.inf
    if delta <= 0.0:
        return 1.0 / num_experts
    tail = math.erfc(math.sqrt(delta * delta * dim / (2 - delta * delta)))
    return 1.0 / (num_experts * tail) if tail > 0 else math.inf


def expert_capacity(tokens: int, num_experts: int, capacity_factor: float, floor: float) -> int:
    """max(ceil(floor), ceil(tokens * capacity_factor / num_experts)), clamped to [0, tokens]."""
    if tokens <= 0:
        return 0
    by_factor = math.ceil(tokens * capacity_factor / num_experts)
    by_floor = tokens if math.isinf(floor) else math.ceil(floor)
    return min(tokens, max(by_floor, by_factor))


# ---- where the experts live -----------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """E experts over N nodes x G ranks, one home node per expert (module doc)."""

    experts: int  # E
    nodes: int  # N
    per_node: int  # G

    def __post_init__(self) -> None:
        E, N, G = self.experts, self.nodes, self.per_node
        if min(E, N, G) < 1:
            raise ValueError(f"Placement: experts={E}, nodes={N}, per_node={G} must all be >= 1")
        if N <= E and E % N:
            raise ValueError(f"Placement: experts={E} must be a multiple of nodes={N} (or nodes a multiple of experts): "
                             "change the node count or the expert count")
        if N > E and N % E:
            raise ValueError(f"Placement: nodes={N} > experts={E} must be a multiple of experts: change the node count")
        k = E // N
        if N <= E and k % G and G % k:
            raise ValueError(f"Placement: the {k} experts of a node must divide or be a multiple of per_node={G}: "
                             "change the ranks per node or the expert count")

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node

    @property
    def nodes_gt_experts(self) -> bool:
        """More nodes than experts: N - E nodes hold no expert."""
        return self.nodes > self.experts

    @property
    def node_experts(self) -> int:
        """k: experts on a node that holds any (E/N, or 1 when N > E)."""
        return max(1, self.experts // self.nodes)

    @property
    def rank_experts(self) -> int:
        """h: experts hosted by a rank of such a node (E/W, or 1 when a node has fewer experts than ranks)."""
        return max(1, self.experts // self.ranks)

    def home(self, expert: int) -> int:
        """The node that holds `expert`."""
        if self.nodes_gt_experts:
            return expert * (self.nodes // self.experts)
        return expert // self.node_experts

    def local_experts(self, node: int) -> list[int]:
        return [e for e in range(self.experts) if self.home(e) == node]

    def hosts(self, expert: int) -> list[int]:
        """The ranks holding `expert` (consecutive ranks of its home node)."""
        G, k, node = self.per_node, self.node_experts, self.home(expert)
        if self.nodes_gt_experts:
            return list(range(node * G, (node + 1) * G))
        j = expert - node * k  # its index among the node's experts
        if k >= G:
            return [node * G + j // (k // G)]
        c = G // k
        return list(range(node * G + j * c, node * G + (j + 1) * c))

    def target(self, src: int, expert: int) -> int:
        """The rank that computes `src`'s tokens for `expert`: src itself when it hosts it, else replica
        (src mod c)."""
        hosts = self.hosts(expert)
        return src if src in hosts else hosts[src % len(hosts)]


# ---- the locality ratio of each router --------------------------------------------------------------


def uniform_ratio(placement: Placement) -> float:
    """lam of a uniform router on a node that holds experts: k/E."""
    return placement.node_experts / placement.experts


def router_ratio(router: str, placement: Placement, *, inter_factor: float = MEASURED_INTER_FACTOR) -> float:
    """lam of `router` (one of ROUTERS) on a node that holds experts (module doc)."""
    if router not in ROUTERS:
        raise ValueError(f"router={router!r} is invalid: use one of {list(ROUTERS)}")
    if not 0.0 <= inter_factor <= 1.0:
        raise ValueError(f"inter_factor={inter_factor} must be in [0, 1] (LocMoE's inter-node rows / the switch's)")
    lam = uniform_ratio(placement)
    return 1.0 - inter_factor * (1.0 - lam) if router == "locmoe" else lam


# ---- bytes per rank: the formulas ---------------------------------------------------------------------


@dataclass(frozen=True)
class LinkBytes:
    """Bytes one rank sends and receives per all-to-all direction (the dispatch), by link."""

    sent_intra: Any
    sent_inter: Any
    recv_intra: Any
    recv_inter: Any


def _kept(rows: Any, capacity: Any) -> Any:
    """Rows one source rank sends one expert: all (dropless, capacity None) or at most `capacity`."""
    return rows if capacity is None else smin(rows, capacity)


def rank_bytes(placement: Placement, T: Any, D: Any, b: Any, lam: Any, capacity: Any = None) -> dict[str, LinkBytes]:
    """The module doc's formulas, per class of rank: "hosting" (a rank of a node that holds experts) and,
    when N > E, "expert-less". T, D, b, lam, capacity may be sympy symbols; capacity None is dropless."""
    E, N, k, h = placement.experts, placement.nodes, placement.node_experts, placement.rank_experts
    row = D * b
    local = (k - h) * _kept(T * lam / k, capacity) * row
    remote = (E - k) * _kept(T * (1 - lam) / (E - k), capacity) * row if E > k else 0 * row
    if not placement.nodes_gt_experts:
        return {"hosting": LinkBytes(local, remote, local, remote)}
    received = ((E - 1) * _kept(T * (1 - lam) / (E - 1), capacity) if E > 1 else 0) * row
    received += (N - E) * _kept(T / E, capacity) * row
    expertless = E * _kept(T / E, capacity) * row
    return {"hosting": LinkBytes(local, remote, 0 * row, received), "expert-less": LinkBytes(0 * row, expertless,
                                                                                              0 * row, 0 * row)}


def capacity_rows(T: int, E: int, capacity_factor: float | None, delta: float, dim: int) -> int | None:
    """C of the formulas: `expert_capacity` with the floor of measured `delta` (None: dropless)."""
    if capacity_factor is None:
        return None
    return expert_capacity(T, E, capacity_factor, capacity_floor(delta, E, dim))


# ---- the same, counted from routing tables -------------------------------------------------------------


def routing_counts(placement: Placement, T: float, lam: float) -> np.ndarray:
    """[src rank, expert] rows of the module doc's routing model (expected counts, top-1)."""
    E, G = placement.experts, placement.per_node
    if not 0.0 <= lam <= 1.0 or (placement.node_experts == E and lam != 1.0):
        raise ValueError(f"locality ratio lam={lam} must be in [0, 1] (1 when one node holds all {E} experts)")
    counts_PE = np.zeros((placement.ranks, E))
    for node in range(placement.nodes):
        local = placement.local_experts(node)
        probs_E = np.full(E, 1.0 / E)
        if local:
            probs_E[:] = (1.0 - lam) / (E - len(local)) if E > len(local) else 0.0
            probs_E[local] = lam / len(local)
        counts_PE[node * G:(node + 1) * G] = T * probs_E
    return counts_PE


def rows_matrix(placement: Placement, counts_PE: np.ndarray, capacity: float | None = None) -> np.ndarray:
    """[src rank, dst rank] rows from [src rank, expert] rows (at most `capacity` per pair), by `target`."""
    counts_PE = np.asarray(counts_PE, dtype=np.float64)
    if capacity is not None:
        counts_PE = np.minimum(counts_PE, capacity)
    W = placement.ranks
    if counts_PE.shape != (W, placement.experts):
        raise ValueError(f"counts_PE {counts_PE.shape} must be [ranks={W}, experts={placement.experts}]")
    rows_PP = np.zeros((W, W))
    for src in range(W):
        for e in range(placement.experts):
            rows_PP[src, placement.target(src, e)] += counts_PE[src, e]
    return rows_PP
