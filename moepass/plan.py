"""Plan: what moepass should do to a model. Frozen and validated at construction.

Each field acts under the forms `ACTS_UNDER` lists (docs/DESIGN.md, "The Plan"; every field with its
default: docs/USER_GUIDE.md, section 4); an unknown key or an impossible value raises `PlanError` naming
the field, the value and the fix.
"""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from cost_model.presets import MICRO_OP_BYTES, PRESET_NAMES, Hardware, is_profile_path
from moepass.errors import PlanError, nearest

# FSEP: planner(counts_PE, current table) -> the next table (a slot -> expert list)
Planner = Callable[[torch.Tensor, tuple[int, ...]], Sequence[int]]
FORMS = ("single", "ep", "fsep", "hp", "locality", "auto")
MATH_CHANGING_FORMS = ("hp", "locality")
DISTRIBUTED_FORMS = ("ep", "fsep", "hp", "locality")  # need torch.distributed initialised
LOWERINGS = ("auto", "triton", "torch")
GRAD_SYNCS = ("none", "scheduler")
PLAN_WIDE = ("deterministic", "grad_sync", "strict")  # process- or model-wide: not overridable per block
DEFAULT_MICRO_OP_BYTES = MICRO_OP_BYTES  # one figure for the runtime and the cost model's priority pricing
DEFAULT_PREFETCH_DEPTH = 2
GATES = ("grap", "learned")  # form="locality": the top-1 router's gate
DEFAULT_ALPHA = 0.01  # form="locality": the balance-loss weight (LocMoE, Switch)

# Which forms each field acts under, and what it does there: the one rule for "a field that does nothing".
# A field set away from its default under a form not listed raises PlanError naming the field, the value and
# the form (Plan validation, `_inert_fields`); under Plan.blocks a field the whole plan sets acts in the blocks
# whose form it acts under and is at its default in the others (`Plan.for_block`). "auto" is listed where the
# cost model reads the field or the form it picks keeps it (the FSEP fields when FSEP wins); the fields the
# search chooses itself (ep_size, capacity_factor, a2a_chunks, packing) are not: form="auto" would overwrite them.
ACTS_UNDER: dict[str, tuple[tuple[str, ...], str]] = {
    "form": (FORMS, "the parallel form"),
    "ep_size": (DISTRIBUTED_FORMS, "it sets the EP degree of the distributed forms ('ep', 'fsep', 'hp', "
                                   "'locality'), with data parallel over the rest; form='auto' picks its own"),
    "topology": ((*DISTRIBUTED_FORMS, "auto"), "it groups the ranks of the distributed forms ('ep', 'fsep', 'hp', "
                                               "'locality') into nodes, and form='auto' prices with it"),
    "capacity_factor": (("ep", "fsep", "locality"), "it caps the tokens each expert takes under form='ep', 'fsep' "
                                                    "and 'locality' (form='single' keeps the model's own routing, "
                                                    "dropless or its own capacity; form='auto' picks its own)"),
    "a2a_chunks": (("ep", "fsep"), "it splits the token all-to-all of form='ep' and form='fsep' into pipelined "
                                   "micro-ops (form='auto' picks its own)"),
    "hierarchical_a2a": (("ep", "locality"), "it splits the token all-to-all of form='ep' and form='locality' "
                                             "into an intra-node and an inter-node stage"),
    "micro_op_bytes": (FORMS, "the gradient all-reduce micro-op size"),
    "packing": (("ep",), "it hosts k times the experts per device under form='ep' (form='auto' picks its own)"),
    "slots_per_device": (("fsep", "auto"), "it sizes the expert slots of FSEP"),
    "planner": (("fsep", "auto"), "it places the expert slots of FSEP"),
    "keep_restored": (("fsep", "auto"), "it keeps FSEP's restored experts for the backward"),
    "prefetch_depth": (("fsep", "auto"), "it prefetches FSEP's expert restores"),
    "defer_expert_grads": (("fsep", "auto"), "it makes FSEP wait for its expert-gradient exchange in each "
                                             "layer's backward"),
    "heads": (("hp", "auto"), "it shapes the Multi-Head LatentMoE of form='hp'"),
    "head_dim": (("hp", "auto"), "it shapes the Multi-Head LatentMoE of form='hp'"),
    "head_ep_size": (("hp",), "it puts expert parallel inside the head groups of form='hp'"),
    "gate": (("locality",), "gate, mu and alpha configure the routing of form='locality'"),
    "mu": (("locality",), "gate, mu and alpha configure the routing of form='locality'"),
    "alpha": (("locality",), "gate, mu and alpha configure the routing of form='locality'"),
    "lowering": (FORMS, "the kernels the lower pass uses"),
    "deterministic": (FORMS, "determinism of the compiled model's forward and backward"),
    "grad_sync": (FORMS, "the gradient synchronisation over the ranks"),
    "expert_recompute": (FORMS, "the expert FFN's backward"),
    "blocks": (FORMS, "per-block overrides"),
    "batch": (("ep", "fsep", "auto"), "it gives the cost model the tokens per rank: form='auto', and "
                                      "a2a_chunks='auto' / packing='auto' under form='ep' and 'fsep'"),
    "hardware": (("ep", "fsep", "auto"), "the cost model prices with it: form='auto', and a2a_chunks='auto' / "
                                         "packing='auto' / FSEP's planner under form='ep' and 'fsep'"),
    "strict": (FORMS, "refuses blocks compile would leave as they are"),
    "routing_skew": (("auto",), "the cost model of form='auto' prices with it"),
}


