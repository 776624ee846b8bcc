"""FSEP at run time: the restore exchange as an autograd node, the gradient slices' reduction deferred behind
the earlier layers' backward, the cross-layer restore prefetch, and the placement controller
(`FSEPPlacement`, a child module of each FSEP block) that plans tables off the critical path.
`moepass.rewrite.fsep` builds the graph that calls them; the ops are `moepass.runtime.fsep_ops`.

Prefetch (`Plan.prefetch_depth`, default 2): right after its restore is waited, before its expert compute,
a block issues the restores of the next blocks (`restore_prefetch`; module order, linked by
`moepass.rewrite.fsep.chain_restores` at compile time), which they then use (`restore_issue`) instead of
issuing their own: their weights travel behind this block's expert compute, at the cost of
prefetch_depth*C*S more elements alive. A prefetched restore is used only in the forward that issued it and
with the table it gathered; one left unused (blocks that run in another order, or skip) is dropped when the
backward reaches its issuer, and prefetching stops.

Deferred gradient reduction (`DeferredReductions`): the restore is one autograd node of the block that
uses it (`_RestoreExchange`, made between its dispatch and its expert compute, also for a prefetched
restore), so its backward runs right after the block's expert backward. It issues the gradient slices'
exchange and leaves it in flight; the next FSEP block's restore backward completes it (wait, sum the
replicas, hand each shard its gradient through `torch.autograd.backward`, so `AccumulateGrad`, tensor
hooks and post-accumulate-grad hooks see it as any gradient) before issuing its own: one in flight at a
time, each under the earlier layer's combine backward and expert backward. The chain's first block (its
backward runs last) completes its own at once, so every gradient lands inside the model's backward, before
end-of-backward callbacks queued at its start (`GradientSync`, DDP) run; the end of the backward
(`queue_callback`) completes anything left (a first block without trainable experts); a training forward
drops what a backward that raised left. Blocks that do not run in chain order defer nothing. Cost: the
previous layer's gradient slices (2·C·S elements: its send and receive buffers) stay alive one layer longer;
`Plan(defer_expert_grads=False)` waits for them in the layer's own backward instead (the restore as plain ops).
`deferred()` is this process's one queue of reductions in flight (autograd's backward is process-wide too;
`moepass.process_state.FSEP_DEFERRED` holds it).

The planner (`FSEPPlacement`): with `Plan(planner="auto")` each training forward gathers every rank's
per-expert counts (`moe_comm.gather_counts`, P*E integers), hands the last 5 steps' sum to a worker thread
running `moepass.runtime.placement.plan`, and installs the result at the next forward (one step later).
Every rank plans on the same counts with a deterministic planner, so every rank installs the same table at
the same step; the next forward joins the worker's result — it waits only if a solve took longer than a
whole step (measured: `wait_s` in each decision). "static" keeps the initial even table; a callable
`planner(counts_PE, current_table) -> table` is called in the worker the same way.

Shape letters: `moepass.spec.SHAPES`, as in `moepass.runtime.fsep_ops` (U = P*C global slots, s one slot's slice);
in the memory formulas above, S is the elements of one expert (the technique's notation).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn

from cost_model.fsep import ep_device_rows
from moepass.errors import PlanError
from moepass.process_state import FSEP_DEFERRED
from moepass.runtime import collectives as comm
from moepass.runtime import placement
from moepass.runtime.fsep_ops import gather_slices, slice_grads
from moepass.runtime.layout import ExpertLayout, local_part

CONTROLLER = "fsep_placement"  # the child module of an FSEP block holding its controller
log = logging.getLogger("moepass.fsep")


# ----------------------------------------------------------------------------------------------
# The gradient slices' reduction, deferred behind the earlier layers' backward.
# ----------------------------------------------------------------------------------------------


@dataclass
class DeferredReduction:
    """One block's gradient slices on their way back to their owners (issued by its restore's backward).
    `complete` waits for them, sums the replicas into shard rows (`slice_grads`) and hands each shard its
    gradient through autograd, so the parameters receive it as any gradient: `AccumulateGrad` adds it to
    `p.grad`, tensor hooks (the DP replicas' sum) and post-accumulate-grad hooks (`GradientSync`) fire, once
    per parameter."""

    pending: Tensor  # [P*C, s]: the gradient slices in flight
    slot_expert_U: Tensor  # the table the restore gathered with
    shards: list[Tensor]  # the shards the restore read: their autograd reaches the parameters
    block: str

    def complete(self) -> None:
        grad_Us = comm.WAIT(self.pending)
        grads = slice_grads(grad_Us, self.slot_expert_U, [shard.shape for shard in self.shards])
        pairs = [(shard, grad) for shard, grad in zip(self.shards, grads) if shard.requires_grad]
        # retain_graph: a retain_graph backward of the model walks the shards' few nodes (to_local) again
        torch.autograd.backward([shard for shard, _ in pairs], [grad for _, grad in pairs], retain_graph=True)

    def drop(self) -> None:
        comm.WAIT(self.pending)  # every rank issued it: complete the transfer, discard the gradient


class DeferredReductions:
    """This process's gradient reductions in flight, in issue order: at most one, as each restore's backward
    completes the earlier ones before it issues its own, so a transfer runs under the backward compute between
    two FSEP blocks. Whatever a backward leaves in flight is completed when it ends (`queue_callback`); what a
    backward that raised left is dropped by the next training forward."""

    def __init__(self) -> None:
        self._pending: list[DeferredReduction] = []
        self._lock = threading.Lock()
        self._flushing: set[int] = set()  # graph tasks whose end completes what is in flight
        self.deferred_total = 0  # reductions left in flight so far (a counter for tests and benchmarks)

    def __len__(self) -> int:
        return len(self._pending)

    def complete(self) -> None:
        """Complete every reduction in flight, oldest first."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                head = self._pending.pop(0)
            head.complete()

    def defer(self, reduction: DeferredReduction) -> None:
        """Leave `reduction` in flight until the next restore's backward, or the end of this backward."""
        task = torch._C._current_graph_task_id()
        with self._lock:
            self._pending.append(reduction)
            self.deferred_total += 1
            first = task not in self._flushing
            self._flushing.add(task)
        if first:
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._end_of_backward, task))

    def _end_of_backward(self, task: int) -> None:
        with self._lock:
            self._flushing.discard(task)
        self.complete()

    def drop_stale(self) -> None:
        """A training forward found reductions in flight: the backward that issued them raised. Complete their
        transfers and discard their gradients (that step's gradients are incomplete anyway)."""
        with self._lock:
            stale, self._pending = self._pending, []
            self._flushing.clear()
        for reduction in stale:
            reduction.drop()
        if stale:
            log.warning("FSEP: dropped the gradient reductions of %s left in flight by a backward that did not "
                        "finish", [reduction.block for reduction in stale])


