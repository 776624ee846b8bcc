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

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from moepass.detect import capacity, fused_experts, gshard, hf, loop_experts, outline, self_described
from moepass.detect.candidates import (
    GRAPH,
    SELF_DESCRIBED,
    Candidate,
    ModuleTree,
    capture_candidate,
    find_candidates,
    find_dense_mlps,
)
from moepass.detect.check import CheckResult, holds_meta, materialise, nonfinite_tensors, semantic_check
from moepass.detect.graph_candidates import GraphBlock, graph_blocks, record_model, synthesize_inputs
from moepass.detect.structure import structural_key
from moepass.errors import PlanError
from moepass.module_copy import deepcopy_module, gc_paused
from moepass.spec import LOAD_OUTPUT, ROUTER_OUTPUT, MoESpec, TensorSource

Recogniser = Callable[[Candidate], "list[MoESpec] | str"]

# Tried in order; a recogniser declines by returning the reason as a string. The recogniser registry, built here
# in one statement: the router modules returning logits (transformers 5.x style) first, then the generic ones;
# `register_recogniser` is its one writer (a user's own recogniser).
RECOGNISERS: list[tuple[str, Recogniser]] = [
    *hf.RECOGNISERS,
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
    # rejected by design: it selects among E experts but is no MoE FFN block (its experts are not functions of one
    # token: a mixture of attention experts); the reason says what it is. Left as it is, like any rejected block
    left_alone: bool = False


@dataclass
class DetectionReport:
    details: list[BlockReport] = field(default_factory=list)
    dense: list[str] = field(default_factory=list)  # FFN-shaped modules that are not MoE
    recording: str = ""  # on what input the model's forward was recorded (`recorded_blocks`), or why it was not
    # block path -> how it was outlined from its host's forward (`moepass.detect.outline`): compile registers it
    outlines: dict[str, outline.Outline] = field(default_factory=dict)
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
                host = self.outlines.get(d.path)
                where = f" (outlined from {host.host or '<root>'}'s forward)" if host is not None else ""
                lines.append(f"  {d.path or '<root>'}{where}: {d.recogniser}: {d.spec.summary()}; check "
                             f"{d.check.describe()}{same}")
            else:
                verdict = "LEFT ALONE" if d.left_alone else "REJECTED"
                lines.append(f"  {d.path or '<root>'} ({d.module_type}): {verdict}: {d.reason}{same}")
        for path in self.dense:
            lines.append(f"  {path}: dense FFN, not MoE")
        lines += [f"  note: {note}" for note in self.notes]
        if self.recording:
            lines.append(f"  ({self.recording})")
        return "\n".join(lines)


DETECTION_FAILED = "detection failed on this block"  # the reason's start when reading the block raised


def detect_block(candidate: Candidate) -> BlockReport:
    """The verdict on one candidate. Never raises: whatever fails while reading the block (a recogniser, its
    probe, the block's own code) becomes the reason it is rejected, with the exception's type."""
    try:
        return _detect_block(candidate)
    except Exception as err:
        return BlockReport(candidate.path, type(candidate.module).__name__, accepted=False,
                           reason=f"{DETECTION_FAILED}: {type(err).__name__}: {err}")


def _detect_block(candidate: Candidate) -> BlockReport:
    report = BlockReport(candidate.path, type(candidate.module).__name__, accepted=False)
    if holds_meta(candidate.module):  # no values to probe: a materialised copy (seeded random values) is read
        candidate.module = materialise(deepcopy_module(candidate.module), torch.Generator().manual_seed(0))
    reasons = []
    recognisers = SELF_DESCRIBED_RECOGNISERS if candidate.experts_kind == SELF_DESCRIBED else RECOGNISERS
    if candidate.experts_kind != SELF_DESCRIBED:
        why_not = capture_candidate(candidate)
        if why_not is not None:
            report.reason, report.left_alone = why_not, candidate.left_alone
            return report
    if candidate.experts_kind == GRAPH:
        report.reason = undescribed(candidate)
        return report
    observed = observed_fields(candidate)
    lowered = low_precision_weights(candidate)
    for name, recognise in recognisers:
        try:
            found = recognise(candidate)
        except Exception as err:  # a recogniser that fails on this block rejects it: it never raises
            reasons.append(f"{name}: the recogniser raised {type(err).__name__}: {err}")
            continue
        if isinstance(found, str):
            reasons.append(f"{name}: {found}")
            continue
        found = [spec for spec in (_observed(spec, observed) for spec in found) if spec is not None]
        if candidate.output_bias is not None:  # a bias on the combined output: tried with it first, then without
            bias = TensorSource.param(candidate.output_bias)
            found = [replace(spec, output_bias=bias) for spec in found] + found
        if candidate.input_weighted:  # the weights multiply the experts' input (seen in the graph)
            found = [replace(spec, weights_on="input") for spec in found
                     if spec.heads is None and spec.experts.routed_experts == spec.experts.num_experts]
        if candidate.output_module is not None:  # a module called last on the output: tried with it first
            found = [replace(spec, output_module=candidate.output_module) for spec in found] + found
        if candidate.input_module is not None:  # a module the experts' input goes through: tried with it first
            found = [replace(spec, input_module=candidate.input_module) for spec in found] + found
        found = [in_cast_dtype(spec, lowered) for spec in found]
        try:
            winner, tried = semantic_check(candidate.module, found, passthrough=candidate.passthrough,
                                           shape=candidate.probe_shape)
        except Exception as err:  # the user's block itself fails on probe inputs: reject, never raise
            reasons.append(f"{name}: probing the block failed: {type(err).__name__}: {err}")
            continue
        capacities = capacity.hypotheses(candidate.module, tried) if winner is None else []
        if capacities:  # it reproduced the block until tokens crowded: a capacity, read from its attributes
            try:
                winner, more = semantic_check(candidate.module, capacities, passthrough=candidate.passthrough,
                                              shape=candidate.probe_shape)
                tried += more
            except Exception as err:
                reasons.append(f"{name}: probing the block failed: {type(err).__name__}: {err}")
        report.tried.extend(tried)
        if winner is not None:
            report.accepted, report.recogniser, report.spec, report.check = True, name, winner.spec, winner
            return report
        best = min(tried, key=lambda r: (r.mismatched_tokens, r.max_error)) if tried else None
        reasons.append(f"{name}: no hypothesis reproduces the block"
                       + (f" (closest: {best.spec.router.score_func} router, {best.reason})" if best else ""))
        if any(r.only_crowded for r in tried):
            reasons[-1] += (": it is reproduced until many tokens choose the same experts, as a block that drops "
                            "tokens over an expert capacity behaves; no float attribute of the block "
                            f"({capacity.factors(candidate.module) or 'none'}) gives that capacity "
                            "(ceil or floor of factor x tokens x k / E, per batch or per sequence)")
    report.reason = "; ".join(reasons) or "no recogniser applies"
    broken = nonfinite_tensors(candidate.module)
    if broken:  # the likeliest cause first: no hypothesis reproduces NaN
        names = ", ".join(map(repr, broken[:4])) + (" ..." if len(broken) > 4 else "")
        report.reason = (f"its {names} {'holds' if len(broken) == 1 else 'hold'} NaN or inf values (uninitialised "
                         f"memory, e.g. torch.empty parameters never initialised?): initialise or load the weights "
                         f"before detect/compile. The checks: {report.reason}")
    if lowered:  # the likeliest cause: casts to a lower precision no hypothesis reproduces
        dtype, cast = next(iter(lowered.items()))
        tried_so = any(r.spec.experts.compute_dtype == dtype for r in report.tried)
        report.reason = (f"it casts {', '.join(cast[:3])}{' ...' if len(cast) > 3 else ''} to {dtype} itself. "
                         + (f"Its experts computing in {dtype} as it does (input and weights cast, the result cast "
                            f"back) do not reproduce it either" if tried_so else
                            f"moepass reproduces experts that cast their input and weights to {dtype} and the "
                            f"result back, not these casts") +
                         f": compute in the input's dtype (drop the casts and train under torch.autocast), or leave "
                         f"the block alone with Plan(blocks={{{candidate.path!r}: None}}). The checks: {report.reason}")
    unknown = [k[1:] for k in candidate.side_outputs if k.startswith("?")]
    if unknown:
        report.reason += (f". It returns {', '.join(unknown)}, which no rule reproduces (moepass reproduces router "
                          f"logits, per-expert loads, the top-k weights and experts, and None): compute it outside the block (from the router's recorded logits, "
                          f"say), or leave the block alone with Plan(blocks={{{candidate.path!r}: None}})")
    facts = candidate.router
    if facts is not None and facts.why_not_traced and facts.selection_outputs is None:
        reads = f"Its selection scores also read {list(facts.unknown_tensors)}, which no known rule reads; " \
            if facts.unknown_tensors else ""
        report.reason += (f". {reads}its router code cannot run as traced ({facts.why_not_traced}): move the "
                          f"routing into a submodule that returns (weights, experts) and the rewritten block calls "
                          f"it as it is")
    return report


LOW_PRECISION = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
CASTS = {torch.Tensor.bfloat16: torch.bfloat16, torch.Tensor.half: torch.float16}


def low_precision_weights(c: Candidate) -> dict[str, list[str]]:
    """dtype name -> the block's parameters its recorded forward casts to that lower precision (bf16 / fp16):
    experts that compute in another dtype than the block's input, which no spec reproduces."""
    found: dict[str, list[str]] = {}
    for node in c.graph.graph.nodes if c.graph is not None else ():
        source = node.args[0] if node.op == "call_function" and node.args else None
        if not isinstance(source, torch.fx.Node) or source.op != "get_attr":
            continue
        dtype: torch.dtype | None
        if node.target in CASTS:  # x.bfloat16(), x.half()
            dtype = CASTS[node.target]
        elif node.target in (torch.Tensor.to, torch.Tensor.type):  # the dtype among its arguments
            dtype = next((a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, torch.dtype)), None)
        else:
            continue
        if dtype in LOW_PRECISION:
            found.setdefault(LOW_PRECISION[dtype], []).append(str(source.target))
    return found


