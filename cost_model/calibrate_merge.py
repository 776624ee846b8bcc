"""Several calibrations of one machine -> one profile: the median of each figure.

On shared cores one calibration's figures move with the other processes' load from one minute to the next (the
all-to-all's alpha 98-181 us, its bandwidth 1.6-2.4 GB/s, the busy-core wait per exchange 0.75-0.82 ms in three
runs within five minutes here). `benchmarks/cost_fidelity.py --calibrate --calibrations N` calibrates before and
after its measurement and prices the configurations with the figure-wise median of those profiles, so the
prediction's machine is the one of the measurement's window, not of the minute before it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def median_profile(profiles: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The first profile with every numeric figure (top-level int/float) replaced by its median over `profiles`,
    and each GEMM-table cell's efficiency by its median over the profiles that have the cell; `merged_from` lists
    each profile's creation time and load average. Raises ValueError on no profile or a figure one lacks."""
    if not profiles:
        raise ValueError("median_profile: no calibration profile to merge")
    first = profiles[0]
    merged = dict(first)
    for key, value in first.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            missing = [i for i, p in enumerate(profiles) if key not in p]
            if missing:
                raise ValueError(f"median_profile: figure {key!r} is missing from profile(s) {missing}; "
                                 "merge profiles written by the same calibration")
            values = [p[key] for p in profiles]
            merged[key] = value if all(v == value for v in values) else statistics.median(map(float, values))
    if "gemm" in first:
        cells: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for p in profiles:
            for cell in p.get("gemm", []):
                cells.setdefault((cell["D"], cell["M"]), []).append(cell)
        merged["gemm"] = [{**same[0], "efficiency": statistics.median(c["efficiency"] for c in same),
                           "time_ratio": statistics.median(c["time_ratio"] for c in same)}
                          for same in cells.values()]
    merged["merged_from"] = [{"created": p.get("created"), "load_average": p.get("load_average")} for p in profiles]
    return merged
