"""The plan search's types (`cost_model.search`): a block's shape (`BlockShape`), the FSEP planner's figures
for it (`Routed`), one priced plan (`Candidate`), and the search's constants (the candidates' ranges, what is not
modelled, the refusals on zero-compute blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cost_model.ep import LayerTerms, matmuls

CAPACITY_FACTORS: tuple[float | None, ...] = (None, 1.0, 1.25, 2.0)
PACKINGS = (1, 2, 4)
SLOT_RANGE = 3  # FSEP: C = ceil(E/W) .. ceil(E/W) + SLOT_RANGE - 1
NOT_MODELLED = {
    "locality": "locality routing (LocMoE): not modelled yet",
}
HP_CHANGE = "changes the model: Multi-Head LatentMoE"
# forms priced but not run on blocks with zero-compute experts: their rewrites raise a PlanError (the note shown)
ZERO_COMPUTE_REFUSED = {
    "capacity": "capacity with identity / zero experts: the rewrite refuses it",
    "fsep": "FSEP with identity / zero experts: the rewrite refuses it (its buckets are expert slots)",
}


@dataclass(frozen=True)
class BlockShape:
    """What the cost model reads from an MoESpec."""

    E: int  # FFN experts (zero-compute experts have no weights and are not counted)
    K: int
    D: int
    F: int
    m: int
    cf: float | None  # the model's own capacity factor; None: dropless
    # dense parameters of the block's layer, all-reduced over all ranks (attention, norms, its share of the
    # embeddings); None: 4 D^2, the attention projections (`Pricing.dense_params` overrides it)
    dense: float | None = None
    # the share of the T*K routed assignments that reach FFN experts (`cost_model.symbols.phi`): the rest pick
    # zero-compute experts (identity or zero), which EP neither sends nor computes; E/R under uniform routing
    ffn_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.ffn_fraction <= 1:
            raise ValueError(f"BlockShape.ffn_fraction={self.ffn_fraction!r} is invalid: it is the share of the "
                             f"routed assignments that reach FFN experts, in (0, 1] (1 without zero-compute experts)")

    @property
    def dense_params(self) -> float:
        return 4 * self.D**2 if self.dense is None else self.dense

    @property
    def zero_compute(self) -> bool:
        """Whether some assignments pick zero-compute experts (forms whose rewrite refuses them are not run)."""
        return self.ffn_fraction < 1

    @classmethod
    def of(cls, spec: Any, tokens: int) -> BlockShape:
        """The block's shape; with zero-compute experts the FFN share under uniform routing, E/R."""
        cap = spec.capacity
        cf = None
        if cap is not None:
            cf = cap.capacity_factor if cap.fixed is None else cap.fixed * spec.num_experts / (tokens * spec.top_k)
        x = spec.experts
        return cls(E=x.num_experts, K=spec.top_k, D=x.hidden_dim, F=x.ffn_dim, m=matmuls(x.gated), cf=cf,
                   ffn_fraction=x.ffn_fraction)


@dataclass(frozen=True)
class Routed:
    """What FSEP's planner makes of the search's routing for one block (`moepass.runtime.placement.planned_routing`)."""

    rho: float  # the busiest device's rows over the mean under the planner's table
    a2a_rows: tuple[float, float]  # (intra, inter) rows of the token all-to-all's slowest rank, over T*K*phi
    ep_rho: float  # plain EP's max/mean on the same counts (at the planner's reference EP degree)
    table: str  # the planner's candidate: "even" or "proportional"


@dataclass(frozen=True)
class Candidate:
    form: str
    ep_size: int  # ranks the experts are sharded over (1 for "single"; W for "fsep")
    capacity_factor: float | None
    a2a_chunks: int
    packing: int
    terms: LayerTerms  # summed over blocks, seconds per step (memory in bytes)
    feasible: bool  # fits device memory, and its rewrite runs these blocks (`ZERO_COMPUTE_REFUSED`)
    math_changing: bool
    notes: tuple[str, ...] = ()
    slots: int | None = None  # FSEP: expert slots per device (C)
    routing: tuple[Routed, ...] = ()  # FSEP: per block
    latent: tuple[Any, ...] = ()  # HP: per block, the `moepass.rewrite.latent.LatentShape` it converts to
    # the per-layer formulas' terms (`cost_model.ep.ep_step`, `fsep_layer`, `hp_layer`): what `expression` writes
    # out; `terms` is the step timeline's price (`cost_model.model_cases`), which ranks
    formula: LayerTerms | None = None

    @property
    def step(self) -> float:
        return float(self.terms.step)

    @property
    def label(self) -> str:
        if self.form == "single":
            return "single"
        if self.form == "fsep":
            return f"fsep C={self.slots} n={self.a2a_chunks}"
        if self.form == "hp":
            return f"hp={self.ep_size} H={self.latent[0].heads} h={self.latent[0].head_dim}"
        cf = "dropless" if self.capacity_factor is None else f"cf={self.capacity_factor:g}"
        pack = f" P={self.packing}" if self.packing > 1 else ""
        return f"ep={self.ep_size}{pack} {cf} n={self.a2a_chunks}"

    def plan_kwargs(self) -> dict[str, Any]:
        """The Plan fields this candidate sets (`Plan(**kwargs)`, or `plan.replace(**kwargs)` for form="auto")."""
        if self.form == "single":
            return {"form": "single"}
        if self.form == "fsep":
            return {
                "form": "fsep",
                "ep_size": self.ep_size,
                "slots_per_device": self.slots,
                "capacity_factor": None,
                "a2a_chunks": self.a2a_chunks,
                "packing": 1,
            }
        if self.form == "hp":  # one Plan.heads for every block; head_dim where they share it (else D/H each)
            dims = {shape.head_dim for shape in self.latent}
            return {
                "form": "hp",
                "ep_size": self.ep_size,
                "heads": self.latent[0].heads,
                "head_dim": dims.pop() if len(dims) == 1 else None,
                "capacity_factor": None,
                "packing": 1,
            }  # no a2a_chunks: HP's exchange is not chunked (Plan refuses the field under form="hp")
        return {
            "form": "ep",
            "ep_size": self.ep_size,
            "capacity_factor": self.capacity_factor,
            "a2a_chunks": self.a2a_chunks,
            "packing": self.packing,
        }


