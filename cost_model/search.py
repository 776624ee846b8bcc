"""Plan search: rank the plans the cost model can price for a model, a topology and a batch.

The ranking is the step timeline's: every candidate is priced by `cost_model.systems.price` (through
`cost_model.model_cases`), the function `python -m cost_model <scenario>` reports, so a model's search,
`Plan(form="auto")` and the simulator agree. The per-layer formulas described below price each candidate too
(`Candidate.formula`) and give the winner's printed expression; where they and the timeline differ (the
timeline lays out chunks, buckets and the dense compute step by step), the timeline ranks.

Candidates: no rewrite ("single": every rank keeps every expert, data parallel over W), EP with
ep_size in the divisors of W, dropless or a capacity factor, a2a_chunks in powers of two, and expert
packing, FSEP over all W ranks with C slots per device (ceil(E/W) .. ceil(E/W) + 2, only where
W*C >= E) and a2a_chunks, and HP over every divisor P > 1 of W. Each is priced per step on the busiest
rank as compute + exposed all-to-all + exposed other communication (EP: the expert-gradient
all-reduce over the data-parallel replicas; FSEP: the restore and the gradient slices back; HP: the
head and w_in/w_out gradient all-reduces), with the memory per rank. Locality routing is listed as
not modelled yet.

Gradient all-reduce and all-to-all share a link (`cost_model.ep.ep_step`): EP's price has both passes
pipelined over its chunks, the expert-replica and dense gradients (the model's dense parameters,
embeddings included: `dense_params`) all-reduced during the backward, the all-to-all's waits behind
them under the `schedule` ("fair": DDP's fair share; "priority": Lina's micro-ops), and the all-reduce
the backward cannot carry. FSEP and HP pay the last layer's dense all-reduce, which nothing hides; their
own contention is not modelled. tests/test_cost_model_lina.py checks EP's chunks and packing against
`cost_model.simulate`'s timeline.

Routing skew: `imbalance` = max/mean routed rows per rank under EP at the reference degree (the largest
divisor of W that divides E). EP pays it on the busiest rank; at another degree (ep_size < W, packing)
the same Zipf popularity placed on its ranks sets the rho (`ep_imbalance`). FSEP is priced on the model
the runtime uses: [W, E] counts whose plain-EP max/mean is `imbalance` (Zipf popularity,
`cost_model.ep.zipf_for_imbalance`, fitted at the planner's reference EP degree: the largest divisor of W
that divides E), handed to the runtime's planner (`moepass.runtime.placement.planned_routing`); its table's
max/mean sets FSEP's compute and the rows lite routing sends set its all-to-all
(`cost_model.fsep.fsep_layer`). FSEP is priced for dropless blocks only.

Packing P hosts P times the experts of plain EP on each device: the experts span ep/P ranks and are
replicated P times, which in this model is the same as ep_size = ep/P. Equivalent candidates are
priced once (the plain form is kept) unless the caller restricts `ep_sizes`.

HP is an architecture change (docs/DESIGN.md: math-changing forms happen only when the plan names them): the
standard block becomes the Multi-Head LatentMoE `moepass.rewrite.latent.latent_shape` converts it to
(equal active parameters; H = Plan.heads, else the least multiple of P that is >= 4; h = D/H), priced by
`cost_model.hp.hp_layer`. Its exchange is T*Q*(P-1)/P elements per rank per direction whatever K, and a
rank's expert rows are T*H*K whatever the routing (`imbalance` does not slow it). A P for which no shape
fits (heads not a multiple of P, projections larger than the active parameters, shared experts,
capacity) is skipped and said in the table.

Zero-compute experts (LongCat-Flash: identity or zero experts beside the E FFN experts): only the
assignments that pick an FFN expert are sent and computed, `BlockShape.ffn_fraction` of them (E/R under
uniform routing over the R router choices; `cost_model.symbols.phi`), so EP's and FSEP's routed rows, their
all-to-all bytes, expert compute and activations are T*K*phi (times rho or the capacity factor), and FSEP's
planner sees counts of T*K*phi rows per rank. Capacity and FSEP are priced but not run on such blocks: their
rewrites refuse them (`ZERO_COMPUTE_REFUSED`: infeasible, with the reason in the notes).

Capacity factors are math-changing for a dropless model (tokens can be dropped), HP always: they are
ranked and shown (HP's best also below the table), but `best` skips them unless
`allow_math_changes=True`; `Plan(form="auto")` never sets it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sympy

from cost_model import fsep as fsep_formulas
from cost_model import hp as hp_formulas
from cost_model import model_cases
from cost_model import symbols as S
from cost_model.ep import (
    LayerTerms,
    dense_allreduce_tail,
    ep_alone,
    ep_layer,
    ep_step,
    expert_params,
    matmuls,
    rank_rows,
    zipf_counts,
    zipf_for_imbalance,
)
from cost_model.ep import imbalance as ep_rows_imbalance
from cost_model.presets import MICRO_OP_BYTES, Hardware, resolve_hardware

# the plan search on a published set-up, re-exported where `python -m moepass search --scenario` finds it
from cost_model.scenario_search import ScenarioSearch as ScenarioSearch
from cost_model.scenario_search import rank_case as rank_case
from cost_model.scenario_search import scenario_contexts as scenario_contexts
from cost_model.scenario_search import search_scenario as search_scenario
from cost_model.schedule import DDP_BUCKET_BYTES, DEFAULT_CHUNKS, POLICIES

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
    # embeddings); None: 4 D^2, the attention projections (`search`'s `dense_params` overrides it)
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


@dataclass
class SearchResult:
    ranked: list[Candidate]
    hardware: Hardware
    world_size: int
    nodes: int
    ranks_per_node: int
    tokens: int
    allow_math_changes: bool
    shapes: list[BlockShape] = field(default_factory=list)
    imbalance: float = 1.0
    not_modelled: dict[str, str] = field(default_factory=lambda: dict(NOT_MODELLED))
    schedule: str = "fair"  # how EP's all-to-all and gradient all-reduce share a link (`search`)
    links: list[dict[str, Any]] = field(default_factory=list)  # per block: P_d, q, u (`_link_figures`)
    routing: str = "uniform"  # the routing priced (`cost_model.model_cases.routing_of`), as the table says it

    @functools.cached_property
    def expression(self) -> sympy.Expr | None:
        """The winner's time per layer in symbols (plan choices fixed), None without an eligible plan."""
        return self._expressions()[0] if self.eligible() else None

    @functools.cached_property
    def expression_substituted(self) -> sympy.Expr | None:
        """The winner's step time with every figure substituted but T (tokens per rank)."""
        return self._expressions()[1] if self.eligible() else None

    def _expressions(self) -> tuple[sympy.Expr, sympy.Expr]:
        if self.best.form in ("fsep", "hp"):
            if self.best.form == "fsep":
                generic, substituted = _fsep_expressions(self.best, self.shapes, self.hardware, self.ranks_per_node)
            else:
                generic, substituted = _hp_expressions(self.best, self.shapes, self.hardware, self.world_size,
                                                       self.nodes, self.ranks_per_node)
            cross = self.nodes > 1  # plus the dense all-reduce every form pays (`_with_dense_tail`)
            tail = dense_allreduce_tail({**self.hardware.values(), **self.links[0]}, self.world_size, cross_node=cross)
            return (generic + dense_allreduce_tail(_symbols(), S.W, cross_node=cross),
                    (substituted + sympy.sympify(tail)).evalf(4))
        return _winner_expressions(self.best, self.shapes, self.hardware, self.world_size, self.nodes,
                                   self.ranks_per_node, self.imbalance, self.schedule, self.links, self.tokens)

    def eligible(self) -> list[Candidate]:
        """The ranked candidates `best` may pick: feasible, and not math-changing unless allowed."""
        return [c for c in self.ranked if c.feasible and (self.allow_math_changes or not c.math_changing)]

    @property
    def best(self) -> Candidate:
        eligible = self.eligible()
        if not eligible:
            raise ValueError("no feasible plan: every candidate exceeds device memory or cannot run these blocks "
                             "(the table's notes say which); add ranks or shrink the batch")
        return eligible[0]

    @property
    def runner_up(self) -> Candidate | None:
        eligible = self.eligible()
        return eligible[1] if len(eligible) > 1 else None

    def to_plan_kwargs(self) -> dict[str, Any]:
        return self.best.plan_kwargs()

    def __str__(self) -> str:
        """`print(moepass.search(...))`: the ranked table (`table()`), not the dataclass's repr."""
        return self.table()

    def table(self, limit: int = 12) -> str:
        head = (
            f"plans for W={self.world_size} ({self.nodes} node(s) x {self.ranks_per_node}), T={self.tokens} "
            f"tokens/rank, hardware {self.hardware.name} ({self.hardware.flops.source})"
            + ("" if self.hardware.calibrated else " (UNCALIBRATED)") + f", routing {self.routing}; each plan priced "
            f"on the step timeline (cost_model.systems.price, as `python -m cost_model` prices a set-up)"
        )
        rows = [("#", "plan", "step ms", "compute", "exposed a2a", "other comm", "mem GB/rank", "notes")]
        for i, c in enumerate(self.ranked[:limit], 1):
            t = c.terms
            rows.append(
                (
                    str(i),
                    c.label,
                    _ms(c.step),
                    _ms(t.compute),
                    _ms(t.a2a_exposed),
                    _ms(t.other_comm),
                    f"{float(t.memory) / 1e9:.3g}",
                    "; ".join(c.notes),
                )
            )
        widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
        lines = [head] + ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        if len(self.ranked) > limit:
            lines.append(f"... {len(self.ranked) - limit} more")
        if self.eligible():
            lines.append(
                f"best: {self.best.label}" + (f"; runner-up: {self.runner_up.label}" if self.runner_up else "")
            )
        else:
            lines.append("no eligible plan: every candidate exceeds device memory, cannot run these blocks or "
                         "changes the math")
        if self.expression_substituted is not None:
            lines.append(f"best, by the per-layer formulas: step time [s] = {self.expression_substituted}")
        hp = next((i for i, c in enumerate(self.ranked, 1) if c.form == "hp"), None)
        if hp is not None:
            c = self.ranked[hp - 1]
            lines.append(f"hp: changes the model: {c.latent[0].summary()}; best {c.label}: {_ms(c.step)} ms/step, "
                         f"#{hp} of {len(self.ranked)}"
                         + ("" if self.allow_math_changes else "; never picked unless math changes are allowed"))
        lines += [f"{form}: {why}" for form, why in self.not_modelled.items()]
        return "\n".join(lines)


