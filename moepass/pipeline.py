"""The compiler order, on one screen. Each stage is a plain function GraphModule -> PassResult.

    MoESpec ─canonical─► dialect graph ─rewrite[form]─► distributed graph ─schedule─► ─lower─► runnable

Ordering rules:
- rewrite comes first: it decides which communication exists; schedule can only split what exists.
- schedule before lower: lowering replaces dialect nodes by kernels, after which chunking cannot
  see the expert compute any more.
- the verifier runs after every pass when MOEPASS_VERIFY=1 (the test suite sets it).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from moepass import canonical
from moepass.canonical import MoEGraphModule
from moepass.errors import PlanError
from moepass.plan import Plan
from moepass.spec import MoESpec

log = logging.getLogger("moepass")
if os.environ.get("MOEPASS_DEBUG"):
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    log.setLevel(logging.DEBUG)


@dataclass
class PassResult:
    gm: MoEGraphModule
    changed: bool
    stats: dict[str, Any] = field(default_factory=dict)


Pass = Callable[[MoEGraphModule, Plan], PassResult]


def _rewrite_single(gm: MoEGraphModule, plan: Plan) -> PassResult:
    """form="single": the canonical graph is already the single-device form. Per-expert (ModuleList)
    weights are re-laid once into one buffer per role, so the graph reads them without a copy."""
    moved = canonical.relayout_stacked(gm, gm.spec)
    return PassResult(gm, changed=False, stats={"relaid_expert_params": moved})


def expert_recompute(gm: MoEGraphModule, plan: Plan) -> PassResult:
    """Plan.expert_recompute: every expert FFN's backward recomputes gate/up instead of keeping them."""
    from moepass import dialect

    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == dialect.EXPERT_FFN]
    for node in nodes:
        node.args = (*node.args[:11], True)
    gm.recompile()
    return PassResult(gm, changed=bool(nodes), stats={"expert_ffn_recompute": len(nodes)})


REWRITES: dict[str, Pass] = {"single": _rewrite_single}  # later forms register here (moepass.rewrite.*)
SCHEDULE: list[tuple[str, Pass]] = []  # moepass.schedule registers its passes here
PLAN_RESOLVERS: list[Callable[[MoESpec, Plan], Plan]] = []  # per-block plan fixes before rewrite (schedule: packing -> ep_size)
LOWER: list[tuple[str, Pass]] = []  # moepass.lower registers its pass here
FINALIZERS: list[Callable[[nn.Module], None]] = []  # model-level set-up after all blocks (e.g. EP: DDP ignore list)


def run_pass(name: str, fn: Pass, gm: MoEGraphModule, plan: Plan, verify: bool) -> MoEGraphModule:
    start = time.perf_counter()
    result = fn(gm, plan)
    seconds = time.perf_counter() - start
    result.gm.history.append({"pass": name, "seconds": seconds, "changed": result.changed, "stats": result.stats})
    log.info("%s [%s]: %s in %.1f ms %s", name, gm.spec.path or "<root>",
             "changed" if result.changed else "unchanged", seconds * 1e3, result.stats)
    if verify:
        from moepass.verify import verify as run_verifier

        run_verifier(result.gm, after=name)
    return result.gm


def compile_block(spec: MoESpec, block: nn.Module, plan: Plan, verify: bool | None = None) -> MoEGraphModule:
    """One block from spec to runnable graph module."""
    verify = bool(os.environ.get("MOEPASS_VERIFY")) if verify is None else verify
    if plan.form not in REWRITES:
        raise PlanError(
            f"Plan.form={plan.form!r} is not available in this build for block {spec.path or '<root>'}: "
            f"available forms are {sorted(REWRITES)}; use form='single' or a form listed there."
        )
    gm = canonical.build(spec, block)  # MoESpec -> canonical dialect graph
    if verify:
        from moepass.verify import verify as run_verifier

        run_verifier(gm, after="canonical")
    for resolve in PLAN_RESOLVERS:
        plan = resolve(spec, plan)
    gm = run_pass(f"rewrite:{plan.form}", REWRITES[plan.form], gm, plan, verify)  # the parallel form
    if plan.expert_recompute:  # after the rewrite made the expert compute nodes, before chunking copies them
        gm = run_pass("expert_recompute", expert_recompute, gm, plan, verify)
    for name, fn in SCHEDULE:  # partitioned, prioritised all-to-all
        gm = run_pass(name, fn, gm, plan, verify)
    for name, fn in LOWER:  # Triton kernels where eligible
        gm = run_pass(name, fn, gm, plan, verify)
    return gm