@dataclass(frozen=True, init=False)
class Plan:
    form: str = "single"
    ep_size: int | None = None  # None: the world size
    # moepass.Topology (the runtime layer defines it: it reads the environment and the process group, above this
    # plain-data layer, so it is checked by its attributes here); None: from the torchrun environment
    topology: Any = None
    capacity_factor: float | None = None  # None: dropless, or the model's own capacity semantics
    a2a_chunks: int | str = "auto"
    # EP / locality: the token exchange as a two-stage (intra-node, then inter-node) all-to-all, each row
    # crossing the slow links once in n-1 aggregated messages per rank; needs an EP group of >= 2 whole nodes
    # of >= 2 ranks (moepass.runtime.collectives, "Hierarchical (2D) all-to-all")
    hierarchical_a2a: bool = False
    micro_op_bytes: int = DEFAULT_MICRO_OP_BYTES
    packing: int | str = 1
    slots_per_device: int | None = None  # FSEP: expert slots per device (C); None: ceil(E/P) + 1
    planner: str | Planner = "auto"  # FSEP placement: "auto" (load-adaptive), "static" (even), or planner(counts_PE, table)
    # FSEP: keep each layer's C restored experts from its forward to its backward (+C*S elements per layer
    # alive until its backward) instead of restoring them again in the backward (one restore fewer per step)
    keep_restored: bool = False
    prefetch_depth: int = DEFAULT_PREFETCH_DEPTH  # FSEP: later blocks whose restore a block issues behind its expert compute; 0: none
    # FSEP: leave each layer's expert-gradient exchange in flight under the earlier layer's backward (its send and
    # receive buffers, 2*C*S elements, alive one layer longer); False: wait for it in the layer's own backward
    defer_expert_grads: bool = True
    # HP: latent heads H of the converted Multi-Head LatentMoE; None: the smallest multiple of the head-group count
    # (the block's ranks / head_ep_size) that is >= 4 (moepass.rewrite.latent.latent_shape)
    heads: int | None = None
    head_dim: int | None = None  # HP: width h of a head; None: hidden // heads
    # HP with EP inside: the ep_size ranks of a block (its model-parallel group) form ep_size/head_ep_size head
    # groups (heads sharded over them) of head_ep_size ranks (a group's experts sharded over them); 1: pure HP
    head_ep_size: int = 1
    # locality routing (form="locality", LocMoE): the top-1 router's gate ("grap": the fixed mean of each of E
    # contiguous blocks of D/E channels; "learned": the block's own router weight), the locality-loss weight
    # mu (required with that form; 0: no locality loss) and the balance-loss weight alpha (moepass.aux_loss)
    gate: str = "learned"
    mu: float | None = None
    alpha: float = DEFAULT_ALPHA
    lowering: str = "auto"
    deterministic: bool = False
    # gradient synchronisation over the ranks: "none" (yours: DDP / FSDP2 for the dense gradients; replicated
    # experts summed by a blocking gradient hook) or "scheduler" (compile installs the priority scheduler,
    # runtime.grad_sync.GradientSync: dense gradients averaged and expert-replica gradients summed as micro-ops of
    # <= micro_op_bytes, launched only while no all-to-all is queued or running; do not also wrap it in DDP)
    grad_sync: str = "none"
    expert_recompute: bool = False  # expert backward recomputes gate/up GEMMs instead of keeping 2*N*F activations
    # {module path or glob: dict of overrides | None (leave the block alone)}; __init__ makes None an empty dict
    blocks: dict[str, dict[str, Any] | None] = None  # type: ignore[assignment]
    batch: tuple[int, int] | None = None  # (batch, seq) for form="auto"
    # figures the compile-time decisions price with (a2a_chunks/packing="auto", form="auto"): None is
    # the documented default (the calibration profile ~/.cache/moepass/profile.json if present, else
    # CPU defaults); a preset name (cost_model.presets.PRESET_NAMES, e.g. "h100"), a calibration
    # profile path (.json) or a cost_model.presets.Hardware
    hardware: str | os.PathLike[str] | Hardware | None = None
    # every MoE-like block detection saw must be rewritten: True makes compile raise PlanError naming each block
    # it would leave as it is (rejected by detection) and why; False leaves them, with a UserWarning under a
    # distributed form (they train replicated on every rank)
    strict: bool = False
    # form="auto": the routing the cost model prices with: max/mean routed rows per rank under EP (a number >= 1),
    # or recorded routed rows [steps, ranks, E] or [ranks, E] (stored as nested tuples; the last step is priced,
    # the steps before it are FSEP's planner history); None: uniform routing
    routing_skew: Any = None

    def __init__(self, **kwargs: Any) -> None:
        names = [f.name for f in fields(self)]
        for key in kwargs:
            if key not in names:
                raise PlanError(f"Plan got an unknown field {key!r}: valid fields are {names}.{nearest(key, names)}")
        for f in fields(self):
            object.__setattr__(self, f.name, kwargs.get(f.name, f.default))
        object.__setattr__(self, "blocks", dict(self.blocks or {}))
        self._validate()

    def __hash__(self) -> int:
        return hash(tuple((f.name, repr(getattr(self, f.name))) for f in fields(self)))

    def _validate(self) -> None:
        _choice("form", self.form, FORMS)
        _choice("lowering", self.lowering, LOWERINGS)
        _choice("grad_sync", self.grad_sync, GRAD_SYNCS)
        if self.ep_size is not None and (not isinstance(self.ep_size, int) or self.ep_size < 1):
            raise PlanError(f"Plan.ep_size={self.ep_size!r} is invalid: use a positive int dividing the world size.")
        if self.capacity_factor is not None and (
            not isinstance(self.capacity_factor, (int, float)) or self.capacity_factor <= 0
        ):
            raise PlanError(
                f"Plan.capacity_factor={self.capacity_factor!r} is invalid: use a float > 0, "
                f"or None for dropless routing."
            )
        _count_or_auto("a2a_chunks", self.a2a_chunks)
        _count_or_auto("packing", self.packing)
        if isinstance(self.prefetch_depth, bool) or not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0:
            raise PlanError(f"Plan.prefetch_depth={self.prefetch_depth!r} is invalid: use an int >= 0 (0: each FSEP "
                            f"block restores its own experts; n: a block issues the next n blocks' restores).")
        if not isinstance(self.micro_op_bytes, int) or self.micro_op_bytes < 1:
            raise PlanError(f"Plan.micro_op_bytes={self.micro_op_bytes!r} is invalid: use a positive byte count.")
        if self.slots_per_device is not None and (
            not isinstance(self.slots_per_device, int) or self.slots_per_device < 1
        ):
            raise PlanError(f"Plan.slots_per_device={self.slots_per_device!r} is invalid: use an int >= 1.")
        if not isinstance(self.deterministic, bool):
            raise PlanError(f"Plan.deterministic={self.deterministic!r} is invalid: use True or False.")
        if not (self.planner in ("auto", "static") or callable(self.planner)):
            raise PlanError(f"Plan.planner={self.planner!r} is invalid: use 'auto' (load-adaptive re-layout), "
                            f"'static' (the even placement, never changed) or a callable "
                            f"planner(counts_PE, current_table) -> table.{nearest(self.planner, ['auto', 'static'])}")
        for name in ("heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise PlanError(f"Plan.{name}={value!r} is invalid: use a positive int, or None for the default.")
        if isinstance(self.head_ep_size, bool) or not isinstance(self.head_ep_size, int) or self.head_ep_size < 1:
            raise PlanError(f"Plan.head_ep_size={self.head_ep_size!r} is invalid: use a positive int dividing ep_size "
                            f"(1: pure head parallel).")
        if self.head_ep_size != 1 and self.ep_size is not None and self.ep_size % self.head_ep_size:
            raise PlanError(f"Plan.head_ep_size={self.head_ep_size} is invalid with Plan.ep_size={self.ep_size}: the "
                            f"ep_size ranks of a block must split into head groups of head_ep_size ranks; use a "
                            f"head_ep_size dividing {self.ep_size}.")
        for name in ("expert_recompute", "keep_restored", "defer_expert_grads", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"Plan.{name}={getattr(self, name)!r} is invalid: use True or False.")
        _routing_skew(self)
        _locality(self)
        _hierarchical(self)
        _hardware(self.hardware)
        _inert_fields(self)
        for pattern, override in self.blocks.items():
            if override is None:
                continue
            if not isinstance(override, dict):
                raise PlanError(
                    f"Plan.blocks[{pattern!r}]={override!r} is invalid: use a dict of Plan fields, "
                    f"or None to leave the block alone."
                )
            for name in PLAN_WIDE:
                if override.get(name, getattr(self, name)) != getattr(self, name):
                    raise PlanError(f"Plan.blocks[{pattern!r}][{name!r}]={override[name]!r} is invalid: {name} applies "
                                    f"to the whole model (determinism covers the whole model's run, gradient synchronisation "
                                    f"model-wide, strictness covers every block compile may leave); set "
                                    f"Plan({name}=...) on the whole plan, not per block.")
            try:
                self._block_plan(override)  # validates the override
            except PlanError as err:
                raise PlanError(f"Plan.blocks[{pattern!r}]: {err}") from None

    def _as_dict(self, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in exclude}

    def replace(self, **changes: Any) -> Plan:
        return Plan(**{**self._as_dict(), **changes})

    def as_form(self, form: str, **changes: Any) -> Plan:
        """This plan under another form (form="auto"'s choice): `changes` applied, then every field that does not
        act under `form` (`ACTS_UNDER`) put back at its default: it was set for the forms the search weighed."""
        values = {**self._as_dict(), **changes, "form": form}
        return Plan(**_acting(values, form))

    def _block_plan(self, override: dict[str, Any]) -> Plan:
        """A block's plan: the whole plan's fields that act under the block's form, then the override (whose own
        fields must act under that form: validated as any Plan)."""
        form = override.get("form", self.form)
        return Plan(**{**_acting(self._as_dict(exclude=("blocks",)), form), **override})

    @property
    def changes_math(self) -> bool:
        return self.form in MATH_CHANGING_FORMS

    def for_block(self, path: str) -> Plan | None:
        """The plan for one block after `blocks` overrides; None when the block is to be left alone.

        An exact path wins over globs; among globs the longest pattern wins.
        """
        matches = [p for p in self.blocks if p == path or fnmatch.fnmatchcase(path, p)]
        if not matches:
            return self
        best = max(matches, key=lambda p: (p == path, len(p)))
        override = self.blocks[best]
        if override is None:
            return None
        return self._block_plan(override)


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise PlanError(f"Plan.{name}={value!r} is invalid: use one of {list(choices)}.{nearest(value, choices)}")


def _locality(plan: Plan) -> None:
    """gate / mu / alpha: valid values; mu required with form="locality" (elsewhere they do nothing: `ACTS_UNDER`)."""
    _choice("gate", plan.gate, GATES)
    for name, what in (("mu", "locality loss mu*KL(D_current || D_local)"), ("alpha", "balance loss")):
        value = getattr(plan, name)
        if value is None and name == "mu":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise PlanError(f"Plan.{name}={value!r} is invalid: use a finite float >= 0, the weight of the {what} "
                            f"(0 turns it off).")
    if plan.form == "locality":
        if plan.mu is None:
            raise PlanError("Plan(form='locality') needs mu=<float >= 0>, the weight of the locality loss "
                            "mu*KL(D_current || D_local); mu=0 gives the plain top-1 router with the balance loss "
                            "only (a switch router).")


def _hierarchical(plan: Plan) -> None:
    """hierarchical_a2a: a bool; True only where it changes something (refused, never a silent no-op): the
    token exchange of form ep / locality (`ACTS_UNDER`), on a topology of >= 2 nodes of >= 2 ranks, not chunked. Whether
    the EP group spans >= 2 whole nodes is checked at compile (`moepass.runtime.topology.node_groups`)."""
    value = plan.hierarchical_a2a
    if not isinstance(value, bool):
        raise PlanError(f"Plan.hierarchical_a2a={value!r} is invalid: use True or False.")
    if not value or plan.form not in ACTS_UNDER["hierarchical_a2a"][0]:  # the latter: refused by `_inert_fields`
        return
    topology = plan.topology
    if topology is not None and (topology.nodes < 2 or topology.ranks_per_node < 2):
        raise PlanError(f"Plan.hierarchical_a2a=True is invalid with Plan.topology=Topology(nodes={topology.nodes}, "
                        f"ranks_per_node={topology.ranks_per_node}): it needs >= 2 nodes of >= 2 ranks (with one node every link is "
                        f"intra-node, with one rank per node the intra-node stage is empty: the exchange would be the "
                        f"flat one). Leave it False.")
    if isinstance(plan.a2a_chunks, int) and plan.a2a_chunks > 1:
        raise PlanError(f"Plan.a2a_chunks={plan.a2a_chunks} with hierarchical_a2a=True is not built: the schedule "
                        f"pass chunks the flat exchange only. Use a2a_chunks=1 or 'auto' (which then picks 1), or "
                        f"hierarchical_a2a=False.")


def _forms_used(plan: Plan) -> list[str]:
    """The plan's form, then the other forms its Plan.blocks overrides name."""
    forms = [plan.form]
    for override in plan.blocks.values():
        if isinstance(override, dict) and override.get("form", plan.form) not in forms:
            forms.append(override.get("form", plan.form))
    return forms


def _inert_fields(plan: Plan) -> None:
    """Every field set away from its default must act under a form the plan uses (`ACTS_UNDER`); else PlanError
    naming the field, the value, the form and what the field does."""
    forms = _forms_used(plan)
    for f in fields(plan):
        value = getattr(plan, f.name)
        acts, does = ACTS_UNDER[f.name]
        if value == f.default or any(form in acts for form in forms):
            continue
        named = [form for form in acts if form != "auto"] or list(acts)
        use = f"form={named[0]!r}" if len(named) == 1 else "one of those forms"
        others = f" (nor with the forms Plan.blocks names: {', '.join(map(repr, forms[1:]))})" if forms[1:] else ""
        raise PlanError(f"Plan.{f.name}={value!r} has no effect with form={plan.form!r}{others}: {does}. Use {use}, "
                        f"or leave it {f.default!r}.")


def _acting(values: dict[str, Any], form: str) -> dict[str, Any]:
    """`values` (Plan fields by name) with every field that does not act under `form` left out (its default)."""
    return {name: value for name, value in values.items() if form in ACTS_UNDER[name][0]}


def _hardware(value: object) -> None:
    if value is None or isinstance(value, Hardware):
        return
    if is_profile_path(value):
        if not os.path.isfile(value):  # type: ignore[arg-type]
            raise PlanError(f"Plan.hardware={value!r} is invalid: no calibration profile at that path; run "
                            f"`python -m moepass calibrate --out {value}`, or use a preset {list(PRESET_NAMES)}.")
        return
    if not isinstance(value, str) or value not in PRESET_NAMES:
        raise PlanError(f"Plan.hardware={value!r} is invalid: use a preset name {list(PRESET_NAMES)}, a calibration "
                        f"profile path (.json), a cost_model.presets.Hardware, or None for this machine's profile "
                        f"(~/.cache/moepass/profile.json, else CPU defaults).{nearest(value, PRESET_NAMES)}")


def _routing_skew(plan: Plan) -> None:
    """Plan.routing_skew: a number >= 1, or routed rows [steps, ranks, E] / [ranks, E] (kept as nested tuples)."""
    value = plan.routing_skew
    if value is None:
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 1:
            raise PlanError(f"Plan.routing_skew={value!r} is invalid: a max/mean of routed rows per rank is >= 1 "
                            f"(1: uniform routing), or give recorded routed rows [steps, ranks, E].")
        return
    import numpy as np

    try:
        rows = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        rows = np.zeros(0)
    if rows.ndim not in (2, 3) or rows.size == 0 or (rows < 0).any() or not np.isfinite(rows).all():
        raise PlanError(f"Plan.routing_skew of type {type(value).__name__} is invalid: give a max/mean >= 1, or "
                        f"recorded routed rows [steps, ranks, E] or [ranks, E] (non-negative counts).")
    object.__setattr__(plan, "routing_skew", tuple(map(tuple, rows.tolist())) if rows.ndim == 2
                       else tuple(tuple(map(tuple, step)) for step in rows.tolist()))


def _count_or_auto(name: str, value: object) -> None:
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"Plan.{name}={value!r} is invalid: use an int >= 1 or 'auto'.{nearest(value, ['auto'])}")
