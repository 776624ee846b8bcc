"""The public entry points: `compile` and `explain`."""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import logging
import re
import traceback
import warnings
from typing import Any

import torch.distributed as dist
from torch import nn

from moepass import agreement, determinism
from moepass.canonical import CANONICAL_PASS
from moepass.detect import DetectionReport, detect, outline
from moepass.detect.check import holds_meta
from moepass.errors import PlanError
from moepass.pipeline import compile_block, compile_model, copy_block, keeps_original, refuse_distributed_outlines
from moepass.plan import DISTRIBUTED_FORMS, Plan
from moepass.runtime.topology import Topology

log = logging.getLogger("moepass")


def compile(model: nn.Module, plan: Plan | None = None, *, inplace: bool = False,
            report: DetectionReport | None = None, example_inputs: Any = None) -> nn.Module:
    """Rewrite every accepted MoE block of `model` as `plan` says; returns the model to train.

    The result is the model itself (a deep copy unless `inplace=True`) with each MoE block replaced
    by an `MoEGraphModule` holding the block's own parameters: same class, same parameter names.
    Blocks that detection rejected, or that `plan.blocks` maps to None, are left as they are.
    `example_inputs`: the model's positional arguments for one call (a tensor or a tuple), for detection to
    record the forward on (`moepass.detect`); without them it synthesizes one where it can.
    """
    plan = Plan() if plan is None else plan
    if not isinstance(plan, Plan):
        raise PlanError(f"moepass.compile(plan={plan!r}) is invalid: pass a moepass.Plan(...)")
    report = detect(model, example_inputs) if report is None else report
    unmatched = unmatched_blocks(plan, report)
    if unmatched is not None:  # before anything is copied: a key that leaves nothing alone is a silent no-op
        raise PlanError(unmatched)
    plan, _ = resolve_auto(plan, report, model)
    missed = not_rewritten(plan, report)
    if plan.strict and missed:  # before anything is copied or changed
        raise PlanError(_missed_message(missed, plan) + " Plan(strict=True) refuses to compile the model so: fix the "
                        "block (moepass.explain(model, plan) shows each check), leave it alone explicitly with "
                        f"Plan(blocks={{{missed[0][0]!r}: None}}), or pass strict=False to train it as it is.")
    refuse_distributed_outlines(plan, report)  # before the process-group check: the fix differs
    _needs_process_group(plan, report)
    agreement.check(plan, report, model)  # every rank the same blocks, the same way: an error, never a hang
    if plan.grad_sync == "scheduler" and not (dist.is_initialized() and dist.get_world_size() > 1):
        raise PlanError("Plan.grad_sync='scheduler' has no effect on one process: it synchronises gradients over "
                        "the ranks of an initialised process group of more than one rank. Leave it 'none', or "
                        "compile on every rank under torchrun (init_process_group first).")
    _meta_needs_single(plan, report, model)
    target, info = compile_model(model, plan, report, inplace)
    changed = [(path, stats) for path, gm in info.rewritten.items() for stats in math_changes(gm)]
    if changed:  # asked for by name, but never unsaid: the trained model computes something else
        how: dict[str, list[str]] = {}  # identical conversions (a deep model's layers) said once
        for path, stats in changed:
            how.setdefault(stats["math"] + (f", {stats['latent']}" if "latent" in stats else ""), []).append(path)
        blocks = "; ".join(f"{', '.join(repr(p or '<root>') for p in paths)}: {text}" for text, paths in how.items())
        warnings.warn(f"moepass.compile changed the math of {len(changed)} block(s), as the plan names: {blocks}. "
                      f"Their outputs and gradients are not the original model's; moepass.explain(model, plan) shows "
                      f"each conversion.", UserWarning, stacklevel=2)
    distributed = [(path, reason) for path, reason in missed if _form_of(plan, path) in DISTRIBUTED_FORMS]
    if distributed:  # the block trains replicated on every rank: never silently
        warnings.warn(_missed_message(distributed, plan) + " They train as they are, replicated on every rank. Fix "
                      "them (moepass.explain(model, plan) shows each check), leave them alone explicitly with "
                      "Plan(blocks={path: None}), or pass Plan(strict=True) to make this an error.", UserWarning,
                      stacklevel=2)
    log.info("moepass.compile: form=%s: %d MoE block(s) rewritten, %d rejected by detection (not rewritten), %d left "
             "alone by Plan.blocks", plan.form, len(info.rewritten), len(missed), len(info.skipped))
    return target


