"""Plan: what moepass should do to a model. Frozen and validated at construction.

A Plan is its form, the options of that form (`Plan.options`: `EPOptions` for form="ep", ... one frozen, typed,
validated dataclass per form in `moepass.plan_options`) and the fields that act under every form (`PLAN_FIELDS`:
lowering, determinism, gradient sync, ...). The short way is the flat spelling: `Plan(form="ep", a2a_chunks=4)`
puts a2a_chunks into the plan's `EPOptions`, and `plan.a2a_chunks` reads it back (the default under a form that has
no such field); `Plan(options=EPOptions(a2a_chunks=4))` is the same plan. A field set away from its default under a
form without it raises `PlanError` naming the field, the value, the form and the forms that have it (`ACTS_UNDER`,
derived from the option classes; docs/USER_GUIDE.md, section 4); an unknown key or an impossible value raises
naming the field, the value and the fix.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Generic, Literal, TypeAlias, TypeVar, cast, overload

from cost_model.presets import MICRO_OP_BYTES
from moepass.errors import PlanError, nearest
from moepass.plan_options import (
    CHECKS,
    DEFAULT_ALPHA,
    DEFAULT_PREFETCH_DEPTH,
    DOES,
    FORM_OPTIONS,
    FORMS,
    GATES,
    OPTION_DEFAULTS,
    AutoOptions,
    Count,
    EPOptions,
    Form,
    FormOptions,
    FSEPOptions,
    Gate,
    HardwareChoice,
    HPOptions,
    LocalityOptions,
    Options,
    Planner,
    PlannerChoice,
    RoutingSkew,
    SingleOptions,
    TopologyLike,
    check_bool,
    choice,
    forms_with,
    is_int,
)

__all__ = [  # the option classes and constants are re-exported: `from moepass.plan import EPOptions`
    "ACTS_UNDER", "DEFAULT_ALPHA", "DEFAULT_MICRO_OP_BYTES", "DEFAULT_PREFETCH_DEPTH", "DISTRIBUTED_FORMS",
    "FLAT_FIELDS", "FORMS", "GATES", "GRAD_SYNCS", "LOWERINGS", "MATH_CHANGING_FORMS", "PLAN_FIELDS", "PLAN_WIDE",
    "AutoOptions", "EPOptions", "FSEPOptions", "FormOptions", "HPOptions", "LocalityOptions", "Plan", "Planner",
    "SingleOptions", "TopologyLike",
]

MATH_CHANGING_FORMS = ("hp", "locality")
DISTRIBUTED_FORMS = ("ep", "fsep", "hp", "locality")  # need torch.distributed initialised
Lowering: TypeAlias = Literal["auto", "triton", "torch"]
LOWERINGS: tuple[Lowering, ...] = ("auto", "triton", "torch")
GradSync: TypeAlias = Literal["none", "scheduler"]
GRAD_SYNCS: tuple[GradSync, ...] = ("none", "scheduler")
PLAN_WIDE = ("deterministic", "grad_sync", "strict")  # process- or model-wide: not overridable per block
DEFAULT_MICRO_OP_BYTES = MICRO_OP_BYTES  # one figure for the runtime and the cost model's priority pricing

# The fields that act under every form, with what they do; the form's own options are in `FORM_OPTIONS`.
PLAN_FIELDS: dict[str, str] = {
    "micro_op_bytes": "the gradient all-reduce micro-op size",
    "lowering": "the kernels the lower pass uses",
    "deterministic": "determinism of the compiled model's forward and backward",
    "grad_sync": "the gradient synchronisation over the ranks",
    "expert_recompute": "the expert FFN's backward",
    "blocks": "per-block overrides",
    "strict": "refuses blocks compile would leave as they are",
}
# Every name of the flat spelling, in the order the design table lists them.
FLAT_FIELDS = ("form", "ep_size", "topology", "capacity_factor", "a2a_chunks", "hierarchical_a2a", "micro_op_bytes",
               "packing", "slots_per_device", "planner", "keep_restored", "prefetch_depth", "defer_expert_grads",
               "heads", "head_dim", "head_ep_size", "gate", "mu", "alpha", "lowering", "deterministic", "grad_sync",
               "expert_recompute", "blocks", "batch", "hardware", "strict", "routing_skew",
               "keep_original_if_slower")

# Which forms each field acts under, and what it does there: the one rule for "a field that does nothing", read
# off the option classes. A field set away from its default under a form not listed raises PlanError naming the
# field, the value and the form; under Plan.blocks a field the whole plan sets acts in the blocks whose form it
# acts under and is at its default in the others (`Plan.for_block`). "auto" lists the fields the cost model reads
# or the form it picks keeps (the FSEP fields when FSEP wins); the fields the search chooses itself (ep_size,
# capacity_factor, a2a_chunks, packing) are not in `AutoOptions`: form="auto" would overwrite them.
ACTS_UNDER: dict[str, tuple[tuple[str, ...], str]] = {
    "form": (FORMS, "the parallel form"),
    **{name: (FORMS, does) for name, does in PLAN_FIELDS.items()},
    **{name: (forms_with(name), does) for name, does in DOES.items()},
}

T = TypeVar("T")


class _Option(Generic[T]):
    """`plan.<name>` for a form option: the plan's form's value; else (a field the plan's form has not) the value
    the whole plan gives the blocks of another form (`Plan.block_options`); else its default."""

    name: str

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, plan: None, owner: type | None = None) -> _Option[T]: ...

    @overload
    def __get__(self, plan: Plan, owner: type | None = None) -> T: ...

    def __get__(self, plan: Plan | None, owner: type | None = None) -> T | _Option[T]:
        if plan is None:
            return self
        for group in (plan.options, *plan.block_options):
            if self.name in group.names():
                return cast(T, getattr(group, self.name))
        return cast(T, OPTION_DEFAULTS[self.name])


@dataclass(frozen=True, init=False, repr=False)
class Plan:
    form: Form = "single"
    options: FormOptions = SingleOptions()  # the options of `form` (`FORM_OPTIONS[form]`)
    # the options the whole plan gives the blocks whose Plan.blocks override names another form, one per such form
    block_options: tuple[FormOptions, ...] = ()
    micro_op_bytes: int = DEFAULT_MICRO_OP_BYTES
    lowering: Lowering = "auto"
    deterministic: bool = False
    # gradient synchronisation over the ranks: "none" (yours: DDP / FSDP2 for the dense gradients; replicated
    # experts summed by a blocking gradient hook) or "scheduler" (compile installs the priority scheduler,
    # runtime.grad_sync.GradientSync: dense gradients averaged and expert-replica gradients summed as micro-ops of
    # <= micro_op_bytes, launched only while no all-to-all is queued or running; do not also wrap it in DDP)
    grad_sync: GradSync = "none"
    expert_recompute: bool = False  # expert backward recomputes gate/up GEMMs instead of keeping 2*N*F activations
    # {module path or glob: dict of flat fields | None (leave the block alone)}; __init__ makes None an empty dict
    blocks: dict[str, dict[str, object] | None] = None  # type: ignore[assignment]
    # every MoE-like block detection saw must be rewritten: True makes compile raise PlanError naming each block
    # it would leave as it is (rejected by detection) and why; False leaves them, with a UserWarning under a
    # distributed form (they train replicated on every rank)
    strict: bool = False

    # The form options in the flat spelling (typed reads; `moepass.plan_options` documents each).
    ep_size = _Option[int | None]()
    topology = _Option[TopologyLike | None]()
    capacity_factor = _Option[float | None]()
    a2a_chunks = _Option[Count]()
    hierarchical_a2a = _Option[bool]()
    packing = _Option[Count]()
    slots_per_device = _Option[int | None]()
    planner = _Option[PlannerChoice]()
    keep_restored = _Option[bool]()
    prefetch_depth = _Option[int]()
    defer_expert_grads = _Option[bool]()
    keep_original_if_slower = _Option[bool]()
    heads = _Option[int | None]()
    head_dim = _Option[int | None]()
    head_ep_size = _Option[int]()
    gate = _Option[Gate]()
    mu = _Option[float | None]()
    alpha = _Option[float]()
    batch = _Option[tuple[int, int] | None]()
    hardware = _Option[HardwareChoice]()
    routing_skew = _Option[RoutingSkew]()

    def __init__(self, **kwargs: object) -> None:
        valid = [*FLAT_FIELDS, "options"]
        for key in kwargs:
            if key not in valid:
                raise PlanError(f"Plan got an unknown field {key!r}: valid fields are {valid}.{nearest(key, valid)}")
        given = kwargs.get("options")
        form = kwargs.get("form", given.form if isinstance(given, Options) else "single")
        choice("form", form, FORMS)
        form = cast(Form, form)
        values = {name: CHECKS[name](value) for name, value in kwargs.items() if name in CHECKS}
        object.__setattr__(self, "form", form)
        for name in PLAN_FIELDS:
            object.__setattr__(self, name, kwargs.get(name, _PLAN_DEFAULTS[name]))
        object.__setattr__(self, "blocks", dict(self.blocks or {}))
        self._validate_plan_fields()
        forms = _forms_used(form, self.blocks)
        _refuse_foreign(values, form, forms)
        own = FORM_OPTIONS[form]
        if given is not None and type(given) is not own:
            raise PlanError(f"Plan.options={given!r} is invalid with form={form!r}: it holds the options of "
                            f"form={getattr(given, 'form', None)!r}; use {own.__name__}(...), or leave form out.")
        base = {name: getattr(given, name) for name in own.names()} if given is not None else {}
        object.__setattr__(self, "options", _options(form, {**base, **values}))
        object.__setattr__(self, "block_options", tuple(_options(f, values) for f in forms[1:] if f in FORM_OPTIONS))
        if form == "locality" and self.mu is None:
            raise PlanError("Plan(form='locality') needs mu=<float >= 0>, the weight of the locality loss "
                            "mu*KL(D_current || D_local); mu=0 gives the plain top-1 router with the balance loss "
                            "only (a switch router).")
        self._validate_blocks()

    def __hash__(self) -> int:
        return hash(tuple((name, repr(value)) for name, value in self._as_dict().items()))

    def __repr__(self) -> str:
        """The flat spelling of the fields away from their defaults: `Plan(form='ep', a2a_chunks=4)`."""
        shown = [f"form={self.form!r}"] + [f"{name}={value!r}" for name, value in self._as_dict().items()
                                           if name != "form" and value != _DEFAULTS[name]]
        return f"Plan({', '.join(shown)})"

    def _validate_plan_fields(self) -> None:
        choice("lowering", self.lowering, LOWERINGS)
        choice("grad_sync", self.grad_sync, GRAD_SYNCS)
        if not is_int(self.micro_op_bytes, 1):
            raise PlanError(f"Plan.micro_op_bytes={self.micro_op_bytes!r} is invalid: use a positive byte count.")
        for name in ("deterministic", "expert_recompute", "strict"):
            check_bool(name)(getattr(self, name))

    def _validate_blocks(self) -> None:
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

    def _as_dict(self, exclude: tuple[str, ...] = ()) -> dict[str, object]:
        """The plan in the flat spelling: every name of `FLAT_FIELDS`."""
        return {name: getattr(self, name) for name in FLAT_FIELDS if name not in exclude}

    def replace(self, **changes: object) -> Plan:
        return Plan(**{**self._as_dict(), **changes})

    def as_form(self, form: str, **changes: object) -> Plan:
        """This plan under another form (form="auto"'s choice): `changes` applied, then every field that does not
        act under `form` (`ACTS_UNDER`) put back at its default: it was set for the forms the search weighed."""
        values = {**self._as_dict(), **changes, "form": form}
        return Plan(**_acting(values, form))

    def _block_plan(self, override: dict[str, object]) -> Plan:
        """A block's plan: the whole plan's fields that act under the block's form, then the override (whose own
        fields must act under that form: validated as any Plan)."""
        form = override.get("form", self.form)
        assert isinstance(form, str)
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


_PLAN_DEFAULTS: dict[str, object] = {f.name: f.default for f in fields(Plan) if f.name in PLAN_FIELDS}
_PLAN_DEFAULTS["blocks"] = {}
_DEFAULTS: dict[str, object] = {"form": "single", **_PLAN_DEFAULTS, **OPTION_DEFAULTS}


def _options(form: str, values: dict[str, object]) -> FormOptions:
    """The options of `form` from `values` (flat names; those the form has not are left out), validated."""
    make: Callable[..., FormOptions] = FORM_OPTIONS[form]
    names = FORM_OPTIONS[form].names()
    return make(**{name: value for name, value in values.items() if name in names})


def _forms_used(form: str, blocks: dict[str, dict[str, object] | None]) -> list[str]:
    """The plan's form, then the other forms its Plan.blocks overrides name."""
    forms = [form]
    for override in blocks.values():
        if isinstance(override, dict):
            other = override.get("form", form)
            if isinstance(other, str) and other not in forms:
                forms.append(other)
    return forms


def _refuse_foreign(values: dict[str, object], form: str, forms: list[str]) -> None:
    """Every option set away from its default must be an option of a form the plan uses; else PlanError naming
    the field, the value, the form and the forms that have it (what the field does there)."""
    for name, value in values.items():
        acts, does = ACTS_UNDER[name]
        if value == OPTION_DEFAULTS[name] or any(f in acts for f in forms):
            continue
        named = [f for f in acts if f != "auto"] or list(acts)
        use = f"form={named[0]!r}" if len(named) == 1 else "one of those forms"
        others = f" (nor with the forms Plan.blocks names: {', '.join(map(repr, forms[1:]))})" if forms[1:] else ""
        raise PlanError(f"Plan.{name}={value!r} has no effect with form={form!r}{others}: {does}. Use {use}, "
                        f"or leave it {OPTION_DEFAULTS[name]!r}.")


def _acting(values: dict[str, object], form: str) -> dict[str, object]:
    """`values` (Plan fields by name) with every field that does not act under `form` left out (its default)."""
    return {name: value for name, value in values.items() if form in ACTS_UNDER[name][0]}


