"""`moepass.detect(model)`: find the MoE blocks of a model and describe each with a verified MoESpec.

    structural candidates ─► captured graph (selection, router) ─► recognisers (MoESpec hypotheses)
        ─► semantic check ─► accepted | rejected

Detection only reads the model. A block is accepted when one hypothesis of one recogniser
reproduces it on probe inputs; otherwise it is reported with the reason and left untouched. It never raises
on a model: whatever fails on a block (its forward, a recogniser) is that block's reason; what cannot be read
at all (the module tree, the dense-FFN search) is a note of the report. A block on the meta device is read on
a copy given seeded random values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from moepass.detect import fused_experts, gshard, loop_experts, self_described
from moepass.detect.candidates import (
    SELF_DESCRIBED,
    Candidate,
    ModuleTree,
    capture_candidate,
    find_candidates,
    find_dense_mlps,
)
from moepass.detect.check import CheckResult, holds_meta, materialise, semantic_check
from moepass.detect.structure import structural_key
from moepass.module_copy import deepcopy_module, gc_paused
from moepass.spec import MoESpec

Recogniser = Callable[[Candidate], "list[MoESpec] | str"]

# Tried in order; a recogniser declines by returning the reason as a string.
RECOGNISERS: list[tuple[str, Recogniser]] = [
    (gshard.NAME, gshard.recognise),
    (loop_experts.NAME, loop_experts.recognise),
    (fused_experts.NAME, fused_experts.recognise),
]


# A block with a `moepass_spec(path)` method describes itself: its spec is the one hypothesis, checked
# like any other; the structural recognisers are not tried on it.
SELF_DESCRIBED_RECOGNISERS: list[tuple[str, Recogniser]] = [(self_described.NAME, self_described.recognise)]


def register_recogniser(name: str, fn: Recogniser, first: bool = True) -> None:
    """Add a recogniser (e.g. for a model family); `first` gives it priority over the generic ones."""
    RECOGNISERS.insert(0 if first else len(RECOGNISERS), (name, fn))


from moepass.detect import hf  # noqa: E402  (router modules returning logits, transformers 5.x style: first)

for _name, _fn in reversed(hf.RECOGNISERS):
    register_recogniser(_name, _fn)


@dataclass
class BlockReport:
    """What detection concluded about one candidate block."""

    path: str
    module_type: str
    accepted: bool
    recogniser: str | None = None
    spec: MoESpec | None = None
    check: CheckResult | None = None
    reason: str = ""
    tried: list[CheckResult] = field(default_factory=list)
    same_as: str | None = None  # the block whose verdict this one reuses (identical structure: not re-checked)


@dataclass
class DetectionReport:
    details: list[BlockReport] = field(default_factory=list)
    dense: list[str] = field(default_factory=list)  # FFN-shaped modules that are not MoE
    notes: list[str] = field(default_factory=list)  # what detection could not read (it never raises)

    @property
    def blocks(self) -> list[MoESpec]:
        return [d.spec for d in self.details if d.accepted and d.spec is not None]

    @property
    def rejected(self) -> list[tuple[str, str]]:
        return [(d.path, d.reason) for d in self.details if not d.accepted]

    def __len__(self) -> int:
        return len(self.blocks)

    def summary(self) -> str:
        lines = [f"{len(self.blocks)} MoE block(s) accepted, {len(self.rejected)} rejected"]
        for d in self.details:
            same = f" (structure identical to {d.same_as or '<root>'}: its check)" if d.same_as is not None else ""
            if d.accepted and d.spec is not None and d.check is not None:
                lines.append(f"  {d.path or '<root>'}: {d.recogniser}: {d.spec.summary()}; check "
                             f"{d.check.describe()}{same}")
            else:
                lines.append(f"  {d.path or '<root>'} ({d.module_type}): REJECTED: {d.reason}{same}")
        for path in self.dense:
            lines.append(f"  {path}: dense FFN, not MoE")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def detect_block(candidate: Candidate) -> BlockReport:
    """The verdict on one candidate. Never raises: whatever fails while reading the block (a recogniser, its
    probe, the block's own code) becomes the reason it is rejected, with the exception's type."""
    try:
        return _detect_block(candidate)
    except Exception as err:
        return BlockReport(candidate.path, type(candidate.module).__name__, accepted=False,
                           reason=f"detection failed on this block: {type(err).__name__}: {err}")


def _detect_block(candidate: Candidate) -> BlockReport:
    report = BlockReport(candidate.path, type(candidate.module).__name__, accepted=False)
    if holds_meta(candidate.module):  # no values to probe: a materialised copy (seeded random values) is read
        candidate.module = materialise(deepcopy_module(candidate.module), torch.Generator().manual_seed(0))
    reasons = []
    recognisers = SELF_DESCRIBED_RECOGNISERS if candidate.experts_kind == SELF_DESCRIBED else RECOGNISERS
    if candidate.experts_kind != SELF_DESCRIBED:
        why_not = capture_candidate(candidate)
        if why_not is not None:
            report.reason = why_not
            return report
    for name, recognise in recognisers:
        try:
            found = recognise(candidate)
        except Exception as err:  # a recogniser that fails on this block rejects it: it never raises
            reasons.append(f"{name}: the recogniser raised {type(err).__name__}: {err}")
            continue
        if isinstance(found, str):
            reasons.append(f"{name}: {found}")
            continue
        try:
            winner, tried = semantic_check(candidate.module, found)
        except Exception as err:  # the user's block itself fails on probe inputs: reject, never raise
            reasons.append(f"{name}: probing the block failed: {type(err).__name__}: {err}")
            continue
        report.tried.extend(tried)
        if winner is not None:
            report.accepted, report.recogniser, report.spec, report.check = True, name, winner.spec, winner
            return report
        best = min(tried, key=lambda r: (r.mismatched_tokens, r.max_error)) if tried else None
        reasons.append(f"{name}: no hypothesis reproduces the block"
                       + (f" (closest: {best.spec.router.score_func} router, {best.reason})" if best else ""))
    report.reason = "; ".join(reasons) or "no recogniser applies"
    facts = candidate.router
    if facts is not None and facts.why_not_traced and facts.selection_outputs is None:
        reads = f"Its selection scores also read {list(facts.unknown_tensors)}, which no known rule reads; " \
            if facts.unknown_tensors else ""
        report.reason += (f". {reads}its router code cannot run as traced ({facts.why_not_traced}): move the "
                          f"routing into a submodule that returns (weights, experts) and the rewritten block calls "
                          f"it as it is")
    return report


def detect(model: nn.Module) -> DetectionReport:
    """Detect the MoE blocks of `model` (read-only). A block structurally identical to one already checked
    (`moepass.detect.structure`) gets that block's verdict, its spec re-rooted at its own path.

    The cyclic garbage collector is paused meanwhile (`module_copy.gc_paused`): the walks of the module tree
    and the probe copies allocate enough to trigger collections, and a full one walks every object alive (a
    quarter of a second on 32 layers x 64 experts, every few calls); what detection computes does not
    depend on it."""
    with gc_paused():
        return _detect(model)


def _detect(model: nn.Module) -> DetectionReport:
    report = DetectionReport()
    try:
        tree = ModuleTree(model)  # one walk of the module tree for candidates and dense FFNs
        candidates = find_candidates(model, tree)
    except Exception as err:  # detection never raises: the report says what could not be read
        report.notes.append(f"the module tree could not be read for candidates: {type(err).__name__}: {err}")
        return report
    checked: dict[object, BlockReport] = {}
    for candidate in candidates:
        try:
            key = structural_key(candidate.module)
        except Exception:  # no key: the block is checked on its own
            key = None
        first = checked.get(key) if key is not None else None
        if first is None:
            report.details.append(detect_block(candidate))
            if key is not None:
                checked[key] = report.details[-1]
            continue
        report.details.append(BlockReport(candidate.path, first.module_type, first.accepted, first.recogniser,
                                          first.spec.replace(path=candidate.path) if first.spec is not None else None,
                                          first.check, first.reason, same_as=first.path))
    try:
        report.dense = find_dense_mlps(model, [d.path for d in report.details], tree)
    except Exception as err:
        report.notes.append(f"the dense-FFN search failed: {type(err).__name__}: {err}")
    return report