def deferred() -> DeferredReductions:
    """This process's queue of reductions in flight (made on first use)."""
    return FSEP_DEFERRED.get(DeferredReductions)


class _RestoreExchange(torch.autograd.Function):
    """One restore as one autograd node of the block that uses it: gather this rank's slices and issue the
    equal all_to_all (pending; `moe_comm.wait` completes it), or take the one an earlier block prefetched
    (issued without autograd). Its backward issues the gradient slices' exchange and, when the block
    `defers_reduction`, leaves it in flight (`deferred()`) instead of waiting for it. The shards are not inputs
    of the node (the model's backward never reaches the expert parameters through it); `anchor`, an empty
    tensor, makes the output require grad.

    Made in the using block's forward, between its dispatch and its expert compute, the node runs in the
    backward right after that block's expert backward (autograd runs ready nodes latest-made first; a
    prefetch's node, made in the earlier block's forward, would run only when the backward reaches it)."""

    @staticmethod
    def forward(ctx, anchor, shards, slot_expert_U, controller, ahead):  # type: ignore[override]
        ctx.shards, ctx.slot_expert_U, ctx.controller = shards, slot_expert_U, controller
        if ahead is not None:
            return ahead.pending
        return issue_plain_restore(controller, [shard.detach() for shard in shards], slot_expert_U)

    @staticmethod
    def backward(ctx, grad_Us):  # type: ignore[override]
        controller = ctx.controller
        deferred().complete()  # the earlier blocks' reductions, before this one is issued
        pending = comm.EQUAL_ALL_TO_ALL(grad_Us.contiguous(), controller.restore.group_name, "restore_bwd")
        reduction = DeferredReduction(pending, ctx.slot_expert_U, ctx.shards, controller.block)
        if controller.defers_reduction:
            deferred().defer(reduction)
        else:
            reduction.complete()
        return None, None, None, None, None


