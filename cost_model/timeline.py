"""A per-step timeline of one rank: a compute stream and two communication streams sharing a network.

Ops are issued in program order per stream (a stream never reorders: ranks would disagree and hang)
and start when their dependencies are done. The all-to-all stream ("a2a") and the other-
communication stream ("other": gradient all-reduce) share the network:

- "fair": both run at once, each at half speed (DeepSpeed-MoE / DDP: NCCL streams fair-share).
- "priority" (Lina): an "other" op starts only when no all-to-all is ready or running; one already
  running is not pre-empted, so an all-to-all waits behind at most one micro-op.

Work is in seconds at full speed. A fluid model: rates change only when an op starts or ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STREAMS = ("compute", "a2a", "other")
POLICIES = ("fair", "priority")


@dataclass
class Op:
    stream: str
    name: str
    work: float
    deps: tuple[int, ...]
    ready: float = -1.0  # when its dependencies were done (set while simulating)
    start: float = -1.0
    end: float = -1.0


@dataclass
class Timeline:
    ops: list[Op] = field(default_factory=list)

    def add(self, stream: str, name: str, work: float, deps: tuple[int, ...] | list[int] = ()) -> int:
        if stream not in STREAMS:
            raise ValueError(f"stream={stream!r} is invalid: use one of {list(STREAMS)}")
        self.ops.append(Op(stream, name, max(0.0, float(work)), tuple(deps)))
        return len(self.ops) - 1

    def run(self, policy: str = "fair") -> Timeline:
        """Simulate in place; returns self."""
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is invalid: use one of {list(POLICIES)}")
        queues = {s: [i for i, op in enumerate(self.ops) if op.stream == s] for s in STREAMS}
        head = dict.fromkeys(STREAMS, 0)
        running: dict[str, int] = {}
        remaining: dict[int, float] = {}
        done = [False] * len(self.ops)
        now = 0.0

        def next_ready(stream: str) -> int | None:
            q = queues[stream]
            if head[stream] >= len(q):
                return None
            i = q[head[stream]]
            return i if all(done[d] for d in self.ops[i].deps) else None

        while True:
            for stream in STREAMS:  # start what may start
                if stream in running:
                    continue
                i = next_ready(stream)
                if i is None:
                    continue
                op = self.ops[i]
                if op.ready < 0:
                    op.ready = now
                if policy == "priority" and stream == "other" and ("a2a" in running or next_ready("a2a") is not None):
                    continue
                if policy == "priority" and stream == "a2a" and "other" in running:
                    continue
                op.start = now
                running[stream] = i
                remaining[i] = op.work
                head[stream] += 1
            if not running:
                break
            shared = 0.5 if ("a2a" in running and "other" in running) else 1.0
            rate = {s: (shared if s != "compute" else 1.0) for s in running}
            dt = min(remaining[i] / rate[s] for s, i in running.items())
            now += dt
            for s, i in list(running.items()):
                remaining[i] -= dt * rate[s]
                if remaining[i] <= 1e-15:
                    self.ops[i].end = now
                    done[i] = True
                    del running[s]
        if not all(done):
            stuck = next(op.name for op, d in zip(self.ops, done) if not d)
            raise ValueError(f"timeline deadlocked at {stuck!r}: a dependency is issued after its user on its stream")
        return self

    # ---- what the timeline says ----------------------------------------------------------------

    @property
    def step(self) -> float:
        return max((op.end for op in self.ops), default=0.0)

    def busy(self, stream: str) -> float:
        return sum(op.end - op.start for op in self.ops if op.stream == stream)

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
