"""The semantic check: a spec is accepted only if its canonical graph reproduces the block.

On a probe copy of the block (fp32, eval mode), random inputs go through the original block and
through the spec's canonical graph. The probe is built so that near-miss specs show:

- zero-initialised floating parameters and buffers are randomised, so a forgotten bias (e.g. a
  selection-only bias) changes the selection;
- a `routed_scaling_factor` of 1 is set to PROBE_SCALING on the probe (and in the probed spec), so
  a scale applied in the wrong place shows; the accepted spec keeps the model's real value;
- for group-limited hypotheses, probes are added (at growing input scales) until at least
  MIN_GROUP_TOKENS tokens select differently with groups than with plain top-k;
- tokens whose k-th and (k+1)-th scores are a near-tie (in the final top-k, or in a group top-k)
  are not compared, and probes are added until MIN_CLEAR_FRACTION of the tokens are clear;
- after the random probes, CROWDS crowded ones: every token one of a few random tokens (all the same, then
  two of them 2:1), so that experts receive every token: a block that drops tokens over a capacity shows
  it there (random probes rarely fill one), and with CROWD_SHAPE's 21 tokens in 3 sequences a capacity's
  rounding, group and priority show too.

Then the selected experts must agree exactly on the clear tokens (the original's selection is
observed by intercepting its last top-k / argmax over E scores, or the first K indices of a descending
sort / argsort over them; a selection by lookup of token ids runs in the user's router module, which
the graph calls as it is: its recorded output is compared instead), the outputs (every element of a
tuple output) within tolerance, and the contract beyond the output: the router module's recorded
output (specs that call it: `logits_from="module"`), the train-mode output under the same RNG
seed (jitter reproduced in the same order; a dropout that the graph lacks fails here) and the buffers
a train-mode forward updates (e.g. an aux-loss-free selection bias), from the same starting values.

With heads (Multi-Head LatentMoE) the selection compared is per sub-token: the block's top-k over
each head's E scores, as one call over [..., H, E] scores (token-major, head-minor rows).

The user's block is never touched: everything runs on the copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx, nn

from moepass import canonical
from moepass.detect.spies import Capture, Selection, TopkSpy
from moepass.dialect import route_ref
from moepass.module_copy import deepcopy_module
from moepass.spec import MoESpec

MIN_CLEAR_FRACTION = 0.75  # share of probed tokens that must be free of near-ties
MIN_GROUP_TOKENS = 4  # group-limited hypotheses: tokens where groups must change the choice
MAX_EXTRA_PROBES = 8
PROBE_SCALING = 2.5  # routed_scaling_factor set on the probe when the model's is 1
SCALING_ATTRS = ("routed_scaling_factor",)
TRAIN_SEED = 1234
CROWDS = (1, 2)  # the crowded probes: how many distinct tokens each is made of
CROWD_SHAPE = (3, 7)  # their hidden states' leading dims (the recorded ones when the block takes further inputs)
Inputs = tuple[torch.Tensor, ...]  # one probe: the hidden states, then the block's further inputs (token ids)


def clones(x: Inputs) -> Inputs:
    return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in x)


def token_ids(block: nn.Module, shape: torch.Size | tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Probe token ids for a block input beyond the hidden states (a router keyed by token ids): int64 in
    [0, V), V the smallest leading size of the block's integer buffers (the lookup tables it may index with
    them), or 2 without one."""
    sizes = [t.shape[0] for t in block.buffers() if not t.is_floating_point() and t.dim() and t.shape[0] > 0]
    return torch.randint(0, min(sizes, default=2), tuple(shape), generator=gen)


@dataclass
class CheckResult:
    spec: MoESpec
    accepted: bool
    max_error: float = float("nan")
    mismatched_tokens: int = 0
    compared_tokens: int = 0
    reason: str = ""
    selection_observed: bool = True
    group_sensitive_tokens: int = 0  # tokens whose choice differs with and without group limits
    contract_checked: bool = False  # recorded router output and train mode compared too
    only_crowded: bool = False  # rejected, but reproduced the block on every probe except the crowded ones

    def describe(self) -> str:
        verdict = "accepted" if self.accepted else f"rejected: {self.reason}"
        extra = f", {self.group_sensitive_tokens} group-limited" if self.group_sensitive_tokens else ""
        extra += ", train mode + recorded router output compared" if self.contract_checked else ""
        return f"{verdict} (max error {self.max_error:.2e}, {self.compared_tokens} tokens compared{extra})"