def issue_plain_restore(controller: FSEPPlacement, shards: list[Tensor], slot_expert_U: Tensor) -> Tensor:
    """The restore as plain ops (pending): `gather_slices` and `moe_comm.equal_all_to_all`, whose backward (when
    the shards require grad) waits for the gradient slices at once."""
    assert controller.restore is not None
    return comm.EQUAL_ALL_TO_ALL(gather_slices(shards, slot_expert_U), controller.restore.group_name, "restore")


def exchange_restore(controller: FSEPPlacement, shards: list[Tensor], slot_expert_U: Tensor,
                     ahead: Prefetched | None = None) -> Tensor:
    """This block's restore (pending; `moe_comm.wait` completes it), issued now or `ahead` (prefetched):
    `_RestoreExchange`, or, in a fake-tensor trace, while Dynamo traces or with `defer_reduction` off, the plain
    ops. The deferred reduction hands the gradient to the parameters through their own local views, made here
    from the block's parameters: the graph's shards may come out of a torch.compile region, whose one backward
    node covers the whole region and must not run a second time."""
    if not controller.defer_reduction or _fake() or torch.compiler.is_compiling():
        return ahead.pending if ahead is not None else issue_plain_restore(controller, shards, slot_expert_U)
    needs_grad = torch.is_grad_enabled() and any(shard.requires_grad for shard in shards)
    anchor = torch.empty(0, device=shards[0].device, requires_grad=needs_grad)
    source = controller.restore
    block = source.block() if source is not None and source.block is not None else None
    if needs_grad and block is not None:  # the deferred reduction's path to the parameters: views made here,
        shards = source.shards()  # eagerly (the graph's may come out of a compiled region, one backward node)
    return _RestoreExchange.apply(anchor, list(shards), slot_expert_U, controller, ahead)


# ----------------------------------------------------------------------------------------------
# Prefetch: a block issues the restore of the next blocks behind its own expert compute.
# ----------------------------------------------------------------------------------------------


@dataclass
class RestoreSource:
    """What a restore needs besides the table: the block's expert parameters (by name, read when issued, so
    the values are those of the step) and its group."""

    params: tuple[str, ...]
    group_name: str
    block: Callable[[], nn.Module | None] | None = None  # a weak reference to the block, set by chain_restores

    def shards(self) -> list[Tensor]:
        block = self.block() if self.block is not None else None
        assert block is not None, "a prefetch needs the FSEP block (chain_restores links it)"
        return [local_part(block.get_parameter(name)) for name in self.params]


@dataclass
class Prefetched:
    """A restore issued ahead by an earlier block: valid for the chain forward it was issued in and the
    table it gathered."""

    forward: int
    table: Tensor
    pending: Tensor


@dataclass
class PrefetchChain:
    """The FSEP blocks of one model in the order their forwards run (registration order, checked as they
    run). `forward` counts training forwards: it advances when a block enters at or before the position of
    the last one that entered. A prefetched restore that was not used (the blocks ran in another order, or
    one was skipped) is completed and dropped, and the chain stops prefetching (logged once): it never
    uses a restore issued for another forward or table. `ordered`: every forward so far ran the blocks in
    registration order from the first (the last ones may be skipped); once not, no block defers its gradient
    reduction (`FSEPPlacement.defers_reduction`)."""

    members: list[FSEPPlacement]
    forward: int = 0
    last: int = -1
    enabled: bool = True
    ordered: bool = True

    def entered(self, controller: FSEPPlacement) -> None:
        if controller.position <= self.last:
            self.forward += 1
            self.last = -1
        self.ordered = self.ordered and controller.position == self.last + 1
        self.last = controller.position

    def missed(self, controller: FSEPPlacement) -> None:
        if self.enabled:
            log.warning("FSEP restore prefetch is off from now: block %s ran without the restore an earlier block "
                        "issued for it in this forward (blocks run in another order than registered, or one was "
                        "skipped); every block restores its own experts instead", controller.block)
        self.enabled = False


@torch.compiler.disable  # the step's host logic: runs eagerly under torch.compile (a graph break)
def restore_issue(controller: FSEPPlacement, shards: list[Tensor], slot_expert_U: Tensor) -> Tensor:
    """Graph node: this block's restore (pending; `moe_comm.wait` completes it), prefetched or issued now."""
    if _shape_only() or not controller.training:  # a trace, a checkpoint recompute, eval: no prefetch state
        return exchange_restore(controller, shards, slot_expert_U)
    return controller.issue_restore(shards, slot_expert_U)