def in_cast_dtype(spec: MoESpec, lowered: dict[str, list[str]]) -> MoESpec:
    """`spec` with its experts computing in the dtype the block casts every expert weight to itself (torchtitan's
    GroupedExperts: `x.bfloat16()`, `w.bfloat16()` around torch._grouped_mm, the result `.type_as(x)`), else as
    it is. Only the casts decide; the semantic check then says whether the block computes so."""
    paths = {path for source in spec.experts.sources().values() for path in source.paths}
    for dtype, cast in lowered.items():
        if spec.experts.kind == "ffn" and paths and paths <= set(cast):
            return replace(spec, experts=replace(spec.experts, compute_dtype=dtype))
    return spec


def detect_outlined(candidate: Candidate, outlines: dict[str, outline.Outline]) -> BlockReport:
    """`detect_block`; when it rejects a block the model's recorded forward found (its call recorded), its MoE
    region outlined from its forward (`moepass.detect.outline`) is tried as a block of its own: accepted, it is
    the verdict (and `outlines` records how to outline it); else the host's reason says why it was not."""
    report = detect_block(candidate)
    if (report.accepted or report.left_alone or candidate.graph_block is None or candidate.call is None
            or report.reason.startswith(DETECTION_FAILED)):  # a block whose reading raised: that error is the verdict
        return report
    try:
        found = outline.outline_candidate(candidate)
    except Exception as err:  # outlining never raises either: the host's own reason stands
        found = f"{type(err).__name__}: {err}"
    if isinstance(found, str):
        report.reason += f". Its MoE region is not outlined: {found}"
        return report
    inner, how = found
    outlined = detect_block(inner)
    if not outlined.accepted:
        report.reason += f". Its MoE region outlined from its forward ({how.path}) is rejected too: {outlined.reason}"
        return report
    outlines[how.path] = how
    return outlined


