"""The options of each parallel form: one frozen, typed, validated dataclass per form (`FORM_OPTIONS`).

A `moepass.Plan` holds the options of its form (`Plan.options`); a field of another form cannot be set on it:
`HPOptions` has no `a2a_chunks`, and the flat spelling `Plan(form="hp", a2a_chunks=4)` raises `PlanError` naming
the field, the value, the form and the forms that have it. A field several forms share (`ep_size`, `topology`,
`capacity_factor`, ...) is declared in each of them with one type, one default and one check (`CHECKS`;
tests/test_plan.py keeps them equal). What each field does: `DOES`; which forms have it: `ACTS_UNDER`
(`moepass.plan`), derived from these classes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar, Literal, Protocol, TypeAlias, runtime_checkable

import torch

from cost_model.presets import PRESET_NAMES, Hardware, is_profile_path
from moepass.errors import PlanError, nearest

Form: TypeAlias = Literal["single", "ep", "fsep", "hp", "locality", "auto"]
FORMS: tuple[Form, ...] = ("single", "ep", "fsep", "hp", "locality", "auto")
Count: TypeAlias = int | Literal["auto"]  # a2a_chunks, packing: a count >= 1, or the cost model's choice
# FSEP: planner(counts_PE, current table) -> the next table (a slot -> expert list)
Planner: TypeAlias = Callable[[torch.Tensor, tuple[int, ...]], Sequence[int]]
PlannerChoice: TypeAlias = Literal["auto", "static"] | Planner
Gate: TypeAlias = Literal["grap", "learned"]
GATES: tuple[Gate, ...] = ("grap", "learned")  # form="locality": the top-1 router's gate
HardwareChoice: TypeAlias = str | os.PathLike[str] | Hardware | None
# routed rows [ranks, E] or [steps, ranks, E], kept as nested tuples
Rows: TypeAlias = tuple[tuple[float, ...], ...]
RoutingSkew: TypeAlias = float | Rows | tuple[Rows, ...] | None
DEFAULT_PREFETCH_DEPTH = 2
DEFAULT_ALPHA = 0.01  # form="locality": the balance-loss weight (LocMoE, Switch)


@runtime_checkable
class TopologyLike(Protocol):
    """What a plan reads of `moepass.Topology` (the runtime layer defines it: it reads the environment and the
    process group, above this plain-data layer)."""

    @property
    def nodes(self) -> int: ...

    @property
    def ranks_per_node(self) -> int: ...

    @property
    def world_size(self) -> int: ...


@dataclass(frozen=True)
class Options:
    """The options of one form. Each field is checked by `CHECKS[name]` (which may normalise it: routing rows
    become tuples); `_check` relates fields of the same form."""

    form: ClassVar[Form]

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            checked = CHECKS[f.name](value)
            if checked is not value:
                object.__setattr__(self, f.name, checked)
        self._check()

    def _check(self) -> None:
        """Checks between this form's fields (none by default)."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class SingleOptions(Options):
    """form="single": the canonical graph on one device."""

    form: ClassVar[Form] = "single"
    # the user's block runs instead of the rewritten graph for an input signature where it was timed faster at
    # its first call (`moepass.runtime.faster`); False: always the rewritten graph
    keep_original_if_slower: bool = True


# Groups of fields several forms share, each declared once (one type, one default); a form's class is its groups
# plus its own fields.
@dataclass(frozen=True)
class Priced(Options):
    """What the cost model prices an "auto" choice with."""

    batch: tuple[int, int] | None = None  # (batch, seq) per rank, for a2a_chunks / packing = "auto"
    # None: the calibration profile ~/.cache/moepass/profile.json if present, else CPU defaults; a preset name
    # (cost_model.presets.PRESET_NAMES), a profile path (.json) or a cost_model.presets.Hardware
    hardware: HardwareChoice = None


@dataclass(frozen=True)
class Placed(Options):
    """Where a distributed form puts its ranks."""

    ep_size: int | None = None  # None: the world size
    topology: TopologyLike | None = None  # None: from the torchrun environment


@dataclass(frozen=True)
class Exchanged(Placed):
    """A form whose tokens go to their experts by an all-to-all."""

    capacity_factor: float | None = None  # None: dropless, or the model's own capacity
    a2a_chunks: Count = "auto"


@dataclass(frozen=True)
class Restored(Options):
    """FSEP's restore of whole experts from their slices."""

    slots_per_device: int | None = None  # C; None: ceil(E/P) + 1
    planner: PlannerChoice = "auto"  # "auto" (load-adaptive), "static" (even), or planner(counts_PE, table)
    # keep each layer's C restored experts from its forward to its backward (+C*S elements per layer alive until
    # its backward) instead of restoring them again in the backward
    keep_restored: bool = False
    prefetch_depth: int = DEFAULT_PREFETCH_DEPTH  # later blocks whose restore a block issues early; 0: none
    # leave each layer's expert-gradient exchange in flight under the earlier layer's backward (2*C*S elements
    # alive one layer longer); False: wait for it in the layer's own backward
    defer_expert_grads: bool = True