def _drop_unused(issued: list[tuple[FSEPPlacement, Prefetched]], grad: Tensor) -> None:
    """Backward hook of a prefetching block: the restores it issued that no later block used are stale now."""
    for later, entry in issued:
        if later._prefetched is entry:
            later._prefetched = None
            comm.WAIT(entry.pending)
            if later.chain is not None:
                later.chain.missed(later)


@torch.compiler.disable
def restore_prefetch(controller: FSEPPlacement, restored: Tensor) -> None:
    """Graph node, right after this block's restore is waited (`restored`), before its expert compute: issue
    the next blocks' restores so they travel behind this block's expert compute."""
    if controller.training and not _shape_only():
        controller.prefetch(restored)


fx.node.has_side_effect(restore_prefetch)


# ----------------------------------------------------------------------------------------------
# The placement controller: this step's table; planning off the critical path.
# ----------------------------------------------------------------------------------------------


Planner = Callable[[Tensor, tuple[int, ...]], Sequence[int]]


@dataclass
class Installed:
    """One installed placement: when, from what, what it costs (logged per layer and step)."""

    step: int
    table: tuple[int, ...]
    source: str  # "initial", the planner's candidate name, or "callable"
    wait_s: float = 0.0  # how long the forward that installed it waited for the worker
    solve_s: float = 0.0
    details: str = ""  # the planner's summary of its decision


DECISIONS_KEPT = 1024  # FSEPPlacement.decisions: the last installed tables kept