def probe_copy(block: nn.Module, seed: int = 0, spec: MoESpec | None = None) -> nn.Module:
    """An fp32, eval-mode copy on the CPU (the probes' inputs are CPU tensors, wherever the model lives) whose
    all-zero floating parameters and buffers are randomised.

    With `spec`, the per-expert weights its canonical graph stacks are copied straight into one buffer
    per role (`canonical.stacked_copies`; laid out again if `.float()` re-allocated them), so
    `canonical.stack_experts` reads them as one view on every run of the graph instead of stacking
    them afresh; their values are the ones a plain copy has. A block on the meta device is copied as it is,
    then given seeded random values (`materialise`)."""
    memo: dict[int, Any] = {}
    meta = holds_meta(block)
    if spec is not None and not meta:
        canonical.stacked_copies(block, spec, memo)
    probe = deepcopy_module(block, memo)
    gen = torch.Generator().manual_seed(seed)
    if meta:
        materialise(probe, gen)
    probe = probe.to(device="cpu", dtype=torch.float32).eval()  # probes run on CPU, wherever the model lives
    if spec is not None:
        canonical.relayout_stacked(probe, spec)
    with torch.no_grad():
        for tensor in list(probe.parameters()) + list(probe.buffers()):
            if tensor.is_floating_point() and tensor.numel() and _all_zero(tensor):
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.1)
    return probe


