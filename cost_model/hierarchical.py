"""Hierarchical (2D) all-to-all (`Plan(hierarchical_a2a=True)`): bytes per link of each stage.

The EP group spans n nodes of r ranks (rank p = a*r + i: node a, local index i; P = n*r). The exchange of
`moepass.runtime.collectives` ("Hierarchical (2D) all-to-all") runs in two stages:

- stage 1, intra-node: rank (a, i) sends to (a, j) every row it has for (b, j), any node b. Rows for
  destinations with local index i stay home ("self"), the rest cross the fast links;
- stage 2, inter-node: rank (a, j) sends to (b, j) the rows of all (a, i) for (b, j). Rows for its own
  node stay home ("self"), the rest cross the slow links, once.

So the inter-node bytes are exactly the flat exchange's (`cost_model.ep.exact_a2a`); the intra-node bytes
grow to every row not bound for the sender's own local index, and each rank sends n-1 inter-node
messages (each aggregating r ranks' rows) instead of the flat P-r. Same conventions as the runtime's
counters: bytes a rank sends, per link, rows x D x b; the combine is the same exchange of the transposed
matrix; a backward stage sends what its forward stage received.

Shape letters: `moepass.spec.SHAPES` (here `rows_PP`: rows each source rank of one EP group sends each destination rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cost_model.ep import a2a_time


def stage_bytes(T, K, D, nodes, ranks_per_node, b, *, factor=1):
    """(stage-1 intra-node, stage-2 inter-node) bytes one rank sends per direction under uniform routing.

    Stage 1 keeps the 1/r of its rows bound for its own local index; stage 2 keeps the 1/n bound for its
    own node. The flat exchange sends (r-1)/P intra and (n-1)/n inter (`cost_model.ep.a2a_bytes`). `factor`
    scales the T*K routed rows as there (rho, cf, and phi with zero-compute experts)."""
    rows = factor * K * T * D * b
    return rows * (ranks_per_node - 1) / ranks_per_node, rows * (nodes - 1) / nodes


def inter_messages(nodes, ranks_per_node):
    """(flat, hierarchical) inter-node messages a rank sends per direction: P-r peers on other nodes, or
    its n-1 counterparts."""
    return (nodes - 1) * ranks_per_node, nodes - 1


def hierarchical_time(intra_bytes, inter_bytes, B_intra, B_inter, alpha):
    """Two all-to-alls, one after the other: a latency each plus each stage's bytes over its link."""
    return a2a_time(intra_bytes, 0, B_intra, B_inter, alpha) + a2a_time(0, inter_bytes, B_intra, B_inter, alpha)


@dataclass(frozen=True)
class ExactHierarchical:
    """Per-rank bytes of one direction (the dispatch; the combine is `exact_hierarchical(rows_PP.T, ...)`).

    `sent_*`: what each rank sends in that stage (intra / inter across links, self kept home); `recv_*` what
    it receives across links, i.e. what it sends in that stage's backward."""

    sent_intra: np.ndarray  # [S] stage 1
    self_intra: np.ndarray  # [S] stage 1, rows for the sender's own local index
    recv_intra: np.ndarray  # [R] stage 1
    sent_inter: np.ndarray  # [S] stage 2
    self_inter: np.ndarray  # [S] stage 2, rows for the sender's own node
    recv_inter: np.ndarray  # [R] stage 2

    def time(self, B_intra: float, B_inter: float, alpha: float) -> float:
        """Each stage ends when its slowest rank has sent and received everything."""
        stage1 = max(self.sent_intra.max(), self.recv_intra.max()) / B_intra + alpha
        stage2 = max(self.sent_inter.max(), self.recv_inter.max()) / B_inter + alpha
        return float(stage1 + stage2)


def exact_hierarchical(rows_PP: np.ndarray, D: int, b: int, nodes: int, ranks_per_node: int) -> ExactHierarchical:
    """Bytes of each stage of the hierarchical dispatch for a [src rank, dst rank] routed-row matrix of one
    EP group (`cost_model.ep.rank_rows`), by link."""
    rows_PP = np.asarray(rows_PP, dtype=np.float64)
    n, r = nodes, ranks_per_node
    if rows_PP.shape != (n * r, n * r):
        raise ValueError(f"rows_PP must be [P, P] with P = nodes*ranks_per_node = {n * r}, got {rows_PP.shape}")
    rows_aibj = rows_PP.reshape(n, r, n, r) * D * b  # [src node, src local, dst node, dst local]
    to_local_aij = rows_aibj.sum(axis=2)  # stage 1: (a, i) -> (a, j), summed over destination nodes
    own = np.eye(r, dtype=bool)
    via_ajb = rows_aibj.sum(axis=1).transpose(0, 2, 1)  # stage 2: (a, j) -> (b, j), summed over sources i
    home = np.eye(n, dtype=bool)[:, None, :]  # [a, 1, b]: b == a
    return ExactHierarchical(
        sent_intra=np.where(own, 0.0, to_local_aij).sum(axis=2).reshape(-1),
        self_intra=np.where(own, to_local_aij, 0.0).sum(axis=2).reshape(-1),
        recv_intra=np.where(own, 0.0, to_local_aij).sum(axis=1).reshape(-1),
        sent_inter=np.where(home, 0.0, via_ajb).sum(axis=2).reshape(-1),
        self_inter=np.where(home, via_ajb, 0.0).sum(axis=2).reshape(-1),
        recv_inter=np.where(home, 0.0, via_ajb).sum(axis=0).T.reshape(-1),
    )