def not_rewritten(plan: Plan, report: DetectionReport) -> list[tuple[str, str]]:
    """(path, reason) of every MoE-like block detection saw that `compile(model, plan)` leaves as it is although
    the plan names a form for it: the blocks detection rejected (a block `Plan.blocks` maps to None is left
    alone on purpose: not listed)."""
    return [(path, reason) for path, reason in report.rejected if plan.for_block(path) is not None]


def unmatched_blocks(plan: Plan, report: DetectionReport) -> str | None:
    """Why `plan.blocks` is wrong for this model: a key that matches no block detection saw (accepted or
    rejected), with the nearest real paths; None when every key matches one."""
    paths = [d.path for d in report.details]
    for pattern in plan.blocks:
        if any(p == pattern or fnmatch.fnmatchcase(p, pattern) for p in paths):
            continue
        tail = [p for p in paths if p.endswith("." + pattern) or fnmatch.fnmatchcase(p, "*." + pattern)]
        near = tail[:3] or difflib.get_close_matches(pattern, paths, n=3, cutoff=0.4)
        hint = f" Did you mean {', '.join(map(repr, near))}?" if near else ""
        return (f"Plan.blocks[{pattern!r}] matches no MoE block of this model (it has {len(paths)}: "
                f"{', '.join(map(repr, paths[:4]))}{' ...' if len(paths) > 4 else ''}).{hint} Keys are module paths "
                f"from the model's root or globs over them (e.g. {'*.' + pattern.rsplit('.', 1)[-1]!r}).")
    return None


def _form_of(plan: Plan, path: str) -> str | None:
    block_plan = plan.for_block(path)
    return None if block_plan is None else block_plan.form


def _missed_message(missed: list[tuple[str, str]], plan: Plan) -> str:
    blocks = "; ".join(f"{path or '<root>'!r} (form={_form_of(plan, path)!r}): {reason}" for path, reason in missed)
    return f"moepass.compile left {len(missed)} MoE-like block(s) un-rewritten, rejected by detection: {blocks}."


def _needs_process_group(plan: Plan, report: DetectionReport) -> None:
    """A block planned into a distributed form needs torch.distributed initialised: say so, naming the
    block and its form, before compile touches anything (with inplace=True a later failure would leave
    the model half rewritten)."""
    if dist.is_initialized():
        return
    for spec in report.blocks:
        block_plan = plan.for_block(spec.path)
        if block_plan is not None and block_plan.form in DISTRIBUTED_FORMS:
            raise PlanError(f"Plan(form={block_plan.form!r}) for block {spec.path or '<root>'!r} needs torch.distributed "
                            f"initialised (init_process_group) on every rank: run under torchrun or "
                            f"torch.multiprocessing.spawn, or use form='single' on one process.")


def _meta_needs_single(plan: Plan, report: DetectionReport, model: nn.Module) -> None:
    """A block on the meta device compiles under form="single" only: its rewritten form keeps the block's own
    modules, so `to_empty` + the model's own init reach every tensor. A distributed form replaces the experts
    by tensors of its own (EP's `ep_w_gate`, ...), which that init does not reach: refused, naming the fix."""
    for spec in report.blocks:
        block_plan = plan.for_block(spec.path)
        if block_plan is None or block_plan.form not in DISTRIBUTED_FORMS:
            continue
        if holds_meta(outline.block_in(model, spec.path, report.outlines)):
            raise PlanError(f"Plan(form={block_plan.form!r}) for block {spec.path or '<root>'!r}: the block is on the "
                            f"meta device (no values), and form {block_plan.form!r} replaces its experts by tensors of "
                            f"its own that your model's initialisation does not reach after to_empty. Materialise the "
                            f"model first (model.to_empty(device=...) and its init, or load its weights), then "
                            f"compile; form='single' compiles a meta model (then to_empty + your init).")