class FSEPPlacement(nn.Module):
    """The placement table of one FSEP block and the planner that changes it (see module doc)."""

    def __init__(self, block: str, config: placement.PlannerConfig, rank: int, planner: str | Planner,
                 table: placement.PlacementTable, restore: RestoreSource | None = None, prefetch_depth: int = 0,
                 defer_reduction: bool = True, device: torch.device | str = "cpu"):
        super().__init__()
        self.block, self.config, self.rank, self.planner = block, config, rank, planner
        self.restore = restore  # how to issue this block's restore from outside its graph (a prefetch)
        self.prefetch_depth = prefetch_depth  # later blocks whose restore this one issues ahead
        self.chain: PrefetchChain | None = None  # set by `chain_restores(model)`
        self.position = 0  # index in the chain
        self._advanced_in = -1  # the chain forward in which this controller last advanced
        self._prefetched: Prefetched | None = None
        self.prefetched_restores = 0  # restores of this block an earlier block issued (and this one used)
        self.slot_expert: Tensor
        # on the experts' device: the route and the restore's gather index the shards with it
        self.register_buffer("slot_expert", table.as_tensor(device), persistent=False)
        self.history = placement.CountHistory(config.history, config.W, config.E)
        self.step = 0
        # the last DECISIONS_KEPT installed tables (a log for explain and benchmarks: bounded, a long run's memory
        # stays flat), and how many were installed and changed the table over the whole run
        self.decisions: deque[Installed] = deque([Installed(0, table.slot_expert, "initial")], maxlen=DECISIONS_KEPT)
        self.installed = 1
        self.table_changes = 0
        self._pending: Future | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.defer_reduction = defer_reduction  # Plan.defer_expert_grads; False: the restore as plain ops, waited
        self.track_loads = False  # record per-device rows of every step (W x W*C work per step: for benchmarks)
        self.loads: list[dict[str, Any]] = []  # {"step", "fsep": [W] rows per device, "ep": [W] under EP}

    @property
    def defers_reduction(self) -> bool:
        """Whether this block's gradient reduction stays in flight after its restore's backward, until the next
        restore's backward: yes for every block of a chain after the first. The chain's first block (its
        backward runs last) completes its own at once, so every gradient reaches its parameter inside the
        model's backward, before callbacks queued at its start (`GradientSync`'s, DDP's) run; so does every block
        when the order is not known to be the chain's (no chain, blocks run in another order, or prefetching
        stopped)."""
        chain = self.chain
        return (self.defer_reduction and chain is not None and chain.enabled and chain.ordered
                and self.position > 0)

    @property
    def observes(self) -> bool:
        return self.planner != "static"

    @torch.compiler.disable  # runs eagerly under torch.compile (a graph break): it is the step's host logic
    def forward(self) -> Tensor:
        """This step's table: install the layout planned after the previous step first."""
        if self.training and not _shape_only():
            deferred().drop_stale()
            if self.chain is not None:
                self.chain.entered(self)
            self.advance()
        return self.slot_expert

    def advance(self) -> None:
        """Once per training forward (its own, or an earlier block's prefetch, whichever comes first): count
        the step and install the layout planned after the previous one."""
        if self.chain is not None:
            if self._advanced_in == self.chain.forward:
                return
            self._advanced_in = self.chain.forward
        self.step += 1
        if self._pending is not None:
            start = time.perf_counter()
            decision: Installed = self._pending.result()
            decision.wait_s = time.perf_counter() - start
            self._pending = None
            decision.step = self.step
            self.slot_expert = torch.tensor(decision.table, dtype=torch.int64, device=self.slot_expert.device)
            self.table_changes += tuple(decision.table) != tuple(self.decisions[-1].table)
            self.installed += 1
            self.decisions.append(decision)
            log.debug("%s step %d: %s", self.block, self.step, decision)

    def issue_restore(self, shards: list[Tensor], slot_expert_U: Tensor) -> Tensor:
        """This step's restore: the one an earlier block prefetched when it is still right, else issued now."""
        ahead, self._prefetched = self._prefetched, None
        if ahead is not None:
            if self.chain is not None and ahead.forward == self.chain.forward and torch.equal(ahead.table,
                                                                                               slot_expert_U):
                self.prefetched_restores += 1
                return exchange_restore(self, shards, slot_expert_U, ahead)
            comm.WAIT(ahead.pending)  # issued for a forward that did not run this block: complete and drop it
            if self.chain is not None:
                self.chain.missed(self)
        return exchange_restore(self, shards, slot_expert_U)

    def prefetch(self, restored: Tensor) -> None:
        """Issue the restore of the next `prefetch_depth` blocks of the chain that have none pending (their
        tables installed now, one forward early for them as for everyone: the same on every rank).

        A prefetched restore is good only within this forward: when the backward reaches this block (the
        gradient of its own `restored` buffer), any it issued that was not used is dropped and the chain stops
        prefetching — so a restore gathered before an optimizer step is never used after it."""
        if self.chain is None or not self.chain.enabled or not restored.requires_grad:
            return
        issued = []
        for later in self.chain.members[self.position + 1:self.position + 1 + self.prefetch_depth]:
            if later._prefetched is not None and later._prefetched.forward == self.chain.forward:
                continue
            if later._prefetched is not None:  # a stale one: complete it before issuing the next
                comm.WAIT(later._prefetched.pending)
            later.advance()
            table = later.slot_expert
            assert later.restore is not None
            # deferred: issued without autograd, which joins it in the later block's forward (`exchange_restore`)
            with torch.set_grad_enabled(torch.is_grad_enabled() and not later.defer_reduction):
                pending = issue_plain_restore(later, later.restore.shards(), table)
            later._prefetched = Prefetched(self.chain.forward, table, pending)
            issued.append((later, later._prefetched))
        if issued:
            restored.register_hook(functools.partial(_drop_unused, issued))

    def observe(self, counts_PE: Tensor) -> None:
        """Record this step's gathered counts; plan the next layout in the worker."""
        if not self.training or not self.observes or _shape_only():
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"moepass-fsep-{self.block}")
        current = tuple(int(e) for e in self.decisions[-1].table)
        self._pending = self._executor.submit(self._plan, counts_PE.detach(), current, self.step)

    def _plan(self, counts_PE: Tensor, current: tuple[int, ...], step: int) -> Installed:
        start = time.perf_counter()
        counts = counts_PE.to("cpu", torch.int64)
        c = self.config
        with self._lock:
            self.history.push(counts)
            summed = self.history.total()
            if self.track_loads:  # rows each device computed this step, and would have under plain EP
                table = placement.PlacementTable(current, c.W, c.C, c.ranks_per_node, c.E)
                fsep = placement.device_loads(placement.lite_route_counts(counts, table), c.C)
                self.loads.append({"step": step, "fsep": fsep.tolist(),
                                   "ep": [int(v) for v in ep_device_rows(counts)]})
        if callable(self.planner):
            proposed = self.planner(summed, current)
            try:
                table = placement.PlacementTable(tuple(int(e) for e in proposed), c.W, c.C, c.ranks_per_node, c.E)
            except ValueError as err:
                raise PlanError(f"Plan.planner={self.planner!r} returned an invalid table for block {self.block}: "
                                f"{err}") from err
            decision = Installed(0, table.slot_expert, "callable")
        else:
            chosen = placement.plan(summed, c)
            decision = Installed(0, chosen.table.slot_expert, chosen.candidate, details=chosen.summary())
        decision.solve_s = time.perf_counter() - start
        return decision

    def placement_state(self) -> dict[str, Any]:
        """What a checkpoint needs to continue this block's placements bit for bit: the step count, the
        table in use, the one planned for the next step (waits for the worker) and the count history."""
        pending = self._pending.result() if self._pending is not None else None
        with self._lock:
            history = self.history.state()
        return {"step": self.step, "table": list(self.decisions[-1].table),
                "next": None if pending is None else list(pending.table), "history": history}

    def load_placement_state(self, state: dict[str, Any]) -> None:
        """Continue from `placement_state()`'s record (same world size and experts): the table in use now, the
        next step's planned one installed at the next training forward, as if this run had planned it."""
        table = tuple(int(e) for e in state["table"])
        self.step = int(state["step"])
        self.history.load_state(state["history"])
        self.slot_expert = torch.tensor(table, dtype=torch.int64, device=self.slot_expert.device)
        self.decisions.append(Installed(self.step, table, "checkpoint"))
        self._pending = None
        if state["next"] is not None:
            done: Future = Future()
            done.set_result(Installed(0, tuple(int(e) for e in state["next"]), "checkpoint"))
            self._pending = done

    def __getstate__(self) -> dict[str, Any]:  # deepcopy / pickle: no thread, no pending work, no chain
        state = self.__dict__.copy()
        state.update(_pending=None, _executor=None, _lock=None, _prefetched=None, chain=None)
        if self.restore is not None:  # a copy is linked again by chain_restores, never to this block
            state["restore"] = dataclasses.replace(self.restore, block=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _fake() -> bool:
    """A fake-tensor trace (the verifier's shape propagation, explain)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def _shape_only() -> bool:
    """Not a training step: a fake-tensor trace, or a forward recomputed inside the backward (activation
    checkpointing), which must route with the table its forward used and record nothing."""
    return _fake() or torch._C._current_graph_task_id() != -1


@torch.compiler.disable  # hands tensors to a thread: runs eagerly under torch.compile (a graph break)
def observe_counts(controller: FSEPPlacement, counts_PE: Tensor) -> None:
    """Graph node: hand the gathered per-(rank, expert) counts to the block's controller."""
    controller.observe(counts_PE)


fx.node.has_side_effect(observe_counts)


@dataclass
class FSEPLayout(ExpertLayout):
    """FSEP's layout: shards of every expert (shard_dim 1), C slots per device, the block's controller."""

    slots: int = 0  # C
    controller: str = CONTROLLER  # child module of the block holding the table and the planner

    def describe(self, gm: nn.Module) -> list[str]:
        controller = gm.get_submodule(self.controller)
        assert isinstance(controller, FSEPPlacement)
        table = controller.decisions[-1].table
        C = self.slots
        lines = super().describe(gm)
        lines.append(f"placement ({C} slots per device, planner {controller.planner if isinstance(controller.planner, str) else 'callable'}):")
        lines += [f"  device {n}: experts {list(table[n * C:(n + 1) * C])}" for n in range(len(table) // C)]
        last = controller.decisions[-1]
        lines.append(f"last decision: step {last.step}, {last.source}" + (f": {last.details}" if last.details else ""))
        chain = controller.chain
        ahead = (f"issues the next {controller.prefetch_depth} FSEP blocks' restores behind its expert compute"
                 if controller.prefetch_depth else "no prefetch (Plan.prefetch_depth=0)")
        if chain is not None and not chain.enabled:
            ahead += " (off: the blocks did not run in module order)"
        lines.append(f"restore: {ahead}; {controller.prefetched_restores} of its own restores were prefetched")
        grads = ("in flight until the next FSEP block's restore backward (deferred)" if controller.defers_reduction
                 else "waited in its restore backward")
        lines.append(f"gradient slices: {grads}")
        return lines