def _ms(seconds: Any) -> str:
    return f"{float(seconds) * 1e3:.4g}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def topology_of(topology: Any) -> tuple[int, int]:
    """(nodes, ranks per node) from a Topology-like object or a tuple."""
    if isinstance(topology, tuple | list):
        nodes, per_node = topology
    else:
        nodes, per_node = topology.nodes, topology.ranks_per_node
    if int(nodes) < 1 or int(per_node) < 1:
        raise ValueError(f"topology=({nodes}, {per_node}) is invalid: nodes and ranks_per_node must be >= 1")
    return int(nodes), int(per_node)


def specs_of(specs_or_model: Any) -> list[Any]:
    """A list of MoESpec (or BlockShape) from a spec, a list, or a model (via moepass.detect, if present)."""
    from moepass.spec import MoESpec

    if isinstance(specs_or_model, list | tuple) and specs_or_model and all(
            isinstance(s, BlockShape) for s in specs_or_model):
        return list(specs_or_model)
    if isinstance(specs_or_model, MoESpec):
        return [specs_or_model]
    if isinstance(specs_or_model, list | tuple) and all(isinstance(s, MoESpec) for s in specs_or_model):
        return list(specs_or_model)
    try:
        from moepass import detect  # type: ignore[attr-defined]
    except ImportError as e:
        raise TypeError("search needs a list of MoESpec: moepass.detect is not available to read a model") from e
    return list(detect(specs_or_model).blocks)


