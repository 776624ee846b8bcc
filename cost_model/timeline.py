"""A per-step timeline of one rank: a compute stream and two communication streams sharing a network.

Ops are issued in program order per stream (a stream never reorders: ranks would disagree and hang)
and start when their dependencies are done. The all-to-all stream ("a2a") and the other-
communication stream ("other": gradient all-reduce) share the network:

- "fair": both run at once, each at half speed (DeepSpeed-MoE / DDP: NCCL streams fair-share).
- "priority" (Lina): an "other" op starts only when no all-to-all is ready or running; one already
  running is not pre-empted, so an all-to-all waits behind at most one micro-op.

An op may be `pieces` equal pieces issued back to back (a gradient all-reduce in DDP buckets or Lina's
micro-ops): the same as that many ops, one after the other, but laid out as one, so a step of many
buckets stays cheap to simulate. Under "priority" it yields to a ready all-to-all between its pieces.

Work is in seconds at full speed. A fluid model: rates change only when an op starts or ends.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

STREAMS = ("compute", "a2a", "other")
POLICIES = ("fair", "priority")
_STREAM_INDEX = {s: k for k, s in enumerate(STREAMS)}


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, as it was after. A step is ~10^3-10^4 small ops
    and lists that live until the step is priced (no cycles among them): the collector's passes over them, not
    the simulation, were a third of `python -m cost_model`'s time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(slots=True)
class Op:
    stream: str
    name: str
    work: float
    deps: tuple[int, ...]
    ready: float = -1.0  # when its dependencies were done (set while simulating)
    start: float = -1.0
    end: float = -1.0
    pieces: int = 1  # equal pieces run back to back (`Timeline.add`)
    busy: float = 0.0  # seconds it ran (end - start less the pauses between its pieces)


@dataclass
class Timeline:
    ops: list[Op] = field(default_factory=list)

    def add(self, stream: str, name: str, work: float, deps: tuple[int, ...] | list[int] = (), pieces: int = 1) -> int:
        """An op of `work` seconds after `deps`; `pieces` > 1: that many equal pieces of work / pieces, back to
        back (between two of them a "priority" timeline lets a ready all-to-all go first)."""
        if stream not in _STREAM_INDEX:
            raise ValueError(f"stream={stream!r} is invalid: use one of {list(STREAMS)}")
        if pieces < 1:
            raise ValueError(f"pieces={pieces!r} is invalid: an op is one or more pieces")
        ops = self.ops
        work = float(work)
        ops.append(Op(stream, name, work if work > 0.0 else 0.0, tuple(deps), pieces=int(pieces)))
        return len(ops) - 1

    def run(self, policy: str = "fair") -> Timeline:
        """Simulate in place; returns self. Each op counts its dependencies not yet done (an op finishing
        decrements its users'), so a stream's head is ready when its count is 0. Streams by index:
        0 compute, 1 a2a, 2 other (`STREAMS`). The loop keeps its state in flat lists (one event per op start
        or piece end; a step of a large case has ~10^4 ops and the search lays out thousands of steps)."""
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is invalid: use one of {list(POLICIES)}")
        ops = self.ops
        n = len(ops)
        queues: list[list[int]] = [[], [], []]
        users: list[list[int]] = [[] for _ in range(n)]
        pending = [0] * n
        piece = [0.0] * n  # work of one piece
        left = [0] * n  # pieces after the running one
        for i, op in enumerate(ops):
            queues[_STREAM_INDEX[op.stream]].append(i)
            pending[i] = len(op.deps)
            for d in op.deps:
                users[d].append(i)
            piece[i] = op.work / op.pieces
            left[i] = op.pieces - 1
        sizes = [len(q) for q in queues]
        head = [0, 0, 0]
        running = [-1, -1, -1]  # the op running on each stream, -1: none
        paused = [-1, -1, -1]  # a pieced op that yielded to an all-to-all, resumed first on its stream
        remaining = [0.0] * n  # of the running piece
        busy = [0.0] * n
        ready_at = [-1.0] * n
        start_at = [-1.0] * n
        end_at = [-1.0] * n
        finished = 0
        now = 0.0
        priority = policy == "priority"
        inf = float("inf")

        def next_ready(k: int) -> int:
            if paused[k] >= 0:
                return paused[k]
            h = head[k]
            if h >= sizes[k]:
                return -1
            i = queues[k][h]
            return i if pending[i] == 0 else -1

        while True:
            for k in (0, 1, 2):  # start what may start
                if running[k] >= 0:
                    continue
                i = next_ready(k)
                if i < 0:
                    continue
                if ready_at[i] < 0:
                    ready_at[i] = now
                if priority and ((k == 2 and (running[1] >= 0 or next_ready(1) >= 0)) or (k == 1 and running[2] >= 0)):
                    continue
                running[k] = i
                if paused[k] == i:
                    paused[k] = -1
                    continue
                start_at[i] = now
                remaining[i] = piece[i]
                head[k] += 1
            r0, r1, r2 = running
            if r0 < 0 and r1 < 0 and r2 < 0:
                break
            shared = 0.5 if (r1 >= 0 and r2 >= 0) else 1.0
            dt = remaining[r0] if r0 >= 0 else inf
            if r1 >= 0 and remaining[r1] / shared < dt:
                dt = remaining[r1] / shared
            if r2 >= 0 and remaining[r2] / shared < dt:
                dt = remaining[r2] / shared
            now += dt
            between: list[int] = []  # streams whose pieced op is at the end of a piece, more to come
            for k in (0, 1, 2):
                i = running[k]
                if i < 0:
                    continue
                remaining[i] -= dt * (1.0 if k == 0 else shared)
                busy[i] += dt
                if remaining[i] <= 1e-15:
                    if left[i] > 0:
                        between.append(k)
                        continue
                    end_at[i] = now
                    finished += 1
                    for u in users[i]:
                        pending[u] -= 1
                    running[k] = -1
            for k in between:  # the next piece, unless (priority) a ready all-to-all goes before an "other" one
                i = running[k]
                left[i] -= 1
                remaining[i] = piece[i]
                if priority and k == 2 and running[1] < 0 and next_ready(1) >= 0:
                    running[k] = -1
                    paused[k] = i
        for i, op in enumerate(ops):
            op.ready, op.start, op.end, op.busy = ready_at[i], start_at[i], end_at[i], busy[i]
        if finished < n:
            stuck = next(op.name for op in ops if op.end < 0)
            raise ValueError(f"timeline deadlocked at {stuck!r}: a dependency is issued after its user on its stream")
        return self

    # ---- what the timeline says ----------------------------------------------------------------

    @property
    def step(self) -> float:
        return max((op.end for op in self.ops), default=0.0)

    def busy(self, stream: str) -> float:
        return sum(op.busy for op in self.ops if op.stream == stream)

    def breakdown(self) -> dict[str, float]:
        """compute (busy), exposed a2a (compute idle before its last op), exposed other comm (the tail). One
        pass over the ops, each stream's sums in issue order."""
        step = last_compute = float("-inf")
        busy = a2a_busy = other_busy = 0.0
        wait = float("-inf")
        for op in self.ops:
            end = op.end
            if end > step:
                step = end
            stream = op.stream
            if stream == "compute":
                busy += op.work
                if end > last_compute:
                    last_compute = end
            elif stream == "a2a":
                a2a_busy += op.busy
                if op.start - op.ready > wait:
                    wait = op.start - op.ready
            else:
                other_busy += op.busy
        step = 0.0 if step == float("-inf") else step
        last_compute = 0.0 if last_compute == float("-inf") else last_compute
        return {
            "compute": busy,
            "exposed_a2a": last_compute - busy,
            "exposed_other": step - last_compute,
            "a2a_busy": a2a_busy,
            "other_busy": other_busy,
            "max_a2a_wait": 0.0 if wait == float("-inf") else wait,
        }
