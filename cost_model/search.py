"""Plan search: rank the plans the cost model can price for a model, a topology and a batch.

Candidates: no rewrite ("single": every rank keeps every expert, data parallel over W), and EP with
ep_size in the divisors of W, dropless or a capacity factor, a2a_chunks in powers of two, and expert
packing. Each is priced per step on the busiest rank as compute + exposed all-to-all + exposed other
communication (the expert-gradient all-reduce over the data-parallel replicas), with the memory per
rank. FSEP, HP and locality routing are listed as not modelled yet.

Packing P hosts P times the experts of plain EP on each device: the experts span ep/P ranks and are
replicated P times, which in this model is the same as ep_size = ep/P. Equivalent candidates are
priced once (the plain form is kept) unless the caller restricts `ep_sizes`.

Capacity factors are math-changing for a dropless model (tokens can be dropped): they are ranked
and shown, but `best` skips them unless `allow_math_changes=True`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy

from cost_model import symbols as S
from cost_model.ep import LayerTerms, ep_layer, matmuls
from cost_model.presets import Hardware, resolve_hardware
from cost_model.scenarios import cases
from cost_model.schedule import DEFAULT_CHUNKS

CAPACITY_FACTORS: tuple[float | None, ...] = (None, 1.0, 1.25, 2.0)
PACKINGS = (1, 2, 4)
NOT_MODELLED = {
    "fsep": "FSEP (LAER-MoE): not modelled yet",
    "hp": "Head Parallel (Multi-Head LatentMoE): not modelled yet",
    "locality": "locality routing (LocMoE): not modelled yet",
}


@dataclass(frozen=True)
class BlockShape:
    """What the cost model reads from an MoESpec."""

    E: int
    K: int
    D: int
    F: int
    m: int
    cf: float | None  # the model's own capacity factor; None: dropless

    @classmethod
    def of(cls, spec: Any, tokens: int) -> BlockShape:
        cap = spec.capacity
        cf = None
        if cap is not None:
            cf = cap.capacity_factor if cap.fixed is None else cap.fixed * spec.num_experts / (tokens * spec.top_k)
        x = spec.experts
        return cls(E=x.num_experts, K=spec.top_k, D=x.hidden_dim, F=x.ffn_dim, m=matmuls(x.gated), cf=cf)


@dataclass(frozen=True)
class Candidate:
    form: str
    ep_size: int  # ranks the experts are sharded over (1 for "single")
    capacity_factor: float | None
    a2a_chunks: int
    packing: int
    terms: LayerTerms  # summed over blocks, seconds per step (memory in bytes)
    feasible: bool
    math_changing: bool
    notes: tuple[str, ...] = ()

    @property
    def step(self) -> float:
        return float(self.terms.step)

    @property
    def label(self) -> str:
        if self.form == "single":
            return "single"
        cf = "dropless" if self.capacity_factor is None else f"cf={self.capacity_factor:g}"
        pack = f" P={self.packing}" if self.packing > 1 else ""
        return f"ep={self.ep_size}{pack} {cf} n={self.a2a_chunks}"

    def plan_kwargs(self) -> dict[str, Any]:
        if self.form == "single":
            return {"form": "single"}
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

    @functools.cached_property
    def expression(self) -> sympy.Expr | None:
        """The winner's time per layer in symbols (plan choices fixed), None without an eligible plan."""
        return self._expressions()[0] if self.eligible() else None

    @functools.cached_property
    def expression_substituted(self) -> sympy.Expr | None:
        """The winner's step time with every figure substituted but T (tokens per rank)."""
        return self._expressions()[1] if self.eligible() else None

    def _expressions(self) -> tuple[sympy.Expr, sympy.Expr]:
        return _winner_expressions(
            self.best, self.shapes, self.hardware, self.world_size, self.nodes, self.ranks_per_node, self.imbalance
        )

    def eligible(self) -> list[Candidate]:
        """The ranked candidates `best` may pick: feasible, and not math-changing unless allowed."""
        return [c for c in self.ranked if c.feasible and (self.allow_math_changes or not c.math_changing)]

    @property
    def best(self) -> Candidate:
        eligible = self.eligible()
        if not eligible:
            raise ValueError("no feasible plan: every candidate exceeds device memory; add ranks or shrink the batch")
        return eligible[0]

    @property
    def runner_up(self) -> Candidate | None:
        eligible = self.eligible()
        return eligible[1] if len(eligible) > 1 else None

    def to_plan_kwargs(self) -> dict[str, Any]:
        return self.best.plan_kwargs()

    def table(self, limit: int = 12) -> str:
        head = (
            f"plans for W={self.world_size} ({self.nodes} node(s) x {self.ranks_per_node}), T={self.tokens} "
            f"tokens/rank, hardware {self.hardware.name}" + ("" if self.hardware.calibrated else " (UNCALIBRATED)")
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
            lines.append("no eligible plan: every candidate exceeds device memory or changes the math")
        if self.expression_substituted is not None:
            lines.append(f"best step time [s] = {self.expression_substituted}")
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
             recompute: bool | None = None) -> dict[str, Any]:
    return {
        **hw.values(),
        **({} if recompute is None else {"r_c": float(recompute)}),
        "T": T,
        "K": shape.K,
        "D": shape.D,
        "F": shape.F,
        "m": shape.m,
        "E": shape.E,
        "G": G,
        "rho": rho,
        "c_f": cf if cf is not None else 1.0,
    }


