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
from dataclasses import dataclass

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
    """One op of a timeline as `Timeline.ops` shows it (the timeline keeps its ops as rows of plain values)."""

    stream: str
    name: str
    work: float
    deps: tuple[int, ...]
    ready: float = -1.0  # when its dependencies were done (set while simulating)
    start: float = -1.0
    end: float = -1.0
    pieces: int = 1  # equal pieces run back to back (`Timeline.add`)
    busy: float = 0.0  # seconds it ran (end - start less the pauses between its pieces)


class Timeline:
    """Ops added in program order (`add`), simulated once (`run`), then read (`step`, `busy`, `breakdown`,
    `ops`). Each op is kept as a row (stream index, name, work, deps, pieces) and its times as four columns:
    the search and the simulator lay out ~10^6 ops per `python -m cost_model`, and an object per op cost more
    than simulating it."""

    __slots__ = ("_rows", "_ready", "_start", "_end", "_busy")

    def __init__(self) -> None:
        self._rows: list[tuple[int, str, float, tuple[int, ...], int]] = []
        n0: list[float] = []
        self._ready, self._start, self._end, self._busy = n0, n0, n0, n0  # filled by `run`

    def add(self, stream: str, name: str, work: float, deps: tuple[int, ...] | list[int] = (), pieces: int = 1) -> int:
        """An op of `work` seconds after `deps`; `pieces` > 1: that many equal pieces of work / pieces, back to
        back (between two of them a "priority" timeline lets a ready all-to-all go first)."""
        k = _STREAM_INDEX.get(stream)
        if k is None:
            raise ValueError(f"stream={stream!r} is invalid: use one of {list(STREAMS)}")
        if pieces < 1:
            raise ValueError(f"pieces={pieces!r} is invalid: an op is one or more pieces")
        work = float(work)
        rows = self._rows
        rows.append((k, name, work if work > 0.0 else 0.0, tuple(deps), int(pieces)))
        return len(rows) - 1

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def ops(self) -> list[Op]:
        """The ops in issue order with their times (-1 before `run`): a copy, built on each read."""
        ops = [Op(STREAMS[k], name, work, deps, pieces=pieces) for k, name, work, deps, pieces in self._rows]
        if len(self._end) == len(ops):
            for op, ready, start, end, busy in zip(ops, self._ready, self._start, self._end, self._busy):
                op.ready, op.start, op.end, op.busy = ready, start, end, busy
        return ops

    def run(self, policy: str = "fair") -> Timeline:
        """Simulate in place; returns self. Each op counts its dependencies not yet done (an op finishing
        decrements its users'), so a stream's head is ready when its count is 0. Streams by index:
        0 compute, 1 a2a, 2 other (`STREAMS`); the running op of stream k, its remaining work (of the running
        piece) and the seconds it has run are locals (r_k, w_k, b_k: one event per op start or piece end; a
        step of a large case has ~10^4 ops and the search lays out thousands of steps). Only an "other" op
        is ever paused (priority), so one slot holds it (p2, with its w and b)."""
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is invalid: use one of {list(POLICIES)}")
        rows = self._rows
        n = len(rows)
        q0: list[int] = []
        q1: list[int] = []
        q2: list[int] = []
        queues = (q0, q1, q2)
        users: list[list[int]] = [[] for _ in range(n)]
        pending = [0] * n
        piece = [0.0] * n  # work of one piece
        left = [0] * n  # pieces after the running one
        for i, (k, _, work, deps, pieces) in enumerate(rows):
            queues[k].append(i)
            pending[i] = len(deps)
            for d in deps:
                users[d].append(i)
            piece[i] = work / pieces
            left[i] = pieces - 1
        n0, n1, n2 = len(q0), len(q1), len(q2)
        h0 = h1 = h2 = 0  # each stream's head (next op to start)
        r0 = r1 = r2 = -1  # the op running on each stream, -1: none
        w0 = w1 = w2 = 0.0  # work left of the running piece
        b0 = b1 = b2 = 0.0  # seconds the running op has run
        p2, pw2, pb2 = -1, 0.0, 0.0  # a pieced "other" op that yielded to an all-to-all, resumed first
        busy = [0.0] * n
        ready_at = [-1.0] * n
        start_at = [-1.0] * n
        end_at = [-1.0] * n
        now = 0.0
        priority = policy == "priority"
        inf = float("inf")

        def done(i: int, at: float, ran: float) -> int:
            """Op i's last piece ended at `at` after `ran` seconds: record it, release its users; -1 (none runs)."""
            end_at[i], busy[i] = at, ran
            for u in users[i]:
                pending[u] -= 1
            return -1

        while True:
            # start what may start, stream by stream in index order
            if r0 < 0 and h0 < n0:
                i = q0[h0]
                if pending[i] == 0:
                    if ready_at[i] < 0:
                        ready_at[i] = now
                    r0, w0, b0 = i, piece[i], 0.0
                    start_at[i] = now
                    h0 += 1
            if r1 < 0 and h1 < n1:
                i = q1[h1]
                if pending[i] == 0:
                    if ready_at[i] < 0:
                        ready_at[i] = now
                    if not (priority and r2 >= 0):
                        r1, w1, b1 = i, piece[i], 0.0
                        start_at[i] = now
                        h1 += 1
            if r2 < 0:
                i = p2 if p2 >= 0 else (q2[h2] if h2 < n2 and pending[q2[h2]] == 0 else -1)
                if i >= 0:
                    if ready_at[i] < 0:
                        ready_at[i] = now
                    if not (priority and (r1 >= 0 or (h1 < n1 and pending[q1[h1]] == 0))):
                        r2 = i
                        if p2 == i:
                            p2, w2, b2 = -1, pw2, pb2
                        else:
                            w2, b2 = piece[i], 0.0
                            start_at[i] = now
                            h2 += 1
            if r0 < 0 and r1 < 0 and r2 < 0:
                break
            shared = 0.5 if (r1 >= 0 and r2 >= 0) else 1.0
            dt = w0 if r0 >= 0 else inf
            if r1 >= 0 and w1 / shared < dt:
                dt = w1 / shared
            if r2 >= 0 and w2 / shared < dt:
                dt = w2 / shared
            now += dt
            # advance each running op; at the end of a piece with more to come, the next piece (between0/1/2)
            if r0 >= 0:
                w0 -= dt
                b0 += dt
            if r1 >= 0:
                w1 -= dt * shared
                b1 += dt
            if r2 >= 0:
                w2 -= dt * shared
                b2 += dt
            between0 = r0 >= 0 and w0 <= 1e-15
            between1 = r1 >= 0 and w1 <= 1e-15
            between2 = r2 >= 0 and w2 <= 1e-15
            if between0 and not left[r0]:
                between0, r0 = False, done(r0, now, b0)
            if between1 and not left[r1]:
                between1, r1 = False, done(r1, now, b1)
            if between2 and not left[r2]:
                between2, r2 = False, done(r2, now, b2)
            if between0:
                left[r0] -= 1
                w0 = piece[r0]
            if between1:
                left[r1] -= 1
                w1 = piece[r1]
            if between2:  # (priority) a ready all-to-all goes before the next piece
                left[r2] -= 1
                w2 = piece[r2]
                if priority and r1 < 0 and h1 < n1 and pending[q1[h1]] == 0:
                    p2, pw2, pb2 = r2, w2, b2
                    r2 = -1
        self._ready, self._start, self._end, self._busy = ready_at, start_at, end_at, busy
        if n and min(end_at) < 0:
            stuck = next(rows[i][1] for i in range(n) if end_at[i] < 0)
            raise ValueError(f"timeline deadlocked at {stuck!r}: a dependency is issued after its user on its stream")
        return self

    # ---- what the timeline says ----------------------------------------------------------------

    @property
    def step(self) -> float:
        return max(self._end, default=0.0)

    def busy(self, stream: str) -> float:
        k = _STREAM_INDEX[stream]
        return sum(b for row, b in zip(self._rows, self._busy) if row[0] == k)

    def breakdown(self) -> dict[str, float]:
        """compute (busy), exposed a2a (compute idle before its last op), exposed other comm (the tail). One
        pass over the ops, each stream's sums in issue order."""
        step = last_compute = float("-inf")
        busy = a2a_busy = other_busy = 0.0
        wait = float("-inf")
        for (k, _, work, _, _), ready, start, end, ran in zip(self._rows, self._ready, self._start, self._end,
                                                              self._busy):
            if end > step:
                step = end
            if k == 0:
                busy += work
                if end > last_compute:
                    last_compute = end
            elif k == 1:
                a2a_busy += ran
                if start - ready > wait:
                    wait = start - ready
            else:
                other_busy += ran
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
