"""The conversion behind `Plan(form="hp")`: a standard MoE block → a Multi-Head LatentMoE block.

An architecture change, not a rewrite: it happens only when the plan names form="hp"
(`Plan.changes_math`), the new block is freshly initialised, and `explain` reports it with the
parameter and FLOP counts before and after.

The rule (equal active parameters per token). A standard block has hidden D, E experts, top-K, FFN
width F with n = 3 weight matrices (gated) or 2; a token activates K·n·D·F expert weights and the D·E
router. The Multi-Head LatentMoE keeps D, E (per head), K and the activation family, and takes

    H = Plan.heads (default: the world size, at least 4, rounded up to a multiple of it)
    h = Plan.head_dim (default: D / H, so W_mh and W_mg are D x D)
    m = floor((K·n·D·F + D·E − 2·D·H·h − H·E·h) / (H·K·n·h))      (>= 1, else an error saying what to lower)

so W_mh (D·H·h) + W_mg (H·h·D) + H routers (E·h) + H·K active experts (n·h·m each) ≈ the original's active
parameters, rounded down. Then m is rounded down to a multiple of M_ALIGN = 4 (grouped-GEMM alignment: the
expert GEMMs of width m ran ~12% faster aligned) when that loses at most ALIGN_TOLERANCE = 2% of the
original's active parameters; else the exact m stays. The converted block never has more active
parameters than the original. Blocks with shared experts, capacity or side outputs are refused (a
Multi-Head LatentMoE has none of them), with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from moepass.errors import PlanError
from moepass.nn import MultiHeadLatentMoE
from moepass.plan import Plan
from moepass.spec import MoESpec

ACTIVATIONS = {"swiglu": "swiglu", "gelu": "gelu"}  # the standard block's activation -> the latent block's
M_ALIGN = 4  # the latent experts' hidden width m is rounded down to a multiple of this ...
ALIGN_TOLERANCE = 0.02  # ... when that loses at most this fraction of the original's active parameters


@dataclass(frozen=True)
class LatentShape:
    """The converted block's sizes, and the active parameters / FLOPs per token before and after."""

    heads: int
    head_dim: int
    experts: int
    top_k: int
    ffn_dim: int
    activation: str
    active_before: int
    active_after: int

    @property
    def flops_before(self) -> int:  # forward FLOPs per token: 2 per active weight
        return 2 * self.active_before

    @property
    def flops_after(self) -> int:
        return 2 * self.active_after

    def summary(self) -> str:
        return (f"Multi-Head LatentMoE H={self.heads} h={self.head_dim} E={self.experts}/head K={self.top_k} "
                f"m={self.ffn_dim} {self.activation}; active parameters per token {self.active_before:,} -> "
                f"{self.active_after:,}, forward FLOPs per token {self.flops_before:,} -> {self.flops_after:,}")


def latent_shape(spec: MoESpec, plan: Plan, world: int) -> LatentShape:
    """The sizes the conversion picks for `spec` under `plan` (see the module doc); PlanError when none fit."""
    where = f"block {spec.path or '<root>'}"
    x = spec.experts
    if spec.shared is not None or spec.capacity is not None or spec.side_outputs or spec.heads is not None:
        what = ("shared experts" if spec.shared is not None else "capacity" if spec.capacity is not None
                else "side outputs" if spec.side_outputs else "heads already")
        raise PlanError(f"Plan.form='hp' cannot convert {where}: it has {what}, which a Multi-Head LatentMoE "
                        f"does not; leave it alone with Plan(blocks={{{spec.path!r}: None}}).")
    if x.activation not in ACTIVATIONS:
        raise PlanError(f"Plan.form='hp' cannot convert {where}: activation {x.activation!r} has no Multi-Head "
                        f"LatentMoE counterpart (supported: {sorted(ACTIVATIONS)}).")
    D, E, K, F = x.hidden_dim, x.num_experts, spec.top_k, x.ffn_dim
    n = 3 if x.gated else 2
    H = plan.heads or world * max(1, -(-4 // world))
    if H % world:
        raise PlanError(f"Plan.heads={H} is invalid for {where}: head parallel shards heads over the {world} ranks "
                        f"(head groups, with Plan.head_ep_size); use a multiple of {world}.")
    h = plan.head_dim or D // H
    if h < 1 or (plan.head_dim is None and D % H):
        raise PlanError(f"Plan.heads={H} is invalid for {where}: hidden {D} does not split into {H} heads; pass "
                        f"Plan.head_dim, or heads dividing {D}.")
    before = K * n * D * F + D * E
    fixed = 2 * D * H * h + H * E * h
    m = (before - fixed) // (H * K * n * h)
    if m < 1:
        raise PlanError(f"Plan.form='hp' cannot keep {where}'s {before:,} active parameters with H={H} heads of "
                        f"h={h}: the projections alone take {fixed:,}; use fewer heads or a smaller head_dim.")
    aligned = m - m % M_ALIGN
    if aligned >= M_ALIGN and before - (fixed + H * K * n * h * aligned) <= ALIGN_TOLERANCE * before:
        m = aligned
    after = fixed + H * K * n * h * m
    return LatentShape(H, h, E, K, m, ACTIVATIONS[x.activation], before, after)


def convert(spec: MoESpec, block: nn.Module, plan: Plan, world: int) -> tuple[MultiHeadLatentMoE, LatentShape]:
    """A freshly initialised Multi-Head LatentMoE in place of `block` (same device and dtype)."""
    shape = latent_shape(spec, plan, world)
    first = next(iter(block.parameters()))
    latent = MultiHeadLatentMoE(spec.experts.hidden_dim, heads=shape.heads, head_dim=shape.head_dim,
                                experts=shape.experts, top_k=shape.top_k, ffn_dim=shape.ffn_dim,
                                activation=shape.activation)
    return latent.to(device=first.device, dtype=first.dtype).train(block.training), shape
