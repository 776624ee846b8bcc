"""What `cost_model.search` prices: a plan space (which forms, and for each the option values to try) and the
figures it prices them with.

    search(model, topology, batch)                                        # every form, the default ranges
    search(model, topology, batch, PlanSpace(forms=("single", "ep"), ep=EPSpace(sizes=(8,), a2a_chunks=(1, 4))),
           profile="h100", pricing=Pricing(imbalance=2.5))

The space is grouped by form as `moepass.Plan` is (`EPSpace` tries values of `EPOptions`' fields, `FSEPSpace` of
`FSEPOptions`', `HPSpace` of `HPOptions`'); `PlanSpace.of(plan)` and `Pricing.of(plan)` are the space and figures
`Plan(form="auto")` searches with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cost_model.presets import MICRO_OP_BYTES
from cost_model.schedule import DEFAULT_CHUNKS, POLICIES
from cost_model.search_types import CAPACITY_FACTORS, PACKINGS
from moepass.plan import DEFAULT_PREFETCH_DEPTH, Plan

SEARCHED_FORMS = ("single", "ep", "fsep", "hp")  # locality is not modelled (`NOT_MODELLED`)


def _counts(owner: str, name: str, values: tuple[int, ...] | None, low: int = 1) -> None:
    if values is None:
        return
    if not isinstance(values, tuple) or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in values):
        raise ValueError(f"{owner}.{name}={values!r} is invalid: use a tuple of ints >= {low}"
                         + (", or None for the search's own range." if name in ("sizes", "slots") else "."))


@dataclass(frozen=True)
class EPSpace:
    """form="ep": the values tried for each `EPOptions` field."""

    sizes: tuple[int, ...] | None = None  # EP degrees (ep_size); None: every divisor of W > 1
    capacity_factors: tuple[float | None, ...] = CAPACITY_FACTORS  # None: dropless
    a2a_chunks: tuple[int, ...] = DEFAULT_CHUNKS
    # experts hosted per device; equivalent candidates (ep_size / packing equal) are priced once unless `sizes`
    # is given
    packings: tuple[int, ...] = PACKINGS

    def __post_init__(self) -> None:
        _counts("EPSpace", "sizes", self.sizes)
        _counts("EPSpace", "a2a_chunks", self.a2a_chunks)
        _counts("EPSpace", "packings", self.packings)
        if any(cf is not None and not cf > 0 for cf in self.capacity_factors):
            raise ValueError(f"EPSpace.capacity_factors={self.capacity_factors!r} is invalid: use floats > 0, or "
                             f"None for dropless.")


@dataclass(frozen=True)
class FSEPSpace:
    """form="fsep" over all W ranks: the values tried for `FSEPOptions`' slots and chunks, and its prefetch depth."""

    slots: tuple[int, ...] | None = None  # slots per device C (those with W*C < E skipped); None: ceil(E/W) .. +2
    a2a_chunks: tuple[int, ...] = DEFAULT_CHUNKS
    prefetch_depth: int = DEFAULT_PREFETCH_DEPTH  # `FSEPOptions.prefetch_depth`, held fixed

    def __post_init__(self) -> None:
        _counts("FSEPSpace", "slots", self.slots)
        _counts("FSEPSpace", "a2a_chunks", self.a2a_chunks)
        _counts("FSEPSpace", "prefetch_depth", (self.prefetch_depth,), low=0)


@dataclass(frozen=True)
class HPSpace:
    """form="hp": the HP degrees tried; the Multi-Head LatentMoE's shape (`HPOptions.heads`, `head_dim`) held
    fixed, None: `moepass.rewrite.latent`'s defaults for each degree."""

    sizes: tuple[int, ...] | None = None  # HP degrees P (divisors of W > 1); None: every one
    heads: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        _counts("HPSpace", "sizes", self.sizes)
        _counts("HPSpace", "heads", None if self.heads is None else (self.heads,))
        _counts("HPSpace", "head_dim", None if self.head_dim is None else (self.head_dim,))


@dataclass(frozen=True)
class PlanSpace:
    """The plans `search` prices: "single" (no rewrite: every rank keeps every expert), and the other `forms`
    with the option values their spaces list. Capacity factors on a dropless model and HP change the math: they
    are ranked and shown, and `SearchResult.best` skips them unless `allow_math_changes`."""

    forms: tuple[str, ...] = SEARCHED_FORMS
    ep: EPSpace = field(default_factory=EPSpace)
    fsep: FSEPSpace = field(default_factory=FSEPSpace)
    hp: HPSpace = field(default_factory=HPSpace)
    allow_math_changes: bool = False

    def __post_init__(self) -> None:
        for form in self.forms:
            if form not in SEARCHED_FORMS:
                raise ValueError(f"PlanSpace.forms has {form!r}: search prices {list(SEARCHED_FORMS)}"
                                 + (" (locality is not modelled)" if form == "locality" else "") + ".")

    @classmethod
    def of(cls, plan: Plan) -> PlanSpace:
        """What `Plan(form="auto")` searches: every form, FSEP with the plan's slots_per_device when it gives one
        and its prefetch depth, HP with its heads / head_dim; never a math change."""
        slots = None if plan.slots_per_device is None else (plan.slots_per_device,)
        return cls(fsep=FSEPSpace(slots=slots, prefetch_depth=plan.prefetch_depth),
                   hp=HPSpace(heads=plan.heads, head_dim=plan.head_dim))


@dataclass(frozen=True)
class Pricing:
    """The figures `search` prices every plan with, beside the hardware (`profile`)."""

    # max/mean routed rows per rank under EP (1: uniform routing); `cost_model.search` says how FSEP reads it
    imbalance: float = 1.0
    # recorded routed rows [steps, source ranks, E] (or [source ranks, E]) in place of `imbalance`: the last step
    # priced, the steps before it the history FSEP's planner sees
    trace: object = None
    # whether the expert backward recomputes gate/up (`Plan.expert_recompute`); None: the hardware's figure
    recompute: bool | None = None
    # the model's dense parameters (attention, norms, embeddings: all-reduced over W), spread over the blocks;
    # None: counted from the model when one is given, else 4 D^2 per block
    dense_params: float | None = None
    # how EP's gradient all-reduce shares the all-to-all's link: "fair" (DDP; `Plan.grad_sync="none"`) or
    # "priority" (Lina's micro-ops of `micro_op_bytes`; `Plan.grad_sync="scheduler"`)
    schedule: str = "fair"
    micro_op_bytes: int = MICRO_OP_BYTES

    def __post_init__(self) -> None:
        if self.schedule not in POLICIES:
            raise ValueError(f"search got schedule={self.schedule!r}: use one of {list(POLICIES)}")
        if self.imbalance < 1:
            raise ValueError(f"search got imbalance={self.imbalance!r}: it is max/mean routed rows per rank, >= 1")
        if self.dense_params is not None and self.dense_params < 0:
            raise ValueError(f"search got dense_params={self.dense_params!r}: a parameter count, >= 0")

    @classmethod
    def of(cls, plan: Plan, dense_params: float | None = None) -> Pricing:
        """The figures `Plan(form="auto")` prices with: its routing_skew (a max/mean, or recorded rows), expert
        recompute, gradient sync and micro-op size."""
        skew = plan.routing_skew
        imbalance, trace = (float(skew), None) if isinstance(skew, (int, float)) else (1.0, skew)
        return cls(imbalance=imbalance, trace=trace, recompute=plan.expert_recompute, dense_params=dense_params,
                   schedule="priority" if plan.grad_sync == "scheduler" else "fair",
                   micro_op_bytes=plan.micro_op_bytes)