@dataclass(frozen=True)
class Headed(Options):
    """The latent heads of a Multi-Head LatentMoE."""

    # latent heads H; None: the smallest multiple of the head-group count (ep_size / head_ep_size) that is >= 4
    heads: int | None = None
    head_dim: int | None = None  # width h of a head; None: hidden // heads


@dataclass(frozen=True)
class EPOptions(Exchanged, Priced):
    """form="ep": whole experts sharded over ep_size ranks, tokens sent to them by an all-to-all."""

    form: ClassVar[Form] = "ep"
    # the token exchange as a two-stage (intra-node, then inter-node) all-to-all; an EP group of >= 2 whole nodes
    # of >= 2 ranks (moepass.runtime.collectives, "Hierarchical (2D) all-to-all")
    hierarchical_a2a: bool = False
    packing: Count = 1  # experts hosted per device

    def _check(self) -> None:
        _hierarchical(self.hierarchical_a2a, self.topology, self.a2a_chunks)


@dataclass(frozen=True)
class FSEPOptions(Exchanged, Restored, Priced):
    """form="fsep": a 1/P slice of every expert per rank, C whole experts restored per step, placed by load."""

    form: ClassVar[Form] = "fsep"


@dataclass(frozen=True)
class HPOptions(Placed, Headed):
    """form="hp": the heads of a Multi-Head LatentMoE split over ep_size ranks (a standard block converted)."""

    form: ClassVar[Form] = "hp"
    # the ep_size ranks form ep_size/head_ep_size head groups of head_ep_size ranks (a group's experts sharded
    # over them); 1: pure HP
    head_ep_size: int = 1

    def _check(self) -> None:
        if self.head_ep_size != 1 and self.ep_size is not None and self.ep_size % self.head_ep_size:
            raise PlanError(f"Plan.head_ep_size={self.head_ep_size} is invalid with Plan.ep_size={self.ep_size}: the "
                            f"ep_size ranks of a block must split into head groups of head_ep_size ranks; use a "
                            f"head_ep_size dividing {self.ep_size}.")


@dataclass(frozen=True)
class LocalityOptions(Placed):
    """form="locality" (LocMoE): a top-1 router preferring the token's own node, with its losses."""

    form: ClassVar[Form] = "locality"
    capacity_factor: float | None = None
    hierarchical_a2a: bool = False
    gate: Gate = "learned"  # "grap": the fixed mean of each of E blocks of D/E channels; "learned": the router's
    mu: float | None = None  # the locality-loss weight; required by Plan(form="locality") (0: none)
    alpha: float = DEFAULT_ALPHA  # the balance-loss weight (moepass.aux_loss)

    def _check(self) -> None:
        _hierarchical(self.hierarchical_a2a, self.topology, 1)


@dataclass(frozen=True)
class AutoOptions(Restored, Headed, Priced):
    """form="auto": the cost model picks the form (`moepass.search`); these price it, and the FSEP and HP
    options are kept when that form wins (slots_per_device: the only C the search prices for FSEP; batch:
    required at compile)."""

    form: ClassVar[Form] = "auto"
    topology: TopologyLike | None = None
    # the routing priced: max/mean routed rows per rank under EP (>= 1), or recorded routed rows [steps, ranks, E]
    # or [ranks, E] (the last step priced, the steps before it FSEP's planner history); None: uniform
    routing_skew: RoutingSkew = None


FormOptions: TypeAlias = SingleOptions | EPOptions | FSEPOptions | HPOptions | LocalityOptions | AutoOptions
FORM_OPTIONS: dict[str, type[FormOptions]] = {
    cls.form: cls for cls in (SingleOptions, EPOptions, FSEPOptions, HPOptions, LocalityOptions, AutoOptions)}
OPTION_DEFAULTS: dict[str, object] = {
    f.name: f.default for cls in FORM_OPTIONS.values() for f in fields(cls)}