def resolve_auto(plan: Plan, report: DetectionReport, model: nn.Module | None = None):
    """`form="auto"`: ask the cost model, priced with `Plan.hardware`; returns (the concrete plan, the
    search result or None). It searches `PlanSpace.of(plan)` priced with `Pricing.of(plan)`
    (`cost_model.search_space`). The gradient all-reduce shares the all-to-all's link as the plan runs it
    (`Plan(grad_sync="scheduler")`: priority, micro-ops of `Plan.micro_op_bytes`; otherwise DDP's fair
    sharing), with `model`'s dense parameters (all but the detected experts, embeddings included; without
    a model, the attention projections), and the routing `Plan.routing_skew` gives (uniform when None: a skew or a
    recorded trace lets the search pick FSEP for its balance). A `Plan.slots_per_device` given with form="auto" is
    the only C the search prices for FSEP. auto never picks a math-changing form (HP, capacity on a dropless block:
    docs/DESIGN.md, only by name): HP is priced with `Plan.heads` / `Plan.head_dim` and shown. Every field that does not act under the
    chosen form (`moepass.plan.ACTS_UNDER`: the FSEP fields when EP wins, ...) is put back at its default."""
    if plan.form != "auto":
        return plan, None
    if plan.batch is None:
        raise PlanError("Plan.form='auto' needs Plan.batch=(batch, seq) tokens per rank for the cost model; "
                        "pass it, or name a form explicitly.")
    from cost_model.search import BlockShape, PlanSpace, Pricing, dense_params_of, search

    topology = plan.topology if plan.topology is not None else default_topology()
    tokens = plan.batch[0] * plan.batch[1]
    dense = dense_params_of(model, [BlockShape.of(spec, tokens) for spec in report.blocks]) if model is not None else None
    result = (search(report.blocks, topology, plan.batch, PlanSpace.of(plan), profile=plan.hardware,
                     pricing=Pricing.of(plan, dense_params=dense))
              if report.blocks else None)
    chosen = result.to_plan_kwargs() if result is not None else {"form": "single"}
    return plan.as_form(**chosen), result  # the fields that do not act under the chosen form back at their defaults


def default_topology() -> tuple[int, int]:
    """(nodes, ranks per node) by the one rule the rewrites use (`Topology.from_env`): torchrun's environment,
    else the initialised process group as one node (under mp.spawn there is no WORLD_SIZE), else one rank."""
    topology = Topology.from_env()
    return topology.nodes, topology.ranks_per_node


@contextlib.contextmanager
def _world_for(plan: Plan):
    """For a distributed form with no process group: the "fake" process group at the plan's world size.

    It runs no real communication: `explain` can show the distributed graph of any world size on one
    machine. An initialised process group is used as it is.
    """
    import torch.distributed as dist

    if plan.form == "single" or dist.is_initialized():
        yield None
        return
    topology = plan.topology
    world = topology.world_size if topology is not None else (plan.ep_size or 1)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield f"(no process group: graph built on the fake process group at world size {world}, as rank 0)"
    finally:
        dist.destroy_process_group()


def explain(model: nn.Module, plan: Plan | None = None, *, graphs: bool = True, sources: bool = False,
            report: DetectionReport | None = None, example_inputs: Any = None) -> str:
    """A readable report of what `compile(model, plan)` would do. Never raises.

    `sources=True` adds the generated Triton source of every lowered node (Plan.lowering); `report`: the
    model's `detect` result, when the caller has it already (as `compile` takes it); `example_inputs` as
    `compile` takes them."""
    lines: list[str] = []
    try:
        plan = Plan() if plan is None else plan
        lines.append(f"moepass plan: form={plan.form!r} lowering={plan.lowering!r}")
        if plan.deterministic:
            lines.append(determinism.describe())
    except Exception as err:  # explain never raises
        return f"moepass: invalid plan: {err}"
    try:
        report = detect(model, example_inputs) if report is None else report
    except Exception:
        return "moepass: detection failed:\n" + traceback.format_exc()
    lines.append(report.summary())
    if plan.form == "auto":
        try:
            plan, result = resolve_auto(plan, report, model)
            if result is not None:
                best, runner = result.best, result.runner_up
                lines.append(f"cost model chose: {best.label} ({float(best.step) * 1e3:.3g} ms/step)"
                             + (f"; runner-up: {runner.label} ({float(runner.step) * 1e3:.3g} ms/step)"
                                if runner else ""))
                lines.append(result.table(limit=6))
        except Exception as err:
            lines.append(f"cost model could not choose a form: {type(err).__name__}: {err}")
            return "\n".join(lines)
    missed = not_rewritten(plan, report)  # what compile would leave as it is: said as compile would say it
    unmatched = unmatched_blocks(plan, report)
    if unmatched is not None:
        lines.append(f"compile would raise PlanError: {unmatched}")
    if plan.strict and missed:
        lines.append(f"compile would raise PlanError (Plan.strict=True): {_missed_message(missed, plan)}")
    elif any(_form_of(plan, path) in DISTRIBUTED_FORMS for path, _ in missed):
        lines.append(f"compile would warn: {_missed_message(missed, plan)}")
    sections: dict[tuple[str, ...], list[Any]] = {}  # a block's section (its own path masked) -> its blocks
    changed = 0  # blocks whose math the plan changes
    for detail in report.details:
        if detail.accepted and detail.spec is not None:
            body, changes = _block_section(model, detail, plan, graphs, sources, report.outlines)
            sections.setdefault(_fold_key(detail, body), []).append((detail, body))
            changed += changes
    if changed:  # a conversion the plan names (hp on a standard block, locality, a capacity on a dropless block)
        lines[0] += f" (changes the model's math in {changed} block(s), as the plan names: see each 'math')"
    for same in sections.values():  # identical blocks (a deep model's layers): the first in full, the rest folded
        first, body = same[0]
        lines += ["", f"== {first.path or '<root>'} ({first.module_type}) =="] + body
        if len(same) > 1:
            errors = [d.check.max_error for d, _ in same[1:] if d.check is not None]
            checked = f"; semantic check accepted on each, max error {max(errors):.2e}" if errors else ""
            lines.append(f"== {_span([d.path for d, _ in same[1:]])}: same as {first.path or '<root>'} "
                         f"({len(same) - 1} block(s){checked}) ==")
    return "\n".join(lines)


