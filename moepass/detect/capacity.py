"""Capacity hypotheses: a block that drops the (token, expert) assignments over an expert capacity.

A capacity is a count computed in the block's Python code from a factor it holds (`capacity_factor`,
`cf`, whatever it is called): C = round(factor * tokens * k / E) per group of tokens. Nothing in a traced
graph says which attribute is the factor, so every positive float attribute of the block is a candidate,
and each is tried in the ways code bases use it: the group (the whole batch, or each sequence), the
rounding (ceil, or `int()`), who is kept first (every token's first choice before any second choice, or
token by token) and, for top-1, what a dropped token gets (zero, or its input scaled by its weight). The
semantic check decides: its crowded probes (every token choosing the same experts) overflow any capacity
below the tokens' count, so a dropless hypothesis fails on such a block and a capacity one holds only with
the right factor, group, rounding and priority.
"""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import product

from torch import nn

from moepass.detect.check import CheckResult
from moepass.spec import CAPACITY_PRIORITIES, CAPACITY_ROUNDINGS, CAPACITY_SCOPES, CapacitySpec, MoESpec

MAX_FACTOR = 64.0  # larger floats are no capacity factors (a capacity this large never drops on a probe)
MAX_BASES = 4  # dropless hypotheses a block's capacity variants are built on (the closest ones)


def factors(module: nn.Module, named: str = "") -> list[float]:
    """The block's positive float attributes, in definition order, once each (`named`: only attributes
    whose name contains it)."""
    found: list[float] = []
    for name, value in vars(module).items():
        if (named in name and isinstance(value, float) and math.isfinite(value) and 0 < value <= MAX_FACTOR
                and value not in found):
            found.append(value)
    return found


def variants(factor: float, top_k: int) -> list[CapacitySpec]:
    """Every capacity with `factor`, the commonest first (the batch as one group, ceil, first choices first)."""
    drops = ("zero", "identity") if top_k == 1 else ("zero",)
    return [CapacitySpec(capacity_factor=factor, scope=scope, rounding=rounding, priority=priority, drop_policy=drop)
            for drop, scope, rounding, priority in product(drops, CAPACITY_SCOPES, CAPACITY_ROUNDINGS,
                                                           CAPACITY_PRIORITIES)]


def hypotheses(module: nn.Module, tried: list[CheckResult]) -> list[MoESpec]:
    """Capacity variants of the dropless hypotheses that selected the block's experts on every probe but not its
    outputs (at most MAX_BASES of them, in their order), one per float attribute of `module` and way of using it."""
    found = factors(module)
    dropless = [r.spec for r in tried if r.compared_tokens and not r.mismatched_tokens and math.isfinite(r.max_error)
                and r.spec.capacity is None and r.spec.heads is None
                and r.spec.experts.routed_experts == r.spec.experts.num_experts][:MAX_BASES]
    return [replace(spec, capacity=capacity) for factor in found for spec in dropless
            for capacity in variants(factor, spec.top_k)]
