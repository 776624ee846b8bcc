"""Every rank rewrites the same blocks the same way, or `compile` says so on every rank instead of hanging.

A distributed form's rewrite makes process groups and its forward exchanges tokens: a block one rank rewrites
and another leaves as it is, or rewrites under another form or other exchange settings, would leave the ranks
waiting for each other at the first collective. Detection reads a block's weights, so a model whose weights
differ from rank to rank (parameters left as `torch.empty` memory, another seed) can be accepted on one rank
and rejected on another; a plan built from rank-local values (an `ep_size` read from a rank's own config) can
differ too.

`check(plan, report)` gathers each rank's verdicts (one `all_gather_object`, only where a block is planned into
a distributed form: then every rank calls compile) and raises the same `PlanError` on every rank where they
differ, naming the blocks, the ranks and the fix. `disagreement` is the comparison itself (no process group).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moepass.detect import DetectionReport
from moepass.errors import PlanError
from moepass.plan import DISTRIBUTED_FORMS, PLAN_FIELDS, Plan

REASON_CHARS = 300  # of a rejecting rank's reason, in the message


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What one rank's compile would do with one block detection saw."""

    path: str
    accepted: bool
    plan: tuple[tuple[str, Any], ...]  # the block plan's fields (`plan_values`); () where Plan.blocks leaves it alone
    reason: str = ""  # why detection rejected it

    @property
    def form(self) -> str | None:
        return dict(self.plan).get("form")


def plain(value: Any) -> Any:
    """`value` as something every rank compares equal when it means the same: plain values as they are, dataclasses
    field by field, anything else (a callable planner, an object) by its type's name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return tuple((f.name, plain(getattr(value, f.name))) for f in dataclasses.fields(value))
    return type(value).__name__


def plan_values(block_plan: Plan | None) -> tuple[tuple[str, Any], ...]:
    """The fields of one block's plan that shape its rewritten graph: its form, the form's options and the plan-wide
    fields (`PLAN_FIELDS`, but for the overrides and strictness, which decide what is rewritten, not how)."""
    if block_plan is None:
        return ()
    options = [(f.name, plain(getattr(block_plan.options, f.name))) for f in dataclasses.fields(block_plan.options)]
    wide = [(name, plain(getattr(block_plan, name))) for name in PLAN_FIELDS if name not in ("blocks", "strict")]
    return (("form", block_plan.form), *options, *wide)


def verdicts(plan: Plan, report: DetectionReport) -> list[Verdict]:
    out = []
    for d in report.details:
        out.append(Verdict(d.path, d.accepted, plan_values(plan.for_block(d.path)), "" if d.accepted else d.reason))
    return out


def _short(text: str) -> str:
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS] + " ..."


def disagreement(by_rank: list[list[Verdict]]) -> str | None:
    """The `PlanError` message where the ranks' verdicts differ (`by_rank[r]`: rank r's), else None."""
    seen: dict[str, dict[int, Verdict]] = {}
    for rank, theirs in enumerate(by_rank):
        for v in theirs:
            seen.setdefault(v.path, {})[rank] = v
    world = range(len(by_rank))
    lines, first = [], None
    for path, mine in seen.items():
        name = repr(path or "<root>")
        absent = [r for r in world if r not in mine]
        accepted = [r for r in world if r in mine and mine[r].accepted]
        rejected = [r for r in world if r in mine and not mine[r].accepted]
        if absent or (accepted and rejected):
            why = f" (rank {rejected[0]}: {_short(mine[rejected[0]].reason)})" if rejected else ""
            lines.append(f"{name}: accepted on rank(s) {accepted}, rejected on {rejected}"
                         + (f", not seen on {absent}" if absent else "") + why)
        elif len({v.plan for v in mine.values()}) > 1:
            fields = [(field, {r: dict(v.plan).get(field) for r, v in mine.items()})
                      for field in dict.fromkeys(n for v in mine.values() for n, _ in v.plan)]  # form first
            differ = [f"{field} " + ", ".join(f"rank {r}: {value!r}" for r, value in values.items())
                      for field, values in fields if len(set(map(repr, values.values()))) > 1]
            lines.append(f"{name}: the ranks' plans differ: {'; '.join(differ)}")
        else:
            continue
        first = path if first is None else first
    if not lines:
        return None
    return (f"moepass.compile: the ranks do not agree on how to rewrite the MoE blocks: {' | '.join(lines[:4])}"
            f"{' ...' if len(lines) > 4 else ''}. Every rank must rewrite the same blocks the same way (else the "
            f"first all-to-all hangs). Pass the same Plan on every rank; detection reads the block's weights: build "
            f"the model identically on every rank and initialise (or load) its weights before compile (the same seed "
            f"on every rank; parameters left as torch.empty memory differ from rank to rank), or leave the blocks "
            f"alone with Plan(blocks={{{first!r}: None}}).")


def check(plan: Plan, report: DetectionReport, model: nn.Module) -> None:
    """Raise the same `PlanError` on every rank where the ranks would rewrite the blocks differently (module doc).
    On NCCL the gather's bytes travel on the model's GPU (not the current device, which a script may not have set)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1) or dist.get_backend() == "fake":
        return  # (the fake process group of `explain` and the tests: no other rank to agree with)
    mine = verdicts(plan, report)
    if not any(v.form in DISTRIBUTED_FORMS for v in mine):
        return
    device = next((p.device for p in model.parameters()), None)
    on_gpu = torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()
    gathered: list[Any] = [None] * dist.get_world_size()
    with on_gpu:
        dist.all_gather_object(gathered, mine)
    message = disagreement(gathered)
    if message is not None:
        raise PlanError(message)