def hardware_of(profile: Any) -> Hardware:
    """`search`'s `profile` as figures: `cost_model.presets.resolve_hardware` (None: this machine)."""
    return resolve_hardware(profile)


def _figures(shape: BlockShape, hw: Hardware, T: float, G: int, rho: float, cf: float | None,
             recompute: bool | None = None, link: dict[str, Any] | None = None) -> dict[str, Any]:
    """The symbol values of one block; `link`: its dense gradients and all-reduce unit (`_link_figures`),
    which only EP prices."""
    return {
        **hw.values(),
        **({} if recompute is None else {"r_c": float(recompute)}),
        **(link or {}),
        "T": T,
        "K": shape.K,
        "D": shape.D,
        "F": shape.F,
        "m": shape.m,
        "E": shape.E,
        "G": G,
        "rho": rho,
        "c_f": cf if cf is not None else 1.0,
        "phi": shape.ffn_fraction,
    }


def _symbols(shapes: Sequence[BlockShape] = ()) -> dict[str, Any]:
    """Every symbol of the table, and phi where a block has zero-compute experts (1 otherwise: not shown)."""
    optional = {"phi": S.phi} if any(s.zero_compute for s in shapes) else {}
    return {**{name: info.symbol for name, info in S.TABLE.items()}, **optional}


