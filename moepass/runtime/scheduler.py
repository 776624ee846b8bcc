"""The priority scheduler for gradient synchronisation (Lina, ATC'23) and the collective callback registry.

Collective registry (the hook the EP collectives call; tiny on purpose):

    work = issue_collective(kind, group_name, nbytes, launch)   # launch() -> dist Work (async_op=True)

Every listener (`add_listener`) hears `queued(kind, category, group_name, nbytes) -> token` BEFORE the
launch, so a scheduler knows an all-to-all is queued before any byte moves, `completed(token,
end)` when the collective has finished (`on_completion`: the work's future on gloo; on NCCL, whose
future completes at enqueue, the work polled with `is_completed()`), and, if it defines it, `waited(token, time)`
when the consumer starts waiting for the result (`notify_waited(issued)`, `issued` the list
`issue_collective` filled): a collective in flight between queued and waited overlapped whatever ran
in between. `moepass.runtime.collectives._issue` launches every `moe_comm` all-to-all (counts,
dispatch, combine and their backward) through it; the scheduler's own all-reduce micro-ops go
through it too (category "all_reduce"), which is how the event log sees both. With no listener it is
just `launch()`. Marks (`notify_mark`) come from the `moe_sched.mark` op that the schedule pass puts
in the graph: "moe_combine" in backward means "the backward is inside an MoE combine" (an
all-to-all is imminent).

Priority rule (one `PriorityScheduler` per rank, its own process group):
  - gradients of replicated (non-expert) parameters are cut into micro-ops of `micro_op_bytes`
    (every tensor cut on its own, no cross-tensor bucketing); with `expert_replicas=True` so are the
    gradients of experts several replicas hold (summed over their replicas' group; a micro-op names
    its group);
  - a micro-op is launched only when no all-to-all is queued or running, backward is not inside an
    MoE combine, and no other micro-op is in flight (at most one) — so an all-to-all waits behind at
    most one all-reduce micro-op;
  - micro-ops launch in one fixed order on every rank (reverse parameter order for `DataParallel`,
    DDP's bucket order for the comm hook): the scheduler delays collectives, it never reorders them
    within its group (otherwise ranks disagree and hang).

The ways in (`GradientSync`, `DataParallel`, the DDP comm hook, FSDP2): `moepass.runtime.grad_sync`.

Threads: a small daemon thread per scheduler launches micro-ops when the rule allows; completions
come from `work.get_future()` callbacks. Waiting for the last micro-op is bounded by the group timeout.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moepass import eager
from moepass.dialect import WGRAD_SINK, WeightGradSink
from moepass.process_state import COMPLETION_WATCHER, LISTENERS

A2A = "all_to_all"
ALL_REDUCE = "all_reduce"

# torch 2.13's names of the single-tensor all-gather / reduce-scatter (the old ones warn, deprecated); older
# releases (a GPU machine's torch 2.11, say) have only the old ones
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# ----------------------------------------------------------------------------------------------
# The registry (`moepass.process_state.LISTENERS`).
# ----------------------------------------------------------------------------------------------

def add_listener(listener: Any) -> None:
    """`listener` has queued(kind, category, group_name, nbytes) -> token, completed(token, end_time),
    mark(name, phase)."""
    if listener not in LISTENERS:
        LISTENERS.append(listener)


def remove_listener(listener: Any) -> None:
    if listener in LISTENERS:
        LISTENERS.remove(listener)


def issue_collective(kind: str, group_name: str, nbytes: int, launch: Callable[[], Any], category: str = A2A,
                     issued: list[tuple[Any, Any]] | None = None) -> Any:
    """Launch one asynchronous collective, telling every listener before the launch and when its
    work's future completes (one completion time, taken before any listener hears of it). `issued`,
    if given, receives the (listener, token) pairs for `notify_waited`."""
    if not LISTENERS:
        return launch()
    listeners = list(LISTENERS)
    tokens = [lst.queued(kind, category, group_name, nbytes) for lst in listeners]
    if issued is not None:
        issued.extend(zip(listeners, tokens))
    work = launch()

    def completed() -> None:
        end = time.perf_counter()
        for lst, token in zip(listeners, tokens):
            lst.completed(token, end)

    return on_completion(work, completed)


def on_completion(work: Any, callback: Callable[[], None]) -> Any:
    """Call `callback()` once the collective of `work` has finished; returns the work (`with_future`).

    gloo: the work's future completes when the transfer is done. NCCL: it completes when the kernel is
    enqueued (torch's `Work.get_future` doc: "does not wait for the entire operation to complete on
    GPU"), so a work whose future is already done but that is not `is_completed()` (a CUDA event query)
    is polled by one watcher thread instead; the all-to-all is then pending until the GPU finished it."""
    work = with_future(work)
    future = work.get_future()
    if future.done() and not work.is_completed():
        COMPLETION_WATCHER.get(CompletionWatcher).add(work, callback)
    else:
        future.then(lambda fut: callback())
    return work


class CompletionWatcher:
    """One daemon thread that polls `is_completed()` of the works `on_completion` hands it (every
    `poll_s` while any is pending, asleep otherwise) and calls their callbacks in the order they came."""

    def __init__(self, poll_s: float = 1e-4):
        self.poll_s = poll_s
        self._cond = threading.Condition()
        self._pending: list[tuple[Any, Callable[[], None]]] = []
        self._thread: threading.Thread | None = None

    def add(self, work: Any, callback: Callable[[], None]) -> None:
        with self._cond:
            self._pending.append((work, callback))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="moepass-completion", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    @staticmethod
    def _finished(work: Any) -> bool:
        try:
            return bool(work.is_completed())
        except RuntimeError:  # the collective failed: its consumer's wait raises; nothing is pending any more
            return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending))
                pending = list(self._pending)
            done = [item for item in pending if self._finished(item[0])]
            if not done:
                time.sleep(self.poll_s)
                continue
            with self._cond:
                for item in done:
                    self._pending.remove(item)
            for _, callback in done:
                callback()


class FutureOnWait:
    """A backend work that has no future (gloo's reduce-scatter: `Work::getFuture not implemented`),
    given one that completes when `wait()` returns (on such a backend `wait` blocks until it is done)."""

    def __init__(self, work: Any):
        self.work = work
        self.future: torch.futures.Future[None] = torch.futures.Future()

    def wait(self, timeout: timedelta | None = None) -> bool:
        done = self.work.wait() if timeout is None else self.work.wait(timeout)
        if not self.future.done():
            self.future.set_result(None)
        return done

    def get_future(self) -> torch.futures.Future[None]:
        return self.future

    def is_completed(self) -> bool:
        return self.future.done()


def with_future(work: Any) -> Any:
    """`work` if its backend gives it a future, else `FutureOnWait(work)`."""
    try:
        work.get_future()
    except RuntimeError:
        return FutureOnWait(work)
    return work


def notify_waited(issued: list[tuple[Any, Any]]) -> None:
    """The consumer of a collective `issue_collective(..., issued=issued)` launched starts waiting for it."""
    now = time.perf_counter()
    for lst, token in issued:
        waited = getattr(lst, "waited", None)
        if waited is not None:
            waited(token, now)


def notify_mark(name: str, phase: str) -> None:
    """A `moe_sched.mark` node ran: phase "forward" or "backward"."""
    for lst in list(LISTENERS):
        lst.mark(name, phase)


# ----------------------------------------------------------------------------------------------
# moe_sched.mark: an identity op that tells the listeners when forward / backward reaches it.
# ----------------------------------------------------------------------------------------------

_lib = torch.library.Library("moe_sched", "FRAGMENT")
_lib.define("mark(Tensor(a) t, str name) -> Tensor(a)")


class _Mark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, name: str) -> Tensor:
        ctx.name = name
        if LISTENERS and not isinstance(t, torch._subclasses.FakeTensor):
            notify_mark(name, "forward")
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if LISTENERS:
            notify_mark(ctx.name, "backward")
        return grad, None


def _mark_impl(t: Tensor, name: str) -> Tensor:
    return _Mark.apply(t, name)


_lib.impl("mark", _mark_impl, "CompositeImplicitAutograd")
MARK = torch.ops.moe_sched.mark.default
eager.register(MARK, eager.EagerOp(MARK, _mark_impl))  # the eager path calls the autograd.Function directly
COMBINE_REGION = "moe_combine"
WGRAD_IN, WGRAD_OUT = "wgrad_in", "wgrad_out"  # backward marks around deferred expert weight GEMMs


# ----------------------------------------------------------------------------------------------
# moe_sched.defer_wgrad: an identity on an expert weight operand whose autograd node receives that
# weight's gradient later (Lancet; the protocol is `moepass.dialect.WeightGradSink`).
# ----------------------------------------------------------------------------------------------

_lib.define("defer_wgrad(Tensor(a) w) -> Tensor(a)")


class _DeferWgrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: Tensor) -> Tensor:
        out = w.view_as(w)
        ctx.sink = None
        if not isinstance(w, torch._subclasses.FakeTensor):
            ctx.sink = WeightGradSink()
            setattr(out, WGRAD_SINK, ctx.sink)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        sink, ctx.sink = ctx.sink, None
        if sink is None or sink.pending is None:  # the expert FFN did not defer: its gradient is `grad`
            return grad
        first = not sink.pending.done  # the whole call's weight GEMMs run now
        if first and LISTENERS:
            notify_mark(WGRAD_IN, "backward")
        real = sink.take()
        if first and LISTENERS:
            notify_mark(WGRAD_OUT, "backward")
        return real


def _defer_wgrad_impl(w: Tensor) -> Tensor:
    if torch.compiler.is_compiling():  # traced graphs keep the expert FFN's own weight gradient
        return w.view_as(w)
    return _DeferWgrad.apply(w)


_lib.impl("defer_wgrad", _defer_wgrad_impl, "CompositeImplicitAutograd")
DEFER_WGRAD = torch.ops.moe_sched.defer_wgrad.default
eager.register(DEFER_WGRAD, eager.EagerOp(DEFER_WGRAD, _defer_wgrad_impl))


# ----------------------------------------------------------------------------------------------
# The scheduler.
# ----------------------------------------------------------------------------------------------


@dataclass
class MicroOp:
    flat: Tensor | None = None  # a contiguous 1-D view of the gradient bytes to all-reduce
    group: dist.ProcessGroup | None = None  # None: the scheduler's own group
    done: threading.Event = field(default_factory=threading.Event)
    on_done: Callable[[], None] | None = None


class PriorityScheduler:
    """One per rank. Launches all-reduce micro-ops on its own group when the priority rule allows."""

    def __init__(self, micro_op_bytes: int, group: dist.ProcessGroup | None = None, timeout: float = 600.0,
                 enabled: bool = True):
        if micro_op_bytes < 1:
            raise ValueError(f"PriorityScheduler(micro_op_bytes={micro_op_bytes}): use a positive byte count")
        self.micro_op_bytes = int(micro_op_bytes)
        ranks = list(range(dist.get_world_size()))
        self.group = group if group is not None else dist.new_group(ranks, timeout=timedelta(seconds=timeout),
                                                                    group_desc="moepass_grad_allreduce")
        self.world = dist.get_world_size(self.group)
        self.timeout = timeout
        self.enabled = enabled  # False: launch as soon as ready (no priority) — the control in tests
        self._cond = threading.Condition(threading.RLock())
        self._queue: deque[MicroOp] = deque()  # FIFO; the head launches first, never reordered
        self._a2a_pending = 0
        self._in_combine = False
        self._inflight = 0
        self._stop = False
        self.launched = 0
        self._thread = threading.Thread(target=self._loop, name="moepass-priority", daemon=True)
        self._thread.start()
        add_listener(self)

    # -- listener side --------------------------------------------------------------------------
    def queued(self, kind: str, category: str, group_name: str, nbytes: int) -> Any:
        if category != A2A:
            return None
        with self._cond:
            self._a2a_pending += 1
            self._in_combine = False  # the all-to-all the combine region was waiting for is here
        return True

    def completed(self, token: Any, end: float) -> None:
        if token is None:
            return
        with self._cond:
            self._a2a_pending -= 1
            self._cond.notify_all()

    def mark(self, name: str, phase: str) -> None:
        if name == COMBINE_REGION and phase == "backward":
            with self._cond:
                self._in_combine = True

    # -- micro-ops ----------------------------------------------------------------------------
    def cut(self, flat: Tensor) -> list[Tensor]:
        """Equal micro-ops of at most `micro_op_bytes` (the last may be shorter) of a 1-D tensor."""
        per = max(1, self.micro_op_bytes // flat.element_size())
        return list(flat.split(per)) if flat.numel() else []

    def submit(self, op: MicroOp) -> None:
        """Append to the FIFO (callers submit in the same order on every rank)."""
        with self._cond:
            self._queue.append(op)
            self._cond.notify_all()

    def placeholder(self, group: dist.ProcessGroup | None = None) -> MicroOp:
        """A slot reserved in the FIFO now, filled (`fill`) when its gradient is ready (on `group`;
        None: the scheduler's own)."""
        op = MicroOp(group=group)
        self.submit(op)
        return op

    def fill(self, op: MicroOp, flat: Tensor) -> None:
        with self._cond:
            op.flat = flat
            self._cond.notify_all()

    def end_backward(self) -> None:
        """Backward is over: nothing is imminent any more."""
        with self._cond:
            self._in_combine = False
            self._cond.notify_all()

    def _can_launch(self) -> bool:
        if not self._queue or self._queue[0].flat is None:
            return False
        if not self.enabled:
            return True
        return self._a2a_pending == 0 and not self._in_combine and self._inflight == 0

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._can_launch())
                if self._stop:
                    return
                op = self._queue.popleft()
                self._inflight += 1
                self.launched += 1
                flat, group = op.flat, op.group or self.group
                assert flat is not None
                world = dist.get_world_size(group)
                nbytes = 2 * (world - 1) * flat.numel() * flat.element_size() // max(world, 1)
                work = issue_collective("grad_allreduce", group.group_name, nbytes,
                                        lambda: dist.all_reduce(flat, group=group, async_op=True),
                                        category=ALL_REDUCE)
                on_completion(work, functools.partial(self._op_done, op))

    def _op_done(self, op: MicroOp) -> None:
        if op.on_done is not None:
            op.on_done()
        with self._cond:
            self._inflight -= 1
            op.done.set()
            self._cond.notify_all()

    def launch_now(self, kind: str, group: dist.ProcessGroup, nbytes: int, launch: Callable[[], Any]) -> Any:
        """Launch one collective from the calling thread as soon as the rule allows, and return its work:
        for callers whose next statement reads the result on their own stream (FSDP2's all-gather and
        reduce-scatter, `FSDPReduceScatter`), so the launch cannot be handed to the scheduler's thread.
        Waits (bounded by the timeout) until no all-to-all is queued or running and no micro-op is in
        flight; it does not wait for the combine-region mark: the all-to-all that mark announces is
        issued by this same thread, so waiting for it would deadlock. Launches in the caller's order
        (its own group: delayed, never reordered)."""
        with self._cond:
            allowed = self._cond.wait_for(lambda: not self.enabled or (self._a2a_pending == 0 and self._inflight == 0),
                                          timeout=self.timeout)
            if not allowed:
                raise TimeoutError(f"moepass priority scheduler: {kind} waited {self.timeout:.0f} s for the all-to-alls "
                                   f"and micro-ops in flight (a peer is dead or ranks issued different collectives)")
            self._inflight += 1
            self.launched += 1
        op = MicroOp()
        try:
            work = issue_collective(kind, group.group_name, nbytes, launch, category=ALL_REDUCE)
        except BaseException:
            self._op_done(op)
            raise
        return on_completion(work, functools.partial(self._op_done, op))

    def wait(self, ops: list[MicroOp]) -> None:
        deadline = time.monotonic() + self.timeout
        for op in ops:
            if not op.done.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"moepass priority scheduler: a gradient all-reduce micro-op did not finish within "
                                   f"{self.timeout:.0f} s (a peer is dead or ranks issued different collectives)")

    def close(self) -> None:
        remove_listener(self)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(5)
