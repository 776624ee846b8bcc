"""The compiler order, on one screen. Each stage is a plain function GraphModule -> PassResult.

    MoESpec ─convert (hp, locality)─► ─resolve─► MoESpec, Plan ─canonical─► dialect graph ─rewrite[form]─► distributed graph
            ─expert_recompute─► ─schedule─► ─lower─► runnable

Ordering rules:
- form="hp" converts a standard block into a Multi-Head LatentMoE first (an architecture change the plan
  names); form="locality" makes its router top-1 (the routing change the plan names); everything after
  works on the new block's spec.
- the plan and the spec are resolved first (packing -> EP degree, chunks, EP capacity): the canonical
  graph is generated once, from the spec the rewrite will use.
- rewrite comes next: it decides which communication exists; schedule can only split what exists.
- expert_recompute marks the expert FFN nodes the rewrite made, before chunking copies them.
- schedule before lower: lowering replaces dialect nodes by kernels, after which chunking cannot
  see the expert compute any more.
- the verifier runs after every pass when MOEPASS_VERIFY=1 (the test suite sets it).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from torch import nn

from moepass import canonical, dialect, lower, module_copy, schedule
from moepass.canonical import MoEGraphModule
from moepass.envflags import flag
from moepass.errors import PlanError
from moepass.passes import Pass, PassResult, apply_effects
from moepass.plan import Plan
from moepass.rewrite import ep, experts, fsep, hp, hp_ep, latent, locality
from moepass.spec import MoESpec

log = logging.getLogger("moepass")
if flag("MOEPASS_DEBUG"):
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    log.setLevel(logging.DEBUG)


def _rewrite_single(gm: MoEGraphModule, plan: Plan) -> PassResult:
    """form="single": the canonical graph is already the single-device form. Per-expert (ModuleList)
    weights are re-laid once into one buffer per role, so the graph reads them without a copy."""
    moved = canonical.relayout_stacked(gm, gm.spec)
    return PassResult(gm, changed=False, stats={"relaid_expert_params": moved})


def copy_expert_weights(spec: MoESpec, block: nn.Module, plan: Plan, memo: dict[int, Any],
                        counts: Counter[int]) -> int:
    """Before `compile` deep-copies the model, so that each expert weight is copied once: form="single"
    re-lays them into one buffer per role (`_rewrite_single`), so they are copied straight into that
    buffer (`canonical.stacked_copies`); the other forms build their own expert tensors (EP, FSEP: this
    rank's shard; HP: a new block), so the copy adopts aliases of the originals instead
    (`module_copy.alias_in_memo`, `counts` from `module_copy.storage_counts` of the model), and `compile`
    unshares whatever alias survives the rewrite. Returns how many parameters were copied or aliased."""
    if plan.form == "single":
        return canonical.stacked_copies(block, spec, memo)
    params = dict(block.named_parameters())
    experts = [params[path] for source in spec.experts.sources().values() for path in source.paths if path in params]
    return module_copy.alias_in_memo(experts, memo, counts)


def expert_recompute(gm: MoEGraphModule, plan: Plan) -> PassResult:
    """Plan.expert_recompute: every expert FFN's backward recomputes gate/up instead of keeping them."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == dialect.EXPERT_FFN]
    for node in nodes:
        node.args = (*node.args[:11], True)
    gm.recompile()
    return PassResult(gm, changed=bool(nodes), stats={"expert_ffn_recompute": len(nodes)})


def _rewrite_hp(gm: MoEGraphModule, plan: Plan) -> PassResult:
    """HP: the heads over the group (`rewrite.hp`), or with EP inside each head group when
    Plan.head_ep_size > 1 (`rewrite.hp_ep`)."""
    return hp_ep.rewrite_hp_ep(gm, plan) if plan.head_ep_size > 1 else hp.rewrite_hp(gm, plan)


REWRITES: dict[str, Pass] = {  # one pass per parallel form
    "single": _rewrite_single,
    "ep": ep.rewrite_ep,
    "fsep": fsep.rewrite_fsep,
    "hp": _rewrite_hp,
    "locality": locality.rewrite_locality,
}


def convert(spec: MoESpec, block: nn.Module, plan: Plan) -> tuple[MoESpec, nn.Module, dict | None]:
    """form="hp" on a standard block: the architecture change the plan named (a fresh Multi-Head
    LatentMoE of equal active parameters, `moepass.rewrite.latent`), before any graph exists; form="locality":
    the router change it names (top-1, its own capacity rule: `moepass.rewrite.locality.convert`)."""
    if plan.form == "locality":
        return locality.convert(spec, block, plan)
    if plan.form != "hp" or spec.heads is not None:
        return spec, block, None
    from moepass.runtime.topology import resolve as resolve_world

    _, world = resolve_world(plan.topology, plan.ep_size)
    if world % plan.head_ep_size:
        raise PlanError(f"Plan.head_ep_size={plan.head_ep_size} is invalid for block {spec.path or '<root>'}: it must "
                        f"divide the {world} ranks of the block (Plan.ep_size, None: the world size) into head "
                        f"groups; use a divisor of {world}.")
    latent_block, shape = latent.convert(spec, block, plan, world // plan.head_ep_size)  # heads over head groups
    record = {"pass": "convert:hp", "seconds": 0.0, "changed": True,
              "stats": {"math": "changed (fresh Multi-Head LatentMoE, named by Plan.form='hp')",
                        "latent": shape.summary()}}
    return latent_block.moepass_spec(spec.path), latent_block, record


def resolve(spec: MoESpec, plan: Plan) -> tuple[MoESpec, Plan]:
    """The block's plan and spec before any graph exists: packing -> EP degree, the EP capacity."""
    if spec.heads is not None and plan.form in ("ep", "fsep"):
        raise PlanError(f"Plan.form={plan.form!r} is not built for block {spec.path or '<root>'}, a Multi-Head "
                        f"LatentMoE: its parallel form is form='hp' (heads over ranks); or use form='single'.")
    plan = schedule.resolve_packing(spec, plan)  # k experts per device -> ep_size / k EP ranks
    if plan.form in ("ep", "fsep"):
        spec = spec.replace(capacity=ep.ep_capacity(spec, plan))  # capacity per (source rank, expert)
    return spec, plan


def finalize(model: nn.Module) -> None:
    """Model-level set-up after every block is rewritten (EP, FSEP: DDP ignores the expert parameters)."""
    experts.finalize_model(model)
    fsep.chain_restores(model)  # each FSEP block prefetches the next blocks' restores


def run_pass(name: str, fn: Pass, gm: MoEGraphModule, plan: Plan, verify: bool) -> MoEGraphModule:
    start = time.perf_counter()
    result = fn(gm, plan)
    if result.effects is not None:  # what the pass changes outside its graph, applied here, then recompiled
        apply_effects(result.gm, result.effects)
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
    verify = flag("MOEPASS_VERIFY") if verify is None else verify
    if plan.form not in REWRITES:
        raise PlanError(
            f"Plan.form={plan.form!r} is not available in this build for block {spec.path or '<root>'}: "
            f"available forms are {sorted(REWRITES)}; use form='single' or a form listed there."
        )
    spec, block, converted = convert(spec, block, plan)  # form="hp" on a standard block: the named math change
    spec, plan = resolve(spec, plan)
    gm = canonical.build(spec, block)  # MoESpec -> canonical dialect graph
    if converted is not None:
        gm.history.insert(0, converted)
    if verify:
        from moepass.verify import verify as run_verifier

        run_verifier(gm, after="canonical")
    gm = run_pass(f"rewrite:{plan.form}", REWRITES[plan.form], gm, plan, verify)  # the parallel form
    if plan.expert_recompute:  # the expert FFN keeps only its inputs for backward
        gm = run_pass("expert_recompute", expert_recompute, gm, plan, verify)
    gm = run_pass(schedule.PASS, schedule.schedule_pass, gm, plan, verify)  # partitioned, prioritised all-to-all
    gm = run_pass(lower.PASS_NAME, lower.lower_pass, gm, plan, verify)  # Triton kernels where eligible
    return gm