def holds_meta(module: nn.Module) -> bool:
    """Whether a parameter or buffer of `module` is on the meta device (shapes only, no values)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialise(module: nn.Module, gen: torch.Generator) -> nn.Module:
    """Give every meta-device parameter and buffer of `module` (in place: a probe copy, never the user's
    model) a real CPU tensor of its shape and dtype, with seeded random values: floating ones N(0, 1/n) (n
    the last dim: a linear layer's fan-in), integer ones in [0, 2), booleans False. Tied tensors stay tied
    (one new tensor per original); `requires_grad` is kept. Returns `module`."""
    new: dict[int, torch.Tensor] = {}

    def real(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in new:
            if t.is_floating_point() or t.is_complex():
                value = torch.randn(t.shape, generator=gen) / max(t.shape[-1] if t.dim() else 1, 1) ** 0.5
                value = value.to(t.dtype)
            elif t.dtype == torch.bool:
                value = torch.zeros(t.shape, dtype=torch.bool)
            else:
                value = torch.randint(0, 2, t.shape, generator=gen).to(t.dtype)
            new[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value
        return new[id(t)]

    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None and t.is_meta:
                    table[name] = real(t)  # type: ignore[assignment]  # a Parameter stays a Parameter
    return module


def nonfinite_tensors(module: nn.Module) -> list[str]:
    """Names of `module`'s floating parameters and buffers holding NaN or inf (plain tensors with values only:
    a subclass, e.g. a DTensor, would make reading it a collective). What a block built with `torch.empty`
    parameters and never initialised shows; called only for a rejected block, to say why."""
    return [name for name, t in (*module.named_parameters(), *module.named_buffers())
            if type(t) in (torch.Tensor, nn.Parameter) and t.is_floating_point() and not t.is_meta and t.numel()
            and not bool(torch.isfinite(t).all())]


def _all_zero(tensor: torch.Tensor) -> bool:
    """`not tensor.any()`, without reading the whole tensor when its first element is not zero (a plain
    tensor's: a subclass, e.g. a DTensor, is asked as a whole)."""
    if type(tensor) in (torch.Tensor, nn.Parameter) and bool(tensor[(0,) * tensor.dim()]):
        return False
    return not bool(tensor.any())


def _outputs(value):
    return value if isinstance(value, tuple) else (value,)


def _group_sensitive(spec: MoESpec, logits_TE: torch.Tensor, bias_E: torch.Tensor | None) -> int:
    """Tokens whose selected experts differ between group-limited and plain top-k."""
    r = spec.router
    args = (r.score_func, r.softmax_before_topk, r.top_k, r.renormalize)
    grouped = route_ref(logits_TE, bias_E, *args, r.n_group, r.topk_group, r.group_score, 1.0)[1]
    plain = route_ref(logits_TE, bias_E, *args, 1, 1, r.group_score, 1.0)[1]
    return int((grouped.sort(-1).values != plain.sort(-1).values).any(-1).sum())


def build_graph(spec: MoESpec, probe: nn.Module) -> fx.GraphModule | str:
    """`spec`'s canonical graph on the probe (it shares the probe's modules: train()/eval() reaches both), or
    why it does not build: a hypothesis that does not even build is just a wrong hypothesis."""
    try:
        return canonical.build(spec, probe)
    except Exception as err:
        return f"canonical graph does not build: {err}"


def check(spec: MoESpec, probe: nn.Module, inputs: list[Inputs], originals: list, selections: list[Selection],
          atol: float = 1e-5, rtol: float = 1e-4, graph: fx.GraphModule | str | None = None,
          crowded_from: int | None = None) -> CheckResult:
    """Compare `spec`'s canonical graph (`graph`: `build_graph`'s result, when built already) with the
    recorded behaviour of the original on `inputs` (from index `crowded_from` on, the crowded probes)."""
    gm = build_graph(spec, probe) if graph is None else graph
    if isinstance(gm, str):
        return CheckResult(spec, False, float("inf"), reason=gm)
    result = CheckResult(spec, True, max_error=0.0)
    other_k = None  # the block's top-k over E used another k
    failed = [False, False]  # on a random probe, on a crowded one
    for i, (x, original, seen) in enumerate(zip(inputs, originals, selections)):
        crowded = crowded_from is not None and i >= crowded_from
        accepted_before, result.accepted = result.accepted, True
        logits_name, experts_name, bias_name = canonical.routing_names(spec)
        cap = Capture(gm, (experts_name, logits_name, bias_name))
        try:
            with torch.no_grad():
                ours = cap.run(*x)
        except Exception as err:
            return CheckResult(spec, False, float("inf"), reason=f"canonical graph fails on a probe input: {err}")
        if spec.router.n_group > 1 and logits_name in cap.values:
            result.group_sensitive_tokens += _group_sensitive(spec, cap.values[logits_name].float(),
                                                              cap.values.get(bias_name))
        as_is = spec.router.logits_from == "selection"
        # the graph calls the block's router module itself: its selection is the module's, read as it is (ids the
        # block dispatches by, whatever top-k the module ran on the way, e.g. mapped through a placement table);
        # when they are not that top-k's, the outputs decide
        mine = cap.values[experts_name].sort(dim=-1).values if experts_name in cap.values else None
        theirs = seen.indices.sort(dim=-1).values if seen.indices is not None else None
        if as_is and (seen.other_k is not None or mine is None or theirs is None or mine.shape != theirs.shape
                      or bool(((mine != theirs).any(dim=-1) & seen.clear).any())):
            result.selection_observed = False
        elif seen.other_k is not None:
            result.accepted = False
            result.selection_observed = False
            other_k = seen.other_k
        elif seen.clear is not None and mine is not None and theirs is not None:
            if mine.shape != theirs.shape:
                return CheckResult(spec, False, float("inf"), reason=f"selects {mine.shape[-1]} experts per token ({mine.shape[0]} "
                                                       f"tokens), block selects {theirs.shape[-1]} ({theirs.shape[0]})")
            mismatched = int(((mine != theirs).any(dim=-1) & seen.clear).sum())
            result.compared_tokens += int(seen.clear.sum())
            if mismatched:
                result.accepted = False
                result.mismatched_tokens += mismatched
        else:
            result.selection_observed = False
        if len(_outputs(ours)) != len(original):
            return CheckResult(spec, False, float("inf"), reason=f"returns {len(_outputs(ours))} value(s) (hidden states + side "
                                                   f"outputs {list(spec.side_outputs)}), block returns {len(original)}")
        for a, b in zip(_outputs(ours), _outputs(original)):
            if a is None or b is None:  # a slot the block leaves empty (e.g. a bias a framework adds elsewhere)
                if a is not b:
                    return CheckResult(spec, False, float("inf"), reason="returns None where the block returns a "
                                                                         "value (or the reverse)")
                continue
            if a.shape != b.shape:
                return CheckResult(spec, False, float("inf"), reason=f"output shape {tuple(a.shape)} != block's {tuple(b.shape)}")
            gap = (a - b).abs().max().item() if a.numel() else 0.0
            result.max_error = max(result.max_error, gap)
            if not torch.allclose(a, b, atol=atol, rtol=rtol):
                result.accepted = False
        failed[crowded] |= not result.accepted
        result.accepted = accepted_before and result.accepted
    result.only_crowded = failed[1] and not failed[0]
    if not result.accepted:
        parts = []
        if other_k is not None:
            parts.append(f"selects {spec.top_k} experts per token, block selects {other_k} "
                         f"(its top-k over E={spec.router.num_experts} scores)")
        if result.mismatched_tokens:
            parts.append(f"{result.mismatched_tokens}/{result.compared_tokens} tokens select different experts")
        parts.append(f"outputs differ by up to {result.max_error:.2e}")
        result.reason = "; ".join(parts)
    return result


def returns_autocast_dtype(probe: nn.Module, graph: fx.GraphModule | str, x: Inputs) -> bool:
    """Whether, under torch.autocast (bf16 on the CPU), the block returns its hidden states in bf16 where the
    spec's graph returns fp32 (its combine sums in fp32): the graph must then cast (`MoESpec.autocast_output`)."""
    if isinstance(graph, str):
        return False
    buffers = dict(probe.named_buffers())  # the graph module holds the same buffer objects
    start = {name: t.clone() for name, t in buffers.items()}
    try:  # the block's state and the global RNG as they were: later hypotheses are probed from the same state
        with torch.random.fork_rng(devices=[]), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            theirs = _outputs(probe(*clones(x)))[0]
            _restore(buffers, start)
            ours = _outputs(graph(*clones(x)))[0]
    except Exception:  # a block that does not run under autocast: nothing to match
        return False
    finally:
        _restore(buffers, start)
    return isinstance(theirs, torch.Tensor) and isinstance(ours, torch.Tensor) and \
        theirs.dtype == torch.bfloat16 and ours.dtype == torch.float32


def contract_check(spec: MoESpec, probe: nn.Module, x: Inputs, atol: float = 1e-5,
                   rtol: float = 1e-4, graph: fx.GraphModule | str | None = None) -> str | None:
    """Beyond the eval output: the router module's recorded output and the train-mode output under the
    same seed (`graph`: `build_graph`'s result, when built already). Returns the reason of a mismatch, or None."""
    gm = build_graph(spec, probe) if graph is None else graph
    if isinstance(gm, str):
        return gm
    r = spec.router
    try:  # "": the weight is the block's own parameter, no router module
        router: nn.Module | None = probe.get_submodule(r.module_path) if r.module_path else None
    except AttributeError:
        router = None
    # A router *module* (not a bare nn.Linear gate, whose weight generic specs read directly) is what
    # frameworks record router logits from (transformers: OutputRecorder hooks on its class), so the
    # graph must call it exactly as often, with the same output.
    if router is not None and (r.logits_from == "module" or not isinstance(router, nn.Linear)):
        records: list[list[object]] = [[], []]

        def record(i: int):
            def hook(_m, _a, out):
                if r.logits_from == "module" and r.module_output_index is not None:
                    out = out[r.module_output_index]
                records[i].append(out)
            return hook

        for i, run in enumerate((probe, gm)):
            handle = router.register_forward_hook(record(i))
            try:
                with torch.no_grad():
                    run(*clones(x))
            finally:
                handle.remove()
        if len(records[0]) != len(records[1]):
            return (f"router module {r.module_path} is called {len(records[1])}x by the graph, "
                    f"{len(records[0])}x by the block: recorded router logits would change")
        for a, b in zip(*records):
            a, b = _outputs(a), _outputs(b)
            if len(a) != len(b) or any(not isinstance(u, torch.Tensor) or u.shape != v.shape
                                       or not torch.allclose(u.float(), v.float(), atol=atol, rtol=rtol)
                                       for u, v in zip(a, b)):
                return (f"router module {r.module_path} returns other values (or shapes) in the graph than "
                        f"in the block: recorded router logits would change")
    was_training = probe.training
    buffers = dict(probe.named_buffers())  # the graph module holds the same buffer objects
    start = {name: t.clone() for name, t in buffers.items()}
    updated: list[dict[str, torch.Tensor]] = []
    try:
        probe.train()
        gm.train()
        outs = []
        for run in (probe, gm):
            _restore(buffers, start)  # both runs start from the same state
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(TRAIN_SEED)
                outs.append(_outputs(run(*clones(x))))
            updated.append({name: t.clone() for name, t in buffers.items()})
    except Exception as err:
        return f"train mode fails: {type(err).__name__}: {err}"
    finally:
        probe.train(was_training)
        _restore(buffers, start)  # later hypotheses are probed from the same state
    for a, b in zip(outs[1], outs[0]):
        if a is None and b is None:
            continue
        if a is None or b is None or a.shape != b.shape or not torch.allclose(a, b, atol=atol, rtol=rtol):
            gap = (a - b).abs().max().item() if a.shape == b.shape else float("nan")
            return (f"train-mode outputs differ by up to {gap:.2e} under the same seed: the block draws "
                    f"random numbers (jitter, dropout) that the spec does not reproduce in the same order")
    for name, theirs in updated[0].items():
        ours = updated[1][name]
        if ours.shape != theirs.shape or not torch.allclose(ours.float(), theirs.float(), atol=atol, rtol=rtol):
            moved = "updates it" if not torch.equal(theirs, start[name]) else "leaves it unchanged"
            return (f"buffer {name!r} after a train-mode forward differs: the block {moved}, the spec's graph "
                    f"does not do the same (e.g. a selection-bias update rule or rate the spec lacks)")
    return None


def _restore(buffers: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, t in buffers.items():
            t.copy_(values[name])


def _scaling_overrides(probe: nn.Module) -> bool:
    """Set every routed scaling factor of 1 on the probe to PROBE_SCALING; True if any was set."""
    changed = False
    for module in probe.modules():
        for name in SCALING_ATTRS:
            value = getattr(module, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1:
                setattr(module, name, PROBE_SCALING)
                changed = True
    return changed


def _observe(probe: nn.Module, x: Inputs, num_experts: int, top_k: int) -> tuple[tuple, Selection]:
    spy = TopkSpy(num_experts, top_k)
    with torch.no_grad(), spy:
        out = _outputs(probe(*clones(x)))
    return out, spy.seen


def _group_coverage(spec: MoESpec, probe: nn.Module, inputs: list[Inputs]) -> int:
    """Group-sensitive tokens of the group-limited hypothesis `spec` on `inputs` (0 if it fails)."""
    try:
        gm = canonical.build(spec, probe)
        total = 0
        for x in inputs:
            logits_name, _, bias_name = canonical.routing_names(spec)
            cap = Capture(gm, (logits_name, bias_name))
            with torch.no_grad():
                cap.run(*x)
            total += _group_sensitive(spec, cap.values[logits_name].float(), cap.values.get(bias_name))
        return total
    except Exception:
        return 0


def tolerance(spec: MoESpec) -> dict[str, float]:
    """How closely the spec's graph must reproduce the block: fp32's rounding, or where the experts compute in a
    lower precision (`ExpertsSpec.compute_dtype`), that dtype's (the same casts, GEMMs that may sum in another
    order: a few units in its last place)."""
    if spec.experts.compute_dtype is None:
        return {"atol": 1e-5, "rtol": 1e-4}
    eps = torch.finfo(getattr(torch, spec.experts.compute_dtype)).eps
    return {"atol": eps, "rtol": 2 * eps}


def semantic_check(block: nn.Module, hypotheses: list[MoESpec], probes: int = 3, tokens: int = 24,
                   seed: int = 0, first_only: bool = True, passthrough: dict[str, Any] | None = None,
                   shape: tuple[int, ...] = ()) -> tuple[CheckResult | None, list[CheckResult]]:
    """The first hypothesis that reproduces `block`, and every result tried (for the report).

    With `first_only=False` every hypothesis is checked (on the same probe inputs). `passthrough`: values of
    block inputs the MoE computation does not read (`MoESpec.unused_inputs`), given to every probe as
    recorded; `shape`: the hidden states' shape they go with (the recorded call's)."""
    passthrough = passthrough or {}
    if not hypotheses:
        return None, []
    probe = probe_copy(block, seed, spec=hypotheses[0])
    scaled = _scaling_overrides(probe)
    # E: the experts one selection chooses among (per head with heads); D: the block's input width
    E, K, D = hypotheses[0].router.num_experts, hypotheses[0].top_k, hypotheses[0].model_dim
    gen = torch.Generator().manual_seed(seed + 1)

    def draw(scale: float = 1.0, crowd: int = 0) -> Inputs:  # the hidden states, then the further inputs (token ids)
        lead = shape[:-1] or (CROWD_SHAPE if crowd else (2, tokens // 2))
        if crowd:  # `crowd` distinct tokens, the first one 2/3 of the time
            T = math.prod(lead)
            which = (torch.randperm(T, generator=gen) < T // 3).long() if crowd > 1 else torch.zeros(T, dtype=torch.long)
            x = torch.randn(crowd, D, generator=gen)[which].reshape(*lead, D) * scale
        else:
            x = torch.randn(*lead, D, generator=gen) * scale
        return (x, *[passthrough[name] if name in passthrough else token_ids(probe, x.shape[:-1], gen)
                     for name in hypotheses[0].input_names[1:]])

    def probed(spec: MoESpec) -> MoESpec:  # the spec as it must behave on the probe (scale 1 -> PROBE_SCALING)
        if scaled:
            factor = spec.router.routed_scaling_factor * PROBE_SCALING
            return spec.replace(router=replace(spec.router, routed_scaling_factor=factor))
        return spec

    inputs = [draw() for _ in range(probes)]
    grouped = next((probed(h) for h in hypotheses if h.router.n_group > 1 and h.router.topk_group < h.router.n_group),
                   None)
    scale = 1.0
    while grouped is not None and len(inputs) < probes + MAX_EXTRA_PROBES \
            and _group_coverage(grouped, probe, inputs) < MIN_GROUP_TOKENS:
        scale *= 2.0  # larger logits spread the scores beyond the (randomised) selection bias
        inputs.append(draw(scale))
    observed = [_observe(probe, x, E, K) for x in inputs]
    extra = 0
    while extra < MAX_EXTRA_PROBES:  # re-probe near-ties
        masks = [s.clear for _, s in observed if s.clear is not None]
        if len(masks) < len(observed) or sum(int(m.sum()) for m in masks) >= \
                MIN_CLEAR_FRACTION * sum(m.numel() for m in masks):
            break
        inputs.append(draw())
        observed.append(_observe(probe, inputs[-1], E, K))
        extra += 1
    crowded_from = len(inputs)
    for crowd in CROWDS:  # tokens crowding onto the same experts; a near-tie in one of them: drawn again
        for _ in range(MAX_EXTRA_PROBES):
            x = draw(crowd=crowd)
            seen = _observe(probe, x, E, K)
            if seen[1].clear is None or bool(seen[1].clear.all()):
                inputs.append(x)
                observed.append(seen)
                break
    originals = [o for o, _ in observed]
    selections = {K: [s for _, s in observed]}
    tried = []
    winner = None
    for spec in hypotheses:
        if spec.top_k not in selections:  # the spy watched for another k: observe again
            selections[spec.top_k] = [_observe(probe, x, spec.router.num_experts, spec.top_k)[1] for x in inputs]
        canonical.relayout_stacked(probe, spec)  # a no-op when its experts are laid out so already
        graph = build_graph(probed(spec), probe)  # one graph for both checks (eval runs leave it as built)
        result = check(probed(spec), probe, inputs, originals, selections[spec.top_k], graph=graph,
                       crowded_from=crowded_from, **tolerance(spec))
        if result.accepted:
            reason = contract_check(probed(spec), probe, inputs[0], graph=graph, **tolerance(spec))
            result.contract_checked = reason is None
            if reason is not None:
                result.accepted, result.reason = False, reason
        if result.accepted and returns_autocast_dtype(probe, graph, inputs[0]):
            spec = spec.replace(autocast_output=True)
        result.spec = spec  # the model's own values, not the probe's
        tried.append(result)
        if result.accepted and winner is None:
            winner = result
            if first_only:
                break
    return winner, tried


def check_specs(block: nn.Module, specs: list[MoESpec], **kw) -> list[CheckResult]:
    """Every spec checked against `block` on the same probe inputs (tests of near-miss specs)."""
    return semantic_check(block, specs, first_only=False, **kw)[1]
