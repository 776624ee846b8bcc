"""Recogniser: GShard-style einsum dispatch with an expert capacity (a `capacity_factor` attribute).

Same weight reading as the fused recogniser; adds the capacity hypotheses (k-major priority as in
GShard first, then token-major), overflow tokens dropped.
"""

from __future__ import annotations

from moepass.detect import fused_experts
from moepass.detect.candidates import Candidate
from moepass.spec import CapacitySpec, MoESpec

NAME = "gshard-capacity"
CAPACITY_ATTRS = ("capacity_factor", "expert_capacity_factor")


def recognise(c: Candidate) -> list[MoESpec] | str:
    factor = next((getattr(c.module, a) for a in CAPACITY_ATTRS if isinstance(getattr(c.module, a, None), float)), None)
    if factor is None:
        return "no capacity_factor attribute: not a capacity-based block"
    specs: list[MoESpec] = []
    for priority in ("k_major", "token_major"):
        found = fused_experts.recognise(c, CapacitySpec(capacity_factor=factor, priority=priority), name=NAME)
        if isinstance(found, str):
            return found
        specs.extend(found)
    return specs