def math_changes(gm: Any) -> list[dict[str, Any]]:
    """The stats of a compiled block's records that change its math (a conversion or capacity the plan names)."""
    return [record["stats"] for record in gm.history if "math" in (record.get("stats") or {})]


def _block_section(model: nn.Module, detail: Any, plan: Plan, graphs: bool, sources: bool,
                   outlines: dict[str, Any]) -> tuple[list[str], bool]:
    """`explain`'s lines for one accepted block: recogniser, spec, check, plan, passes, graph (never raises);
    and whether the plan changes its math."""
    lines = [f"recogniser: {detail.recogniser}", f"spec: {detail.spec.summary()}"]
    if detail.spec.router.logits_from == "traced":  # an unknown router: its own code, then the known rule
        lines.append("router region, traced from the block's forward up to the logits (then the known "
                     "selection the spec names):")
        lines.append(detail.spec.router.traced.code.strip())
    if detail.check is not None:
        lines.append(f"semantic check: {detail.check.describe()}")
    block_plan = plan.for_block(detail.spec.path)
    if block_plan is None:
        return lines + ["plan: left alone (Plan.blocks)"], False
    changes = False
    try:
        original = outline.block_in(model, detail.spec.path, outlines)
        block = copy_block(detail.spec, original, block_plan)  # as compile copies it
        with _world_for(block_plan) as note:
            if note:
                lines.append(note)
            gm = compile_block(detail.spec, block, block_plan)
        changes = bool(math_changes(gm))
        for record in gm.history:
            if record["pass"] == CANONICAL_PASS:
                continue
            lines.append(f"pass {record['pass']}: {'changed' if record.get('changed') else 'unchanged'} "
                         f"{record.get('stats') or ''}".rstrip())
        if gm.layout is not None:
            lines += gm.layout.describe(gm)
        if keeps_original(block_plan, traced=False):
            lines.append("at run time: the first call per input signature times this graph against the block's own "
                         "code and runs the faster (Plan.keep_original_if_slower=True; "
                         "moepass.runtime.faster.choices(compiled_block) says which runs and why)")
        if graphs:
            lines.append(gm.print_readable(print_output=False).rstrip())
        if sources:
            from moepass.lower import sources as lowered_sources

            for name, family, text in lowered_sources(gm):
                lines.append(f"-- generated Triton source of node {name} ({family}) --\n{text.rstrip()}")
    except Exception as err:
        lines.append(f"compile of this block would fail: {type(err).__name__}: {err}")
    return lines, changes


def _fold_key(detail: Any, body: list[str]) -> tuple[str, ...]:
    """What makes two blocks' sections the same: their lines with the block's own path and the check's measured
    error masked (different weights, the same structure, recogniser, spec, plan, passes and graph)."""
    path = detail.path or "<root>"
    masked = [re.sub(r"max error [0-9.e+-]+", "max error <err>", line.replace(path, "<block>")) for line in body]
    return (detail.module_type, *masked)


def _span(paths: list[str]) -> str:
    """Block paths said briefly: 'layers.{1-15}.mlp' when they differ in one numbered component (a run, or a
    list of numbers), else the paths (the first and last of more than three)."""
    parts = [p.split(".") for p in paths]
    if len(paths) > 1 and len({len(p) for p in parts}) == 1:
        differ = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
        if len(differ) == 1 and all(p[differ[0]].isdigit() for p in parts):
            at, numbers = differ[0], [int(p[differ[0]]) for p in parts]
            run = numbers == list(range(numbers[0], numbers[0] + len(numbers)))
            inner = f"{numbers[0]}-{numbers[-1]}" if run else ",".join(map(str, numbers))
            return ".".join(parts[0][:at] + ["{" + inner + "}"] + parts[0][at + 1:])
    return ", ".join(paths) if len(paths) <= 3 else f"{paths[0]}, ..., {paths[-1]}"
