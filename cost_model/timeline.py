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

from dataclasses import dataclass, field

STREAMS = ("compute", "a2a", "other")
POLICIES = ("fair", "priority")


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
        if stream not in STREAMS:
            raise ValueError(f"stream={stream!r} is invalid: use one of {list(STREAMS)}")
        if pieces < 1:
            raise ValueError(f"pieces={pieces!r} is invalid: an op is one or more pieces")
        self.ops.append(Op(stream, name, max(0.0, float(work)), tuple(deps), pieces=int(pieces)))
        return len(self.ops) - 1

    def run(self, policy: str = "fair") -> Timeline:
        """Simulate in place; returns self. Each op counts its dependencies not yet done (an op finishing
        decrements its users'), so a stream's head is ready when its count is 0. Streams by index:
        0 compute, 1 a2a, 2 other (`STREAMS`)."""
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is invalid: use one of {list(POLICIES)}")
        ops = self.ops
        n = len(ops)
        index = {s: k for k, s in enumerate(STREAMS)}
        queues: list[list[int]] = [[], [], []]
        users: list[list[int]] = [[] for _ in ops]
        pending = [len(op.deps) for op in ops]
        for i, op in enumerate(ops):
            queues[index[op.stream]].append(i)
            for d in op.deps:
                users[d].append(i)
        head = [0, 0, 0]
        running = [-1, -1, -1]  # the op running on each stream, -1: none
        paused = [-1, -1, -1]  # a pieced op that yielded to an all-to-all, resumed first on its stream
        remaining = [0.0] * n  # of the running piece
        left = [op.pieces - 1 for op in ops]  # pieces after the running one
        busy = [0.0] * n
        finished = 0
        now = 0.0
        priority = policy == "priority"

        def next_ready(k: int) -> int:
            if paused[k] >= 0:
                return paused[k]
            q = queues[k]
            h = head[k]
            if h >= len(q):
                return -1
            i = q[h]
            return i if pending[i] == 0 else -1

        while True:
            for k in (0, 1, 2):  # start what may start
                if running[k] >= 0:
                    continue
                i = next_ready(k)
                if i < 0:
                    continue
                op = ops[i]
                if op.ready < 0:
                    op.ready = now
                if priority and k == 2 and (running[1] >= 0 or next_ready(1) >= 0):
                    continue
                if priority and k == 1 and running[2] >= 0:
                    continue
                running[k] = i
                if paused[k] == i:
                    paused[k] = -1
                    continue
                op.start = now
                remaining[i] = op.work / op.pieces
                head[k] += 1
            if running[0] < 0 and running[1] < 0 and running[2] < 0:
                break
            shared = 0.5 if (running[1] >= 0 and running[2] >= 0) else 1.0
            dt = float("inf")
            for k in (0, 1, 2):
                i = running[k]
                if i >= 0:
                    t = remaining[i] / (1.0 if k == 0 else shared)
                    if t < dt:
                        dt = t
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
                    ops[i].end = now
                    finished += 1
                    for u in users[i]:
                        pending[u] -= 1
                    running[k] = -1
            for k in between:  # the next piece, unless (priority) a ready all-to-all goes before an "other" one
                i = running[k]
                left[i] -= 1
                remaining[i] = ops[i].work / ops[i].pieces
                if priority and k == 2 and running[1] < 0 and next_ready(1) >= 0:
                    running[k] = -1
                    paused[k] = i
        for op, b in zip(ops, busy):
            op.busy = b
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
        """compute (busy), exposed a2a (compute idle before its last op), exposed other comm (the tail)."""
        compute = [op for op in self.ops if op.stream == "compute"]
        last_compute = max((op.end for op in compute), default=0.0)
        busy = sum(op.work for op in compute)
        return {
            "compute": busy,
            "exposed_a2a": last_compute - busy,
            "exposed_other": self.step - last_compute,
            "a2a_busy": self.busy("a2a"),
            "other_busy": self.busy("other"),
            "max_a2a_wait": max((op.start - op.ready for op in self.ops if op.stream == "a2a"), default=0.0),
        }