def _observed(spec: MoESpec, observed: dict[str, Any]) -> MoESpec | None:
    """`spec` with what the capture observed, or None when the two cannot go together (a router that does not
    call the router module cannot return what that module returned: `ROUTER_OUTPUT`)."""
    try:
        return replace(spec, **observed)
    except PlanError:
        return None


def observed_fields(c: Candidate) -> dict[str, Any]:
    """MoESpec fields every hypothesis of a block takes from what its capture showed, whichever recogniser
    made it: its load counter, its inputs as the model passes them, what it returns when moepass reproduces
    all of it beyond router logits (which the recognisers decide)."""
    fields: dict[str, Any] = {}
    if c.load_counter is not None:  # the block counts its experts' load
        fields["load_counter"] = TensorSource.param(c.load_counter)
    if c.flat_output:
        fields["flat_output"] = True
    if c.input_names != ("hidden_states",):
        fields.update(input_names=c.input_names, unused_inputs=tuple(c.passthrough))
    kinds = c.side_outputs
    if any(k in ("none", "topk_weights", "topk_experts") or k.startswith((LOAD_OUTPUT, ROUTER_OUTPUT)) for k in kinds) \
            and not any(k.startswith("?") for k in kinds):
        fields["side_outputs"] = tuple(kinds)
    return fields


def undescribed(c: Candidate) -> str:
    """Why a block only the recorded forward shows is rejected: what it reads, and the ways out."""
    block = c.graph_block
    reads = f" on {block.describe_experts()}" if block is not None else ""
    return (f"a selection over E={c.num_experts} scores drives per-expert work{reads}, but no rule describes these "
            f"experts (moepass reads expert weights stored as [E, ...] tensors, two or three per expert function, or "
            f"as a ModuleList / ModuleDict of expert modules). Ways out: store the weights that way, or give the block "
            f"a `moepass_spec(path)` method returning its MoESpec (moepass.detect.self_described), or leave it alone "
            f"with Plan(blocks={{{c.path!r}: None}})")