# What each option does, for the error that refuses it under a form without it.
DOES = {
    "ep_size": "it sets the EP degree of the distributed forms ('ep', 'fsep', 'hp', 'locality'), with data "
               "parallel over the rest; form='auto' picks its own",
    "topology": "it groups the ranks of the distributed forms ('ep', 'fsep', 'hp', 'locality') into nodes, and "
                "form='auto' prices with it",
    "capacity_factor": "it caps the tokens each expert takes under form='ep', 'fsep' and 'locality' (form='single' "
                       "keeps the model's own routing, dropless or its own capacity; form='auto' picks its own)",
    "a2a_chunks": "it splits the token all-to-all of form='ep' and form='fsep' into pipelined micro-ops "
                  "(form='auto' picks its own)",
    "hierarchical_a2a": "it splits the token all-to-all of form='ep' and form='locality' into an intra-node and an "
                        "inter-node stage",
    "packing": "it hosts k times the experts per device under form='ep' (form='auto' picks its own)",
    "slots_per_device": "it sizes the expert slots of FSEP",
    "planner": "it places the expert slots of FSEP",
    "keep_restored": "it keeps FSEP's restored experts for the backward",
    "prefetch_depth": "it prefetches FSEP's expert restores",
    "defer_expert_grads": "it makes FSEP wait for its expert-gradient exchange in each layer's backward",
    "heads": "it shapes the Multi-Head LatentMoE of form='hp'",
    "head_dim": "it shapes the Multi-Head LatentMoE of form='hp'",
    "head_ep_size": "it puts expert parallel inside the head groups of form='hp'",
    "gate": "gate, mu and alpha configure the routing of form='locality'",
    "mu": "gate, mu and alpha configure the routing of form='locality'",
    "alpha": "gate, mu and alpha configure the routing of form='locality'",
    "batch": "it gives the cost model the tokens per rank: form='auto', and a2a_chunks='auto' / packing='auto' "
             "under form='ep' and 'fsep'",
    "hardware": "the cost model prices with it: form='auto', and a2a_chunks='auto' / packing='auto' / FSEP's "
                "planner under form='ep' and 'fsep'",
    "routing_skew": "the cost model of form='auto' prices with it",
    "keep_original_if_slower": "it lets form='single' run the user's block where that was timed faster than the "
                               "rewritten graph (a distributed form has no original to fall back on)",
}


def forms_with(name: str) -> tuple[Form, ...]:
    """The forms whose options have the field `name`, in `FORMS` order."""
    return tuple(form for form in FORMS if name in FORM_OPTIONS[form].names())


# ---------------------------------------------------------------------------------------------------------------
# One check per field name: the value (normalised) or PlanError naming the field, the value and the fix.
# ---------------------------------------------------------------------------------------------------------------

def choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise PlanError(f"Plan.{name}={value!r} is invalid: use one of {list(choices)}.{nearest(value, choices)}")


def rule(name: str, ok: Callable[[object], bool], fix: str, near: Sequence[str] = ()) -> Callable[[object], object]:
    """The check of `Plan.<name>`: the value back when `ok(value)`, else a PlanError naming the field, the value
    and the fix (with the nearest of `near`)."""

    def check(value: object) -> object:
        if not ok(value):
            hint = nearest(value, list(near)) if near else ""
            raise PlanError(f"Plan.{name}={value!r} is invalid: {fix}{hint}")
        return value
    return check


def is_int(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def check_bool(name: str) -> Callable[[object], object]:
    return rule(name, lambda v: isinstance(v, bool), "use True or False.")


def _count_or_auto(name: str) -> Callable[[object], object]:
    return rule(name, lambda v: v == "auto" or is_int(v, 1), "use an int >= 1 or 'auto'.", near=["auto"])


def _positive_or_none(name: str) -> Callable[[object], object]:
    return rule(name, lambda v: v is None or is_int(v, 1), "use a positive int, or None for the default.")


_ep_size = rule("ep_size", lambda v: v is None or is_int(v, 1), "use a positive int dividing the world size.")
_topology = rule("topology", lambda v: v is None or isinstance(v, TopologyLike),
                 "use moepass.Topology(nodes, ranks_per_node), or None for the torchrun environment.")
_capacity_factor = rule("capacity_factor", lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                                       and v > 0),
                        "use a float > 0, or None for dropless routing.")
_slots = rule("slots_per_device", lambda v: v is None or is_int(v, 1), "use an int >= 1.")
_planner = rule("planner", lambda v: v in ("auto", "static") or callable(v),
                "use 'auto' (load-adaptive re-layout), 'static' (the even placement, never changed) or a callable "
                "planner(counts_PE, current_table) -> table.", near=["auto", "static"])
_prefetch_depth = rule("prefetch_depth", lambda v: is_int(v, 0),
                       "use an int >= 0 (0: each FSEP block restores its own experts; n: a block issues the next n "
                       "blocks' restores).")
_head_ep_size = rule("head_ep_size", lambda v: is_int(v, 1),
                     "use a positive int dividing ep_size (1: pure head parallel).")


def _gate(value: object) -> object:
    choice("gate", value, GATES)
    return value


