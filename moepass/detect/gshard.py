"""Recogniser: GShard-style einsum dispatch with an expert capacity (a float attribute named `*capacity*`).

Same weight reading as the fused recogniser; adds the capacity hypotheses of that factor (`capacity.variants`:
k-major priority as in GShard first, then token-major; the batch or each sequence as the group; ceil or floor),
overflow tokens dropped. A block whose factor has another name is found by `capacity.hypotheses` after its
dropless hypotheses select its experts but not its outputs.
"""

from __future__ import annotations

from moepass.detect import capacity, fused_experts
from moepass.detect.candidates import Candidate
from moepass.spec import MoESpec

NAME = "gshard-capacity"


def recognise(c: Candidate) -> list[MoESpec] | str:
    factor = next(iter(capacity.factors(c.module, named="capacity")), None)
    if factor is None:
        return "no float attribute named *capacity*: not a capacity-based block"
    specs: list[MoESpec] = []
    for variant in capacity.variants(factor, c.selection.k if c.selection is not None else 2):
        found = fused_experts.recognise(c, variant, name=NAME)
        if isinstance(found, str):
            return found
        specs.extend(found)
    return specs
