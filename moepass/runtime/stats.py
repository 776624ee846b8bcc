"""Per-rank communication counters: bytes by op kind, split into intra-node / inter-node / self.

Every moepass collective records here from the sizes it actually sends (split sizes after the count
exchange), inside the op, so the numbers stay right when the graph is compiled. `self` is what a rank
"sends" to itself (a local copy, no link); `intra` / `inter` are bytes to peers on the same / another
node of the `Topology`.

    moepass.reset_comm_stats()
    ... train a step ...
    moepass.comm_stats()   # {"dispatch": {"intra": 4096, "inter": 8192, "self": 2048, "calls": 2}, ...}
"""

from __future__ import annotations

from moepass.process_state import COMM_STATS, COMM_STATS_LOCK

_FIELDS = ("intra", "inter", "self", "calls")


def record(kind: str, *, intra: int = 0, inter: int = 0, self_bytes: int = 0) -> None:
    """Add one call of collective `kind` that sent these bytes."""
    with COMM_STATS_LOCK:
        entry = COMM_STATS.setdefault(kind, dict.fromkeys(_FIELDS, 0))
        entry["intra"] += int(intra)
        entry["inter"] += int(inter)
        entry["self"] += int(self_bytes)
        entry["calls"] += 1


def comm_stats() -> dict[str, dict[str, int]]:
    """A copy of this rank's counters, per op kind, plus a "total" entry (bytes only)."""
    with COMM_STATS_LOCK:
        out = {kind: dict(entry) for kind, entry in COMM_STATS.items()}
    out["total"] = {f: sum(e[f] for e in out.values()) for f in _FIELDS}
    return out


def reset_comm_stats() -> None:
    with COMM_STATS_LOCK:
        COMM_STATS.clear()