def _symbols() -> dict[str, Any]:
    return {name: info.symbol for name, info in S.TABLE.items()}


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
) -> SearchResult:
    """Ranked plans for `specs_or_model` on `topology` with `batch` = (batch, seq) tokens per rank.

    `profile`: a Hardware, a preset name ('a100', 'h100', 'ascend910a'), a calibration JSON path, or
    None for this machine. `imbalance` is max/mean routed rows per rank (1 = uniform routing).
    `recompute`: whether the expert backward recomputes gate/up (`Plan.expert_recompute`); None: the
    hardware's figure (`Hardware.recompute`: the kernel's default there).
    """
    nodes, per_node = topology_of(topology)
    W = world_size or nodes * per_node
    T = int(batch[0]) * int(batch[1])
    hw = hardware_of(profile)
    shapes = [s if isinstance(s, BlockShape) else BlockShape.of(s, T) for s in specs_of(specs_or_model)]
    if not shapes:
        raise ValueError("search got no MoE blocks: nothing to plan")
    restricted = ep_sizes is not None
    eps = sorted(set(ep_sizes)) if ep_sizes is not None else [d for d in divisors(W) if d > 1]

    def price(ep_eff: int, cf: float | None, n: int, dropless_blocks: bool) -> LayerTerms:
        total: LayerTerms | None = None
        for shape in shapes:
            block_cf = cf if cf is not None else shape.cf
            x = _figures(shape, hw, T, per_node, imbalance, block_cf, recompute)
            terms = ep_layer(x, ep=ep_eff, n=n, dp=W // ep_eff, dropless=block_cf is None, cross_node_dp=nodes > 1)
            total = terms if total is None else total + terms
        assert total is not None
        return total

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
        if packing > 1:
            notes.append(f"experts on {ep_eff} ranks x{packing} replicas")
        return Candidate(form, ep_size, cf, n, packing, terms, feasible, changing, tuple(notes))

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
    ranked = sorted(cands, key=lambda c: (not c.feasible, c.math_changing and not allow_math_changes, c.step))
    return SearchResult(ranked, hw, W, nodes, per_node, T, allow_math_changes, shapes, imbalance)


def _winner_expressions(
    best: Candidate, shapes: list[BlockShape], hw: Hardware, W: int, nodes: int, G: int, rho: float
) -> tuple[sympy.Expr, sympy.Expr]:
    """The winner's time per layer in symbols, and its step time with every figure substituted but T."""
    ep_eff = best.ep_size // best.packing

    def formula(x: dict[str, Any], cf: float | None) -> sympy.Expr:
        return sympy.sympify(
            ep_layer(x, ep=ep_eff, n=best.a2a_chunks, dp=W // ep_eff, dropless=cf is None, cross_node_dp=nodes > 1).step
        )

    cf0 = best.capacity_factor if best.capacity_factor is not None else shapes[0].cf
    generic = formula(_symbols(), cf0)
    substituted = sympy.Integer(0)
    for shape in shapes:
        cf = best.capacity_factor if best.capacity_factor is not None else shape.cf
        x = {**_figures(shape, hw, 0, G, rho, cf), "T": S.T}
        substituted += formula(x, cf)
    return generic, sympy.simplify(substituted).evalf(4)


def search_scenario(scenario: Any, **options: Any) -> list[tuple[str, SearchResult]]:
    """`search` for every case of a published set-up (`../shared/scenarios/*.json`): (case label, result).

    The scenario's figures fill the hardware (nulls from the named preset, as `simulate` reports);
    every layer of a case is one block of its shape.
    """
    read = cases(scenario)
    results = []
    for case in read.cases:
        shape = BlockShape(E=case.E, K=case.K, D=case.D, F=case.F, m=matmuls(case.gated), cf=None)
        seq = case.seq or 1
        batch = (max(1, case.tokens // seq), seq)
        results.append((case.label, search([shape] * case.layers, (case.nodes, case.per_node), batch,
                                           profile=read.hardware, **options)))
    return results
