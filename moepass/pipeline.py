"""The compiler order, on one screen: the model stages, then each block's stages.

Model (`compile_model`, what `moepass.compile` runs after detection and the plan checks):

    model ─copy─► copy ─blocks (compile_block each, put in place)─► ─finalize─► ─unshare─►
          ─grad_sync─► ─optimizer─► ─determinism─► the model to train (`moepass_info.stages`: each stage, its time)

Block (`compile_block`; `compile`, `explain` and the torch.compile backend all run it; each stage goes
through `run_pass` and is in the block's `history` with its time):

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
- model stages: every block is compiled before `finalize` (DDP's ignore list, FSEP's prefetch chain read
  all of them); gradient sync and the optimizer hooks read the final parameters; the determinism scope
  is installed last, on the module `compile` returns.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moepass import canonical, determinism, dialect, lower, module_copy, schedule
from moepass.canonical import MoEGraphModule
from moepass.detect import DetectionReport, outline, structure
from moepass.envflags import flag
from moepass.errors import PlanError
from moepass.operands import set_operand
from moepass.passes import Effects, Pass, PassResult, apply_effects
from moepass.plan import Plan
from moepass.rewrite import dropped, ep, experts, fsep, hp, hp_ep, latent, locality
from moepass.runtime import faster, optim
from moepass.spec import MoESpec

log = logging.getLogger("moepass")
if flag("MOEPASS_DEBUG"):
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    log.setLevel(logging.DEBUG)


def _rewrite_single(gm: MoEGraphModule, plan: Plan) -> PassResult:
    """form="single": the canonical graph is already the single-device form. Per-expert (ModuleList)
    weights are re-laid once into one buffer per role, so the graph reads them without a copy."""
    relaid = canonical.stacked_relayout(gm, gm.spec)
    return PassResult(gm, changed=bool(relaid), stats={"relaid_expert_params": len(relaid)},
                      effects=Effects(relaid=relaid))


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
        set_operand(node, "recompute", True)
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
    if plan.form == "hp" and spec.heads is not None:  # already a Multi-Head LatentMoE: its own heads
        given = {name: getattr(plan, name) for name in ("heads", "head_dim") if getattr(plan, name) is not None}
        own = {"heads": spec.heads.num_heads, "head_dim": spec.heads.head_dim}
        wrong = {name: value for name, value in given.items() if value != own[name]}
        if wrong:
            raise PlanError(f"Plan.{', Plan.'.join(f'{n}={v}' for n, v in wrong.items())} cannot act on block "
                            f"{spec.path or '<root>'!r}: it is a Multi-Head LatentMoE already, with heads="
                            f"{own['heads']} and head_dim={own['head_dim']}, which form='hp' keeps; leave "
                            f"{' and '.join(wrong)} unset (they shape the block a standard one becomes).")
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


def compile_block(spec: MoESpec, block: nn.Module, plan: Plan, verify: bool | None = None,
                  traced: bool = False, decisions: dict[Any, faster.Choice] | None = None) -> MoEGraphModule:
    """One block from spec to runnable graph module; `traced`: for a compiler that traces it (the torch.compile
    backend), so no pass whose shapes depend on data (`rewrite.dropped`) and no choice of the user's block at
    run time; `decisions`: the choices of the blocks of one structure, shared within a model (`keeps_original`)."""
    verify = flag("MOEPASS_VERIFY") if verify is None else verify
    if plan.form not in REWRITES:
        raise PlanError(
            f"Plan.form={plan.form!r} is not available in this build for block {spec.path or '<root>'}: "
            f"available forms are {sorted(REWRITES)}; use form='single' or a form listed there."
        )
    start = time.perf_counter()
    spec, block, converted = convert(spec, block, plan)  # form="hp" on a standard block: the named math change
    if converted is not None:
        converted["seconds"] = time.perf_counter() - start
    given = spec.capacity
    spec, plan = resolve(spec, plan)
    records = [] if converted is None else [converted]
    if spec.capacity != given:  # Plan.capacity_factor on a dropless block, or instead of the block's own capacity
        cf = plan.capacity_factor
        own = "" if given is None else f"C={given.fixed}" if given.fixed is not None else f"factor {given.capacity_factor:g}"
        records.append({"pass": "capacity", "seconds": 0.0, "changed": True, "stats": {"math": (
            f"changed: Plan.capacity_factor={cf:g} drops each (source rank, expert)'s assignments beyond "
            f"C = ceil({cf:g}*T*K/E)" + (" where the block is dropless" if given is None else
                                         f", instead of the block's own capacity ({own})"))}})
    start = time.perf_counter()
    gm = canonical.build(spec, block)  # MoESpec -> canonical dialect graph
    gm.history[-1]["seconds"] = time.perf_counter() - start  # canonical's own record
    gm.history[0:0] = records
    if verify:
        from moepass.verify import verify as run_verifier

        run_verifier(gm, after="canonical")
    gm = run_pass(f"rewrite:{plan.form}", REWRITES[plan.form], gm, plan, verify)  # the parallel form
    if plan.form == "single" and spec.capacity is not None and not traced:  # dropped assignments skip the experts
        gm = run_pass(dropped.PASS, dropped.skip_dropped_pass, gm, plan, verify)
    if plan.expert_recompute:  # the expert FFN keeps only its inputs for backward
        gm = run_pass("expert_recompute", expert_recompute, gm, plan, verify)
    gm = run_pass(schedule.PASS, schedule.schedule_pass, gm, plan, verify)  # partitioned, prioritised all-to-all
    gm = run_pass(lower.PASS_NAME, lower.lower_pass, gm, plan, verify)  # Triton kernels where eligible
    if keeps_original(plan, traced):  # the user's block runs instead where it was timed faster
        faster.attach(gm, block, spec.path, structure.structural_key(block), {} if decisions is None else decisions)
    return gm


def keeps_original(plan: Plan, traced: bool) -> bool:
    """Plan(keep_original_if_slower=True) under form="single" (`moepass.runtime.faster`), except where a timing must
    not decide what runs: a traced graph, deterministic runs, expert recompute's memory, `MOEPASS_ALWAYS_REWRITE`."""
    return (plan.form == "single" and plan.keep_original_if_slower and not traced and not plan.deterministic
            and not plan.expert_recompute and not flag("MOEPASS_ALWAYS_REWRITE"))