def _link_figures(shape: BlockShape, seq: int, schedule: str, micro_op_bytes: int) -> dict[str, Any]:
    """P_d, q and u of a block: its dense parameters, the sequence length, the all-reduce unit of `schedule`."""
    unit = micro_op_bytes if schedule == "priority" else DDP_BUCKET_BYTES
    return {"P_d": shape.dense_params, "q": seq, "u": unit}


def dense_params_of(model: Any, shapes: Sequence[BlockShape]) -> int | None:
    """The dense parameters of a torch model: all its parameters but the experts' (E m D F per block), or
    None for anything that is not an nn.Module."""
    parameters = getattr(model, "parameters", None)
    if not callable(parameters):
        return None
    total = sum(p.numel() for p in parameters())
    return max(0, total - sum(int(expert_params(s.E, s.D, s.F, s.m)) for s in shapes))


def search(
    specs_or_model: Any,
    topology: Any,
    batch: tuple[int, int],
    *,
    profile: Any = None,
    world_size: int | None = None,
    imbalance: float = 1.0,
    ep_sizes: Iterable[int] | None = None,
    capacity_factors: Sequence[float | None] = CAPACITY_FACTORS,
    chunks: Sequence[int] = DEFAULT_CHUNKS,
    packings: Sequence[int] = PACKINGS,
    allow_math_changes: bool = False,
    recompute: bool | None = None,
    slots: Iterable[int] | None = None,
    hp_sizes: Iterable[int] | None = None,
    heads: int | None = None,
    head_dim: int | None = None,
    dense_params: float | None = None,
    schedule: str = "fair",
    micro_op_bytes: int = MICRO_OP_BYTES,
    trace: Any = None,
    prefetch_depth: int = 2,
) -> SearchResult:
    """Ranked plans for `specs_or_model` on `topology` with `batch` = (batch, seq) tokens per rank.

    `profile`: a Hardware, a preset name ('a100', 'h100', 'ascend910a'), a calibration JSON path, or
    None for this machine. `imbalance` is max/mean routed rows per rank under EP (1 = uniform routing;
    the module docstring says how FSEP reads it). `recompute`: whether the expert backward recomputes
    gate/up (`Plan.expert_recompute`); None: the hardware's figure (`Hardware.recompute`: the kernel's
    default there). `slots`: FSEP's slots per device C to price (those with W*C < E are skipped); None:
    ceil(E/W) .. ceil(E/W) + 2, or none when `ep_sizes` restricts the search to EP degrees; () : no FSEP.
    `hp_sizes`: HP degrees P to price (divisors of W > 1); None: every one, or none when `ep_sizes`
    restricts the search; (): no HP. `heads`, `head_dim`: the Multi-Head LatentMoE's (`Plan.heads`,
    `Plan.head_dim`); None: `moepass.rewrite.latent`'s defaults for each P.

    EP's gradient all-reduce shares the all-to-all's link (`cost_model.ep.ep_step`): `dense_params` is
    the model's dense parameter count (attention, norms, embeddings: all-reduced over W), spread evenly
    over the blocks; None: counted from the model when one is given (`dense_params_of`), else each block's
    `BlockShape.dense` (4 D^2, the attention projections, when unknown: embeddings then not counted).
    `schedule`: how the two share the link, "fair" (DDP: fair share, 25 MiB buckets; `Plan.grad_sync=
    "none"`) or "priority" (Lina's scheduler, `Plan.grad_sync="scheduler"`: the all-to-all waits behind at
    most one micro-op of `micro_op_bytes`, `Plan.micro_op_bytes`).

    Every candidate is ranked by its price on the step timeline (`cost_model.model_cases`: the function the
    scenario simulator prices with, `cost_model.systems.price`); `trace`: recorded routed rows [steps, source
    ranks, E] (or [source ranks, E]) in place of `imbalance`, the last step priced, the steps before it the
    history FSEP's planner sees; `prefetch_depth`: FSEP's (`Plan.prefetch_depth`). The per-layer formulas
    (`Candidate.formula`) give `SearchResult.expression`.
    """
    nodes, per_node = topology_of(topology)
    W = world_size or nodes * per_node
    T = int(batch[0]) * int(batch[1])
    hw = hardware_of(profile)
    blocks = specs_of(specs_or_model)
    shapes = [s if isinstance(s, BlockShape) else BlockShape.of(s, T) for s in blocks]
    if not shapes:
        raise ValueError("search got no MoE blocks: nothing to plan")
    if schedule not in POLICIES:
        raise ValueError(f"search got schedule={schedule!r}: use one of {list(POLICIES)}")
    if dense_params is None:
        dense_params = dense_params_of(specs_or_model, shapes)
    if dense_params is not None:
        if dense_params < 0:
            raise ValueError(f"search got dense_params={dense_params!r}: a parameter count, >= 0")
        shapes = [dataclasses.replace(s, dense=dense_params / len(shapes)) for s in shapes]
    links = [_link_figures(s, int(batch[1]), schedule, micro_op_bytes) for s in shapes]
    restricted = ep_sizes is not None
    eps = sorted(set(ep_sizes)) if ep_sizes is not None else [d for d in divisors(W) if d > 1]
    if imbalance < 1:
        raise ValueError(f"search got imbalance={imbalance!r}: it is max/mean routed rows per rank, >= 1")

    def price(ep_eff: int, cf: float | None, n: int, dropless_blocks: bool) -> LayerTerms:
        block_cfs = [cf if cf is not None else shape.cf for shape in shapes]
        xs = [_figures(shape, hw, T, per_node, ep_imbalance(shape, T, W, ep_eff, imbalance), block_cf, recompute, link)
              for shape, block_cf, link in zip(shapes, block_cfs, links)]
        return ep_step(xs, ep=ep_eff, n=n, dp=W // ep_eff, dropless=[c is None for c in block_cfs],
                       cross_node_dp=nodes > 1, policy=schedule)

    def candidate(form: str, ep_size: int, packing: int, cf: float | None, n: int) -> Candidate:
        ep_eff = ep_size // packing
        terms = price(ep_eff, cf, n, cf is None)
        notes = []
        feasible = float(terms.memory) <= float(hw.memory)
        if not feasible:
            notes.append(f"needs {float(terms.memory) / 1e9:.3g} GB > {float(hw.memory) / 1e9:.3g} GB")
        changing = cf is not None and any(cf != s.cf for s in shapes)
        if changing:
            notes.append("capacity drops tokens (math-changing)")
        if any(s.zero_compute and (cf if cf is not None else s.cf) is not None for s in shapes):
            feasible = False
            notes.append(ZERO_COMPUTE_REFUSED["capacity"])
        if packing > 1:
            notes.append(f"experts on {ep_eff} ranks x{packing} replicas")
        return Candidate(form, ep_size, cf, n, packing, terms, feasible, changing, tuple(notes))

    x_last = _figures(shapes[0], hw, T, per_node, imbalance, shapes[0].cf, recompute, links[0])
    dense_tail = dense_allreduce_tail(x_last, W, cross_node=nodes > 1)
    cands = [candidate("single", 1, 1, None, 1)]
    seen: set[tuple[int, float | None, int]] = set()
    for ep_size in eps:
        for packing in sorted(packings):
            if ep_size % packing or ep_size // packing < 2:
                continue
            ep_eff = ep_size // packing
            if any(s.E % ep_eff for s in shapes):
                continue
            for cf in capacity_factors:
                for n in chunks:
                    key = (ep_eff, cf, n)
                    if key in seen and not restricted:
                        continue
                    seen.add(key)
                    cands.append(candidate("ep", ep_size, packing, cf, n))
    not_modelled = dict(NOT_MODELLED)
    if any(s.cf is not None for s in shapes):
        not_modelled["fsep"] = "FSEP is priced for dropless blocks only: this model has a capacity factor"
    elif W > 1:
        E_max = max(s.E for s in shapes)
        c_min = -(-E_max // W)
        wanted = range(c_min, c_min + SLOT_RANGE) if slots is None and not restricted else (slots or ())
        for C in sorted(set(wanted)):
            if W * C < E_max:
                continue  # every expert needs a slot
            routing = tuple(_routed(shape, hw, T, W, per_node, C, imbalance, recompute) for shape in shapes)
            for n in chunks:
                cands.append(_with_dense_tail(_fsep_candidate(shapes, routing, hw, T, W, per_node, C, n, recompute),
                                              dense_tail))
    wanted_hp = [d for d in divisors(W) if d > 1] if hp_sizes is None and not restricted else (hp_sizes or ())
    skipped = []
    for P in sorted(set(wanted_hp)):
        hp = _hp_candidate(blocks, shapes, hw, T, W, nodes, per_node, P, heads, head_dim, recompute)
        if isinstance(hp, str):
            skipped.append(hp)
        else:
            cands.append(_with_dense_tail(hp, dense_tail))
    if skipped:
        not_modelled["hp"] = "not priced: " + "; ".join(skipped)
    if W != nodes * per_node:
        raise ValueError(f"search got world_size={W} for {nodes} node(s) x {per_node} ranks: they must agree")
    groups = model_cases.contexts(shapes, nodes, per_node, (int(batch[0]), int(batch[1])), hw, imbalance=imbalance,
                                  trace=trace, heads=heads, head_dim=head_dim, recompute=recompute)
    cands = [_on_timeline(c, groups, hw, schedule, micro_op_bytes, prefetch_depth) for c in cands]
    ranked = sorted(cands, key=lambda c: (not c.feasible, c.math_changing and not allow_math_changes, c.step))
    priced_routing = groups[0][1].trace("learned").description
    return SearchResult(ranked, hw, W, nodes, per_node, T, allow_math_changes, shapes, imbalance, not_modelled,
                        schedule=schedule, links=links, routing=priced_routing)


def _on_timeline(c: Candidate, groups: list[Any], hw: Hardware, schedule: str, micro_op_bytes: int,
                 prefetch: int) -> Candidate:
    """`c` with its terms from the step timeline (`model_cases.timed`); feasible when it fits as moepass builds
    it and its rewrite runs these blocks (the formulas' refusals kept)."""
    plan = model_cases.step_plan(c.form, ep_size=c.ep_size, packing=c.packing, chunks=c.a2a_chunks,
                                 capacity=c.capacity_factor, slots=c.slots, schedule=schedule,
                                 micro_op_bytes=micro_op_bytes, prefetch=prefetch)
    timed = model_cases.timed(plan, groups, hw)
    kept = tuple(n for n in c.notes if not n.startswith(("needs ", "planner max/mean")))
    refused = any(n in ZERO_COMPUTE_REFUSED.values() for n in c.notes)
    return dataclasses.replace(c, terms=timed.terms, formula=c.terms, feasible=timed.fits and not refused,
                               notes=timed.notes + kept)


def _with_dense_tail(c: Candidate, tail: float) -> Candidate:
    """A form whose gradient traffic is priced without the dense parameters (FSEP, HP), plus what every form
    pays for them: the last block's dense all-reduce, which no compute hides (EP prices it in `ep_step`)."""
    return dataclasses.replace(c, terms=c.terms + LayerTerms(0, 0, tail, 0, 0))


def skewed_counts(T: int, K: int, E: int, W: int, imbalance: float, ffn_fraction: float = 1.0) -> np.ndarray:
    """[W, E] routed rows to the E FFN experts, T*K*ffn_fraction per source rank (the assignments that pick
    zero-compute experts are neither sent nor computed), whose plain-EP max/mean is `imbalance`: every rank
    routes with the same Zipf popularity (`cost_model.ep.zipf_counts`), fitted at the planner's reference EP
    degree (the largest divisor of W that divides E; E when that is 1)."""
    ep = max(d for d in divisors(W) if E % d == 0)
    ep = E if ep == 1 else ep
    s = zipf_for_imbalance(imbalance, T, K, E, ep) if imbalance > 1 else 0.0
    return zipf_counts(T, K, E, W, s) * ffn_fraction


@functools.lru_cache(maxsize=1024)
def ep_imbalance(shape: BlockShape, T: int, W: int, ep: int, imbalance: float) -> float:
    """max/mean rows per rank of EP over `ep` ranks when it is `imbalance` at the reference degree (the largest
    divisor of W that divides E): the same Zipf popularity (`skewed_counts`) placed on ep ranks, the first
    ep of the source ranks forming the group (as `cost_model.simulate` groups packed ranks)."""
    reference = max(d for d in divisors(W) if shape.E % d == 0)
    if imbalance <= 1 or ep == reference or ep == 1 or shape.E % ep:
        return imbalance
    counts = skewed_counts(T, shape.K, shape.E, W, imbalance)
    return ep_rows_imbalance(rank_rows(counts[:ep], ep))


@functools.lru_cache(maxsize=256)
def _routed(shape: BlockShape, hw: Hardware, T: int, W: int, G: int, C: int, imbalance: float,
            recompute: bool | None) -> Routed:
    """The planner's table for this block's skewed counts and what it leaves: FSEP's max/mean and token bytes."""
    from moepass.runtime.placement import planned_routing

    counts = skewed_counts(T, shape.K, shape.E, W, imbalance, shape.ffn_fraction)
    routed = planned_routing(counts, hw, C=C, ranks_per_node=G, D=shape.D, F=shape.F, gated=shape.m == 3,
                             recompute=recompute)
    v = hw.values()
    a2a_rows = routed.busiest_a2a_rows(G, v["B_intra"], v["B_inter"])
    return Routed(routed.max_over_mean, a2a_rows, routed.decision.ep_max_over_mean, routed.decision.candidate)


def _fsep_figures(shape: BlockShape, hw: Hardware, T: Any, G: int, recompute: bool | None) -> dict[str, Any]:
    return _figures(shape, hw, T, G, 1.0, None, recompute)


def _fsep_candidate(shapes: list[BlockShape], routing: tuple[Routed, ...], hw: Hardware, T: int, W: int, G: int,
                    C: int, n: int, recompute: bool | None) -> Candidate:
    total: LayerTerms | None = None
    for i, (shape, r) in enumerate(zip(shapes, routing)):  # the first block's gradient exchange is waited at
        terms = fsep_formulas.fsep_layer(_fsep_figures(shape, hw, T, G, recompute), W=W, C=C, n=n, rho=r.rho,
                                         a2a_rows=r.a2a_rows, deferred_grads=i > 0)  # once, the others deferred
        total = terms if total is None else total + terms
    assert total is not None
    v = hw.values()
    # one layer's restored experts and their gradients at a time (Plan.keep_restored=False, the default), plus
    # the deferred exchange's send and receive buffers (Plan.defer_expert_grads=True, the default)
    grads = max(C * float(fsep_formulas.expert_elements(s.D, s.F, s.m)) * (v["b"] + 3 * v["b_g"]) for s in shapes)
    total = total + LayerTerms(0, 0, 0, grads, 0)
    notes = []
    feasible = float(total.memory) <= float(hw.memory)
    if not feasible:
        notes.append(f"needs {float(total.memory) / 1e9:.3g} GB > {float(hw.memory) / 1e9:.3g} GB")
    if any(s.zero_compute for s in shapes):
        feasible = False
        notes.append(ZERO_COMPUTE_REFUSED["fsep"])
    worst = max(routing, key=lambda r: r.rho)
    notes.append(f"planner max/mean {worst.rho:.3g} vs EP {worst.ep_rho:.3g} ({worst.table} table)")
    return Candidate("fsep", W, None, n, 1, total, feasible, False, tuple(notes), slots=C, routing=routing)


def _latent_input(block: Any, shape: BlockShape) -> Any:
    """The MoESpec `moepass.rewrite.latent.latent_shape` converts: the block's own, or one built from a bare
    BlockShape (swiglu when gated, gelu otherwise; a capacity factor is refused, as the conversion does)."""
    from moepass.spec import CapacitySpec, ExpertsSpec, MoESpec, RouterSpec, TensorSource

    if not isinstance(block, BlockShape):
        return block
    gated = shape.m == 3
    return MoESpec(
        path="block", recogniser="cost_model", router=RouterSpec(num_experts=shape.E, top_k=shape.K),
        experts=ExpertsSpec(num_experts=shape.E, hidden_dim=shape.D, ffn_dim=shape.F,
                            activation="swiglu" if gated else "gelu",
                            w_up=TensorSource.param("experts.w_up") if gated else None),
        capacity=None if shape.cf is None else CapacitySpec(capacity_factor=shape.cf),
    )


def _hp_figures(shape: BlockShape, latent: Any, hw: Hardware, T: Any, G: int,
                recompute: bool | None) -> dict[str, Any]:
    """`_figures` for the Multi-Head LatentMoE a block converts to: H, h, E per head, F its experts' width."""
    return {**_figures(shape, hw, T, G, 1.0, None, recompute), "H": latent.heads, "h": latent.head_dim,
            "E": latent.experts, "F": latent.ffn_dim}


def _hp_candidate(blocks: list[Any], shapes: list[BlockShape], hw: Hardware, T: int, W: int, nodes: int, G: int,
                  P: int, heads: int | None, head_dim: int | None, recompute: bool | None) -> Candidate | str:
    """HP over P ranks for every block (each converted at equal active parameters), or why not."""
    from moepass.errors import PlanError
    from moepass.plan import Plan
    from moepass.rewrite.latent import latent_shape

    if W % P or P < 2:
        return f"P={P} is not a divisor > 1 of the {W} ranks"
    try:
        plan = Plan(form="hp", heads=heads, head_dim=head_dim, ep_size=P)
        latent = tuple(latent_shape(_latent_input(b, s), plan, P) for b, s in zip(blocks, shapes))
    except PlanError as err:
        return f"P={P}: {err}"
    total: LayerTerms | None = None
    for shape, lat in zip(shapes, latent):
        terms = hp_formulas.hp_layer(_hp_figures(shape, lat, hw, T, G, recompute), ep=P, dp=W // P,
                                     cross_node=nodes > 1)
        total = terms if total is None else total + terms
    assert total is not None
    notes = []
    feasible = float(total.memory) <= float(hw.memory)
    if not feasible:
        notes.append(f"needs {float(total.memory) / 1e9:.3g} GB > {float(hw.memory) / 1e9:.3g} GB")
    notes.append(f"{HP_CHANGE} (active params/token {latent[0].active_before:,} -> {latent[0].active_after:,})")
    return Candidate("hp", P, None, 1, 1, total, feasible, True, tuple(notes), latent=latent)


def _winner_expressions(best: Candidate, shapes: list[BlockShape], hw: Hardware, W: int, nodes: int, G: int,
                        rho: float, schedule: str, links: list[dict[str, Any]],
                        T: int) -> tuple[sympy.Expr, sympy.Expr]:
    """The winner's time per layer in symbols (a model of one such layer), and its step time with every
    figure substituted but T: the layers alone on their links as formulas of T, plus the all-reduce's
    contention (waits, exposed all-reduce) as its number at the search's T (a formula chained over the
    layers is too large to print)."""
    ep_eff = best.ep_size // best.packing
    plan: dict[str, Any] = dict(ep=ep_eff, n=best.a2a_chunks, dp=W // ep_eff, cross_node_dp=nodes > 1)
    cfs = [best.capacity_factor if best.capacity_factor is not None else shape.cf for shape in shapes]
    generic = sympy.sympify(ep_layer(_symbols(shapes), dropless=cfs[0] is None, policy=schedule, **plan).step)
    xs = [_figures(shape, hw, T, G, ep_imbalance(shape, T, W, ep_eff, rho), cf, link=link)
          for shape, cf, link in zip(shapes, cfs, links)]

    def alone(x: dict[str, Any], cf: float | None) -> Any:
        return ep_alone(x, dropless=cf is None, **plan)[0].step

    contention = float(ep_step(xs, dropless=[cf is None for cf in cfs], policy=schedule, **plan).step) - sum(
        float(alone(x, cf)) for x, cf in zip(xs, cfs))
    substituted = sum((sympy.sympify(alone({**x, "T": S.T}, cf)) for x, cf in zip(xs, cfs)), sympy.Integer(0))
    return generic, (sympy.simplify(substituted) + contention).evalf(4)


def _fsep_expressions(best: Candidate, shapes: list[BlockShape], hw: Hardware, G: int) -> tuple[sympy.Expr,
                                                                                               sympy.Expr]:
    """An FSEP winner's time per layer in symbols (rho: the planner's max/mean; the all-to-all's rows as
    fractions of T*K*phi from its routing), and its step time with every figure substituted but T."""
    C = best.slots
    assert C is not None

    def formula(x: dict[str, Any], r: Routed, rho: Any, deferred: bool) -> sympy.Expr:
        return sympy.sympify(fsep_formulas.fsep_layer(x, W=best.ep_size, C=C, n=best.a2a_chunks, rho=rho,
                                                      a2a_rows=r.a2a_rows, deferred_grads=deferred).step)

    generic = formula(_symbols(shapes), best.routing[0], S.rho, True)  # a layer whose gradient exchange is deferred
    substituted = sympy.Integer(0)
    for i, (shape, r) in enumerate(zip(shapes, best.routing)):
        substituted += formula({**_fsep_figures(shape, hw, 0, G, None), "T": S.T}, r, r.rho, i > 0)
    return generic, sympy.simplify(substituted).evalf(4)


def _hp_expressions(best: Candidate, shapes: list[BlockShape], hw: Hardware, W: int, nodes: int,
                    G: int) -> tuple[sympy.Expr, sympy.Expr]:
    """An HP winner's time per layer in symbols (H, h, E per head, F the latent experts' width), and its
    step time with every figure substituted but T."""
    P = best.ep_size

    def formula(x: dict[str, Any]) -> sympy.Expr:
        return sympy.sympify(hp_formulas.hp_layer(x, ep=P, dp=W // P, cross_node=nodes > 1).step)

    generic = formula(_symbols())
    substituted = sympy.Integer(0)
    for shape, latent in zip(shapes, best.latent):
        substituted += formula({**_hp_figures(shape, latent, hw, 0, G, None), "T": S.T})
    return generic, sympy.simplify(substituted).evalf(4)

