"""Plan search: rank the plans the cost model can price for a model, a topology and a batch.

The ranking is the step timeline's: every candidate is priced by `cost_model.systems.price` (through
`cost_model.model_cases`), the function `python -m cost_model <scenario>` reports, so a model's search,
`Plan(form="auto")` and the simulator agree. The per-layer formulas described below price each candidate too
(`Candidate.formula`) and give the winner's printed expression; where they and the timeline differ (the
timeline lays out chunks, buckets and the dense compute step by step), the timeline ranks.

This module holds `search`; what it prices (`PlanSpace`, per form `EPSpace` / `FSEPSpace` / `HPSpace`) and
with which figures (`Pricing`) are in `cost_model.search_space`, the types and constants in
`cost_model.search_types`, the per-form figures and expressions in `cost_model.search_forms`, the result and
its table in `cost_model.search_result`, each re-exported here (`from cost_model.search import BlockShape, ...`).

Candidates (the default `PlanSpace`): no rewrite ("single": every rank keeps every expert, data parallel over W), EP with
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
priced once (the plain form is kept) unless the plan space names the EP degrees (`EPSpace.sizes`).

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
`PlanSpace(allow_math_changes=True)`; `Plan(form="auto")` never sets it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from cost_model import model_cases
from cost_model.ep import (
    LayerTerms,
    dense_allreduce_tail,
    ep_step,
    expert_params,
)
from cost_model.presets import Hardware, resolve_hardware

# the plan search on a published set-up, re-exported where `python -m moepass search --scenario` finds it
from cost_model.scenario_search import ScenarioSearch as ScenarioSearch
from cost_model.scenario_search import rank_case as rank_case
from cost_model.scenario_search import scenario_contexts as scenario_contexts
from cost_model.scenario_search import search_scenario as search_scenario
from cost_model.search_forms import block_figures as block_figures
from cost_model.search_forms import divisors as divisors
from cost_model.search_forms import ep_imbalance as ep_imbalance
from cost_model.search_forms import fsep_candidate as fsep_candidate
from cost_model.search_forms import hp_candidate as hp_candidate
from cost_model.search_forms import link_figures as link_figures
from cost_model.search_forms import routed_of as routed_of
from cost_model.search_forms import skewed_counts as skewed_counts
from cost_model.search_result import SearchResult as SearchResult
from cost_model.search_space import EPSpace as EPSpace
from cost_model.search_space import FSEPSpace as FSEPSpace
from cost_model.search_space import HPSpace as HPSpace
from cost_model.search_space import PlanSpace as PlanSpace
from cost_model.search_space import Pricing as Pricing
from cost_model.search_types import CAPACITY_FACTORS as CAPACITY_FACTORS
from cost_model.search_types import HP_CHANGE as HP_CHANGE
from cost_model.search_types import NOT_MODELLED as NOT_MODELLED
from cost_model.search_types import PACKINGS as PACKINGS
from cost_model.search_types import SLOT_RANGE as SLOT_RANGE
from cost_model.search_types import ZERO_COMPUTE_REFUSED as ZERO_COMPUTE_REFUSED
from cost_model.search_types import BlockShape as BlockShape
from cost_model.search_types import Candidate as Candidate
from cost_model.search_types import Routed as Routed


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
    space: PlanSpace | None = None,
    *,
    profile: Any = None,
    pricing: Pricing | None = None,
) -> SearchResult:
    """Ranked plans for `specs_or_model` on `topology` with `batch` = (batch, seq) tokens per rank.

    `space`: the forms and option values to try (`cost_model.search_space.PlanSpace`; None: every form over the
    default ranges). `profile`: a Hardware, a preset name ('a100', 'h100', 'ascend910a'), a calibration JSON
    path, or None for this machine. `pricing`: the routing, expert recompute, dense parameters and gradient
    schedule every plan is priced with (`cost_model.search_space.Pricing`; None: uniform routing, the hardware's
    recompute, the model's dense parameters, DDP's fair sharing).

    EP's gradient all-reduce shares the all-to-all's link (`cost_model.ep.ep_step`): the dense parameters are
    spread evenly over the blocks; without `Pricing.dense_params` they are counted from the model when one is given
    (`dense_params_of`), else each block's `BlockShape.dense` (4 D^2, the attention projections: embeddings then
    not counted). Every candidate is ranked by its price on the step timeline (`cost_model.model_cases`: the
    function the scenario simulator prices with, `cost_model.systems.price`). The per-layer formulas
    (`Candidate.formula`) give `SearchResult.expression`.
    """
    space = PlanSpace() if space is None else space
    pricing = Pricing() if pricing is None else pricing
    imbalance, recompute, schedule = pricing.imbalance, pricing.recompute, pricing.schedule
    micro_op_bytes = pricing.micro_op_bytes
    nodes, per_node = topology_of(topology)
    W = nodes * per_node
    T = int(batch[0]) * int(batch[1])
    hw = hardware_of(profile)
    blocks = specs_of(specs_or_model)
    shapes = [s if isinstance(s, BlockShape) else BlockShape.of(s, T) for s in blocks]
    if not shapes:
        raise ValueError("search got no MoE blocks: nothing to plan")
    dense_params = pricing.dense_params
    if dense_params is None:
        dense_params = dense_params_of(specs_or_model, shapes)
    if dense_params is not None:
        shapes = [dataclasses.replace(s, dense=dense_params / len(shapes)) for s in shapes]
    links = [link_figures(s, int(batch[1]), schedule, micro_op_bytes) for s in shapes]
    restricted = space.ep.sizes is not None  # equivalent EP candidates priced once unless the degrees are named
    eps = [] if "ep" not in space.forms else (sorted(set(space.ep.sizes)) if space.ep.sizes is not None
                                              else [d for d in divisors(W) if d > 1])

    def price(ep_eff: int, cf: float | None, n: int, dropless_blocks: bool) -> LayerTerms:
        block_cfs = [cf if cf is not None else shape.cf for shape in shapes]
        xs = [block_figures(shape, hw, T, per_node, ep_imbalance(shape, T, W, ep_eff, imbalance), block_cf, recompute, link)
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

    x_last = block_figures(shapes[0], hw, T, per_node, imbalance, shapes[0].cf, recompute, links[0])
    dense_tail = dense_allreduce_tail(x_last, W, cross_node=nodes > 1)
    cands = [candidate("single", 1, 1, None, 1)] if "single" in space.forms else []
    seen: set[tuple[int, float | None, int]] = set()
    for ep_size in eps:
        for packing in sorted(space.ep.packings):
            if ep_size % packing or ep_size // packing < 2:
                continue
            ep_eff = ep_size // packing
            if any(s.E % ep_eff for s in shapes):
                continue
            for cf in space.ep.capacity_factors:
                for n in space.ep.a2a_chunks:
                    key = (ep_eff, cf, n)
                    if key in seen and not restricted:
                        continue
                    seen.add(key)
                    cands.append(candidate("ep", ep_size, packing, cf, n))
    not_modelled = dict(NOT_MODELLED)
    if any(s.cf is not None for s in shapes):
        not_modelled["fsep"] = "FSEP is priced for dropless blocks only: this model has a capacity factor"
    elif W > 1 and "fsep" in space.forms:
        E_max = max(s.E for s in shapes)
        c_min = -(-E_max // W)
        wanted = range(c_min, c_min + SLOT_RANGE) if space.fsep.slots is None else space.fsep.slots
        for C in sorted(set(wanted)):
            if W * C < E_max:
                continue  # every expert needs a slot
            routing = tuple(routed_of(shape, hw, T, W, per_node, C, imbalance, recompute) for shape in shapes)
            for n in space.fsep.a2a_chunks:
                cands.append(_with_dense_tail(fsep_candidate(shapes, routing, hw, T, W, per_node, C, n, recompute),
                                              dense_tail))
    wanted_hp = (() if "hp" not in space.forms else [d for d in divisors(W) if d > 1] if space.hp.sizes is None
                 else space.hp.sizes)
    heads, head_dim = space.hp.heads, space.hp.head_dim
    skipped = []
    for P in sorted(set(wanted_hp)):
        hp = hp_candidate(blocks, shapes, hw, T, W, nodes, per_node, P, heads, head_dim, recompute)
        if isinstance(hp, str):
            skipped.append(hp)
        else:
            cands.append(_with_dense_tail(hp, dense_tail))
    if skipped:
        not_modelled["hp"] = "not priced: " + "; ".join(skipped)
    groups = model_cases.contexts(shapes, nodes, per_node, (int(batch[0]), int(batch[1])), hw, imbalance=imbalance,
                                  trace=pricing.trace, heads=heads, head_dim=head_dim, recompute=recompute)
    cands = [_on_timeline(c, groups, hw, schedule, micro_op_bytes, space.fsep.prefetch_depth) for c in cands]
    allow = space.allow_math_changes
    ranked = sorted(cands, key=lambda c: (not c.feasible, c.math_changing and not allow, c.step))
    priced_routing = groups[0][1].trace("learned").description
    return SearchResult(ranked, hw, W, nodes, per_node, T, allow, shapes, imbalance, not_modelled,
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