@dataclass
class CompileInfo:
    """Attached to a compiled model as `model.moepass_info`: what was done and why."""

    plan: Plan
    report: DetectionReport
    rewritten: dict[str, MoEGraphModule] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # path -> reason (plan said leave it)
    stages: list[dict[str, Any]] = field(default_factory=list)  # the model stages: name, seconds, what they did


@contextlib.contextmanager
def stage(info: CompileInfo, name: str, **stats: Any) -> Iterator[dict[str, Any]]:
    """One model stage, timed and recorded in `info.stages` (the block stages' `run_pass` for the model)."""
    record: dict[str, Any] = {"pass": name, "seconds": 0.0, "stats": stats}
    start = time.perf_counter()
    try:
        yield record["stats"]
    finally:
        record["seconds"] = time.perf_counter() - start
        info.stages.append(record)
        log.info("%s [model]: %.1f ms %s", name, record["seconds"] * 1e3, record["stats"])


OUTLINED_FORMS = ("single", "ep", "fsep")  # the forms built for an outlined block (tests/test_outline.py)


def refuse_distributed_outlines(plan: Plan, report: DetectionReport) -> None:
    """A block outlined from its host's forward (`moepass.detect.outline`) is built under the `OUTLINED_FORMS`
    (single, EP, FSEP: their layouts' names follow the host, `runtime.layout.user_prefix`); another form (HP,
    locality: not proven on one) is refused before anything is copied, naming the way out."""
    for path, how in report.outlines.items():
        block_plan = plan.for_block(path)
        if block_plan is not None and block_plan.form not in OUTLINED_FORMS:
            raise PlanError(
                f"block {path!r} is an MoE region outlined from {how.host or 'the model'!r}'s own forward (router and "
                f"experts written inline beside other work): form={block_plan.form!r} is not built for it yet (its "
                f"rewrite is not proven on a block whose modules its host shares). Use Plan(blocks={{{path!r}: "
                f"{{'form': 'single'}}}}) (or 'ep' / 'fsep') or leave it alone with Plan(blocks={{{path!r}: None}}), "
                f"or move the MoE part of that forward into a submodule of its own.")


