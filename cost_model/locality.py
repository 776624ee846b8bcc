"""Locality-aware routing (LocMoE): the capacity floor of its Theorem 1.

With tokens uniform on the unit sphere S^{D-1} and E mutually orthogonal gate vectors, a token "belongs"
to expert i when cos(theta) >= delta with its gate vector (delta: the cosine of the largest angular
deviation between a gate vector and the tokens routed to it, measured). cos^2(theta) of a uniform token
follows Beta(1/2, (D-1)/2), so the probability mass of the two caps |cos(theta)| >= delta is
1 - I_{delta^2}(1/2, (D-1)/2) (I the regularized incomplete beta), and the smallest expert capacity that
keeps the tokens belonging to an expert, as a token count, is

    ec_min = 1 / (E * (1 - I_{delta^2}(1/2, (D-1)/2)))  ~=  1 / (E * erfc(sqrt(delta^2 * D / (2 - delta^2))))

The capacity of an expert is then max(ceil(ec_min), ceil(T * c_f / E)), clamped to T.
"""

from __future__ import annotations

import math

import mpmath


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
    mass = 1 - mpmath.betainc(0.5, (dim - 1) / 2, 0, delta * delta, regularized=True)
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