def detect(model: nn.Module, example_inputs: Any = None, example_kwargs: dict[str, Any] | None = None
           ) -> DetectionReport:
    """Detect the MoE blocks of `model` (read-only). A block structurally identical to one already checked
    (`moepass.detect.structure`) gets that block's verdict, its spec re-rooted at its own path.

    `example_inputs` (a tensor, a tuple of the model's positional arguments, or a mapping of its keyword
    arguments: a tokenizer's batch, called as `model(**batch)`) and `example_kwargs`: one
    input the model is called with, to record its forward (`graph_candidates`): where selections drive
    experts anchors each block and reports blocks the structure does not show. Without them an input is
    synthesized when the model starts with an embedding or a linear layer (the report says which), else
    only the structure is read.

    The cyclic garbage collector is paused meanwhile (`module_copy.gc_paused`): the walks of the module tree
    and the probe copies allocate enough to trigger collections, and a full one walks every object alive (a
    quarter of a second on 32 layers x 64 experts, every few calls); what detection computes does not
    depend on it. So is the caller's autocast: the probes compare in fp32 (and observe autocast themselves)."""
    with gc_paused(), contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        return _detect(model, example_inputs, example_kwargs)


def recorded_blocks(model: nn.Module, example_inputs: Any, example_kwargs: dict[str, Any] | None
                    ) -> tuple[list[GraphBlock], str]:
    """The blocks the model's recorded forward shows, and a line saying on what input it ran (or why not)."""
    if example_inputs is None and not example_kwargs:
        made = synthesize_inputs(model)
        if isinstance(made, str):
            return [], f"forward not recorded: {made}"
        args, how = made
        note = f"forward recorded on a synthesized input ({how}; pass example_inputs for the model's own)"
    else:
        if isinstance(example_inputs, Mapping):  # a batch as a tokenizer / data collator gives it: model(**batch)
            args, example_kwargs = (), {**example_inputs, **(example_kwargs or {})}
        else:
            args = example_inputs if isinstance(example_inputs, tuple) else () if example_inputs is None \
                else (example_inputs,)
        note = "forward recorded on the example input"
    cap = record_model(model, args, example_kwargs)
    if isinstance(cap, str):
        return [], f"forward not recorded: {cap} (blocks found from the module structure only)"
    return graph_blocks(cap, model), note


def _detect(model: nn.Module, example_inputs: Any = None, example_kwargs: dict[str, Any] | None = None
            ) -> DetectionReport:
    report = DetectionReport()
    try:
        blocks, report.recording = recorded_blocks(model, example_inputs, example_kwargs)
    except Exception as err:  # detection never raises: the structure alone is read
        blocks, report.recording = [], f"forward not recorded: {type(err).__name__}: {err}"
    try:
        tree = ModuleTree(model)  # one walk of the module tree for candidates and dense FFNs
        candidates = find_candidates(model, tree, blocks)
    except Exception as err:  # detection never raises: the report says what could not be read
        report.notes.append(f"the module tree could not be read for candidates: {type(err).__name__}: {err}")
        return report
    for candidate in candidates:
        if candidate.path in tree.shared:
            report.notes.append(f"{candidate.path or '<root>'} is also the module at "
                                f"{', '.join(sorted(tree.shared[candidate.path]))} (one module, several paths): one "
                                f"verdict; compile rewrites it once and installs it at each")
    checked: dict[object, BlockReport] = {}
    for candidate in candidates:
        try:
            key = structural_key(candidate.module)
        except Exception:  # no key: the block is checked on its own
            key = None
        first = checked.get(key) if key is not None else None
        if first is None:
            report.details.append(detect_outlined(candidate, report.outlines))
            if key is not None:
                checked[key] = report.details[-1]
            continue
        path, host = candidate.path, report.outlines.get(first.path)
        if host is not None:  # the same host: its region outlined the same way
            report.outlines[host.rerooted(path).path] = host.rerooted(path)
            path = host.rerooted(path).path
        report.details.append(BlockReport(path, first.module_type, first.accepted, first.recogniser,
                                          first.spec.replace(path=path) if first.spec is not None else None,
                                          first.check, first.reason, same_as=first.path,
                                          left_alone=first.left_alone))
    try:
        report.dense = find_dense_mlps(model, [d.path for d in report.details], tree)
    except Exception as err:
        report.notes.append(f"the dense-FFN search failed: {type(err).__name__}: {err}")
    return report