def compile_model(model: nn.Module, plan: Plan, report: DetectionReport, inplace: bool) -> tuple[nn.Module, CompileInfo]:
    """`moepass.compile`'s work after detection and the plan checks: the model stages (module doc)."""
    info = CompileInfo(plan=plan, report=report)
    mode = determinism.deterministic() if plan.deterministic else contextlib.nullcontext()
    with module_copy.gc_paused(), mode:  # thousands of modules and graph nodes are made: no collection walks them
        with stage(info, "copy", inplace=inplace) as stats:
            target, aliased = (model, 0) if inplace else copy_model(model, plan, report)
            stats["aliased_expert_weights"] = aliased
        with stage(info, "blocks") as stats:
            decisions: dict[Any, faster.Choice] = {}  # blocks of one structure are timed once (runtime.faster)
            aliases = module_copy.module_aliases(target)
            for spec in report.blocks:
                block_plan = plan.for_block(spec.path)
                if block_plan is None:
                    info.skipped[spec.path] = "Plan.blocks leaves it alone"
                    continue
                how = report.outlines.get(spec.path)
                if how is not None:  # a region outlined from its host's forward: the host now calls it as a child
                    host = target.get_submodule(how.host) if how.host else target
                    how.apply(host)
                gm = compile_block(spec, target.get_submodule(spec.path) if spec.path else target, block_plan,
                                   decisions=decisions)
                info.rewritten[spec.path] = gm
                if spec.path:
                    for path in (spec.path, *aliases.get(spec.path, ())):  # a block several paths share: one rewrite
                        target.set_submodule(path, gm)
                else:
                    target = gm
                if how is not None:
                    how.adopt(host, gm)
            stats.update(rewritten=len(info.rewritten), skipped=len(info.skipped))
        with stage(info, "finalize"):
            finalize(target)  # model-level set-up of the rewritten forms
        if aliased:
            with stage(info, "unshare", aliased=aliased):
                module_copy.unshare(target, model)  # expert weights a rewrite left as they were (copy_model aliased)
    for name, install in MODEL_HOOKS:
        with stage(info, name) as stats:
            stats["installed"] = install(target, plan)
    object.__setattr__(target, "moepass_info", info)
    return target, info


def copy_block(spec: MoESpec, block: nn.Module, plan: Plan) -> nn.Module:
    """One block copied as `compile` copies it (`copy_model`): each expert weight once at most; what `explain`
    compiles so the user's block is never touched."""
    memo: dict[int, Any] = {}
    copy_expert_weights(spec, block, plan, memo, module_copy.storage_counts(block))
    return module_copy.deepcopy_module(block, memo)


def copy_model(model: nn.Module, plan: Plan, report: DetectionReport) -> tuple[nn.Module, int]:
    """The deep copy `compile` rewrites (the user's model is never changed), and how many expert weights it
    aliases. Each block's expert weights are copied once (`copy_expert_weights`: straight into the buffer
    form="single" lays them in; or not at all when the form builds its own expert tensors from them, the copy
    then holding aliases), handed to the copy through its memo; everything else is copied as `copy.deepcopy`
    copies it (`module_copy.deepcopy_module`: the same result, without deepcopy's per-object overhead).
    After the rewrite, `unshare` gives the result its own copy of any alias it still holds."""
    memo: dict[int, Any] = {}
    plans = [(spec, plan.for_block(spec.path)) for spec in report.blocks]
    distributed = any(p is not None and p.form != "single" for _, p in plans)
    counts = module_copy.storage_counts(model) if distributed else Counter()
    aliased = 0
    for spec, block_plan in plans:
        if block_plan is not None:
            done = copy_expert_weights(spec, outline.block_in(model, spec.path, report.outlines), block_plan, memo,
                                       counts)
            aliased += done if block_plan.form != "single" else 0
    return module_copy.deepcopy_module(model, memo), aliased


def install_grad_sync(target: nn.Module, plan: Plan) -> bool:
    """Plan(grad_sync="scheduler") over more than one rank: the priority gradient synchronisation, held by the
    model (not a submodule: state_dict unchanged). Every rank compiles in the same order: a collective."""
    if not (plan.grad_sync == "scheduler" and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from moepass.runtime.grad_sync import GradientSync

    sync = GradientSync(target, micro_op_bytes=plan.micro_op_bytes, expert_replicas=True)
    object.__setattr__(target, "moepass_grad_sync", sync)
    return True


def install_optimizer_steps(target: nn.Module, plan: Plan) -> bool:
    """Expert DTensors beside plain tensors: foreach/fused optimizer steps work (`runtime.optim`)."""
    if not any(isinstance(p, DTensor) for p in target.parameters()):
        return False
    optim.enable_mixed_steps()
    return True


def install_determinism(target: nn.Module, plan: Plan) -> bool:
    """Plan(deterministic=True): the compiled model's forward and backward, not the whole process."""
    if not plan.deterministic:
        return False
    object.__setattr__(target, "moepass_determinism", determinism.scope(target))
    return True


MODEL_HOOKS: tuple[tuple[str, Callable[[nn.Module, Plan], bool]], ...] = (  # after the blocks, in this order
    ("grad_sync", install_grad_sync),
    ("optimizer", install_optimizer_steps),
    ("determinism", install_determinism),
)