def _weight(name: str, what: str, optional: bool) -> Callable[[object], object]:
    def check(value: object) -> object:
        if value is None and optional:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise PlanError(f"Plan.{name}={value!r} is invalid: use a finite float >= 0, the weight of the {what} "
                            f"(0 turns it off).")
        return value
    return check


def _batch(value: object) -> object:
    if value is None:
        return value
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value)):
        raise PlanError(f"Plan.batch={value!r} is invalid: use (batch, seq), two positive ints: the sequences and "
                        f"tokens per sequence of one rank.")
    return value if isinstance(value, tuple) else tuple(value)


def _hardware(value: object) -> object:
    if value is None or isinstance(value, Hardware):
        return value
    if is_profile_path(value):
        if not os.path.isfile(value):  # type: ignore[arg-type]
            raise PlanError(f"Plan.hardware={value!r} is invalid: no calibration profile at that path; run "
                            f"`python -m moepass calibrate --out {value}`, or use a preset {list(PRESET_NAMES)}.")
        return value
    if not isinstance(value, str) or value not in PRESET_NAMES:
        raise PlanError(f"Plan.hardware={value!r} is invalid: use a preset name {list(PRESET_NAMES)}, a calibration "
                        f"profile path (.json), a cost_model.presets.Hardware, or None for this machine's profile "
                        f"(~/.cache/moepass/profile.json, else CPU defaults).{nearest(value, PRESET_NAMES)}")
    return value


def _routing_skew(value: object) -> object:
    """A number >= 1, or routed rows [steps, ranks, E] / [ranks, E] (returned as nested tuples)."""
    if value is None:
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 1:
            raise PlanError(f"Plan.routing_skew={value!r} is invalid: a max/mean of routed rows per rank is >= 1 "
                            f"(1: uniform routing), or give recorded routed rows [steps, ranks, E].")
        return value
    import numpy as np

    try:
        rows = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        rows = np.zeros(0)
    if rows.ndim not in (2, 3) or rows.size == 0 or (rows < 0).any() or not np.isfinite(rows).all():
        raise PlanError(f"Plan.routing_skew of type {type(value).__name__} is invalid: give a max/mean >= 1, or "
                        f"recorded routed rows [steps, ranks, E] or [ranks, E] (non-negative counts).")
    if rows.ndim == 2:
        return tuple(map(tuple, rows.tolist()))
    return tuple(tuple(map(tuple, step)) for step in rows.tolist())


CHECKS: dict[str, Callable[[object], object]] = {
    "ep_size": _ep_size,
    "topology": _topology,
    "capacity_factor": _capacity_factor,
    "a2a_chunks": _count_or_auto("a2a_chunks"),
    "hierarchical_a2a": check_bool("hierarchical_a2a"),
    "packing": _count_or_auto("packing"),
    "slots_per_device": _slots,
    "planner": _planner,
    "keep_restored": check_bool("keep_restored"),
    "prefetch_depth": _prefetch_depth,
    "defer_expert_grads": check_bool("defer_expert_grads"),
    "keep_original_if_slower": check_bool("keep_original_if_slower"),
    "heads": _positive_or_none("heads"),
    "head_dim": _positive_or_none("head_dim"),
    "head_ep_size": _head_ep_size,
    "gate": _gate,
    "mu": _weight("mu", "locality loss mu*KL(D_current || D_local)", optional=True),
    "alpha": _weight("alpha", "balance loss", optional=False),
    "batch": _batch,
    "hardware": _hardware,
    "routing_skew": _routing_skew,
}


def _hierarchical(value: bool, topology: TopologyLike | None, chunks: Count) -> None:
    """hierarchical_a2a=True only where it changes something (refused, never a silent no-op): a topology of
    >= 2 nodes of >= 2 ranks, the exchange not chunked. Whether the EP group spans >= 2 whole nodes is checked at
    compile (`moepass.runtime.topology.node_groups`)."""
    if not value:
        return
    if topology is not None and (topology.nodes < 2 or topology.ranks_per_node < 2):
        raise PlanError(f"Plan.hierarchical_a2a=True is invalid with Plan.topology=Topology(nodes={topology.nodes}, "
                        f"ranks_per_node={topology.ranks_per_node}): it needs >= 2 nodes of >= 2 ranks (with one node "
                        f"every link is intra-node, with one rank per node the intra-node stage is empty: the "
                        f"exchange would be the flat one). Leave it False.")
    if isinstance(chunks, int) and chunks > 1:
        raise PlanError(f"Plan.a2a_chunks={chunks} with hierarchical_a2a=True is not built: the schedule pass chunks "
                        f"the flat exchange only. Use a2a_chunks=1 or 'auto' (which then picks 1), or "
                        f"hierarchical_a2a=False.")
