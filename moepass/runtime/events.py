"""Per-rank event log: every collective and compute region with start, end and bytes; a timeline plot.

    log = EventLog(rank).start()          # listens to moepass.runtime.scheduler's registry
    ... train ...
    log.stop(); events = log.events        # list of Event (picklable; merge ranks' lists to plot)
    plot_timeline(all_events, "timeline.png")   # PNG or SVG by suffix (matplotlib)

Collectives: start = when the collective was queued (the listener hears it before the launch), end
= when the collective finished (`scheduler.on_completion`: the work's future on gloo, `is_completed()`
polled on NCCL, i.e. the backend's own completion, not a scheduler decision), waited = when its consumer started waiting for it (the
`moe_comm` all-to-alls, forward and backward; 0.0 when not reported): the transfer was in flight,
unneeded, from start to waited, so compute that ran in that window overlapped it (`in_flight_during`). Categories: "all_to_all" (every moe_comm all-to-all: counts,
dispatch, combine and their backward) and "all_reduce", the low-priority class (gradient micro-ops,
DDP buckets through `ddp_logging_hook`, FSDP2's "fsdp_all_gather" / "fsdp_reduce_scatter" micro-ops
through `grad_sync.schedule_fsdp`). Compute regions: expert compute per chunk from the `moe_sched.mark` nodes the
schedule pass places around `moe.expert_ffn` ("expert_in" / "expert_out"), forward and backward
("expert_bwd" is the input gradient only where the weight gradients are deferred), the deferred expert
weight-gradient GEMMs ("expert_wgrad", from `moe_sched.defer_wgrad`'s backward, Lancet); plus
anything wrapped in `log.region(name)`.

Timestamps are `time.perf_counter()` (CLOCK_MONOTONIC on Linux: comparable across processes of one
machine, also across network namespaces).

`priority_waits(events)`: for each all-to-all, how many all-reduce micro-ops overlapped it (ran at
some time between its queueing and its completion) — Lina's rule allows at most one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from moepass.runtime import scheduler as sched


@dataclass
class Event:
    rank: int
    category: str  # "all_to_all" | "all_reduce" | "compute"
    kind: str  # e.g. "dispatch", "combine_bwd", "grad_allreduce", "expert_fwd"
    start: float
    end: float
    nbytes: int = 0
    waited: float = 0.0  # collectives: when the consumer started waiting (0.0: not reported)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class EventLog:
    def __init__(self, rank: int | None = None):
        self.rank = dist.get_rank() if rank is None and dist.is_initialized() else (rank or 0)
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._open: dict[str, float] = {}

    def start(self) -> EventLog:
        sched.add_listener(self)
        return self

    def stop(self) -> EventLog:
        sched.remove_listener(self)
        return self

    def clear(self) -> None:
        with self._lock:
            self.events.clear()
            self._open.clear()

    # -- listener -------------------------------------------------------------------------------
    def queued(self, kind: str, category: str, group_name: str, nbytes: int) -> Any:
        # the event is logged at completion; `waited` may come before or after it
        return {"event": Event(self.rank, category, kind, time.perf_counter(), 0.0, int(nbytes))}

    def completed(self, token: Any, end: float) -> None:
        token["event"].end = end
        self.add(token["event"])

    def waited(self, token: Any, when: float) -> None:
        with self._lock:
            token["event"].waited = when

    def mark(self, name: str, phase: str) -> None:
        now = time.perf_counter()
        if name in (sched.WGRAD_IN, sched.WGRAD_OUT):  # deferred weight GEMMs (backward only)
            key, kind, opens = "wgrad", "expert_wgrad", name == sched.WGRAD_IN
        elif name in ("expert_in", "expert_out"):
            # forward: expert_in opens, expert_out closes; backward runs the other way round
            key, kind = phase, f"expert_{'fwd' if phase == 'forward' else 'bwd'}"
            opens = (name, phase) in {("expert_in", "forward"), ("expert_out", "backward")}
        else:
            return
        with self._lock:
            if opens:
                self._open[key] = now
                return
            begin = self._open.pop(key, None)
        if begin is not None:
            self.add(Event(self.rank, "compute", kind, begin, now))

    def add(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.add(Event(self.rank, "compute", name, begin, time.perf_counter()))


def ddp_logging_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Plain DDP all-reduce of a bucket (what DDP does by default), launched through the registry so
    the event log sees it. `state` is the process group (None: the default group)."""
    buffer = bucket.buffer()
    world = dist.get_world_size(state)
    work = sched.issue_collective("ddp_bucket", "ddp", buffer.numel() * buffer.element_size(),
                                  lambda: dist.all_reduce(buffer, group=state, async_op=True), category=sched.ALL_REDUCE)
    return work.get_future().then(lambda fut: fut.value()[0].div_(world))


def priority_waits(events: Iterable[Event]) -> list[int]:
    """Per all-to-all of one rank's log: all-reduce micro-ops whose lifetime overlapped it."""
    events = list(events)
    reduces = [e for e in events if e.category == sched.ALL_REDUCE]
    return [sum(1 for r in reduces if r.start < a.end and r.end > a.start)
            for a in events if a.category == sched.A2A]


def launched_during_a2a(events: Iterable[Event], kinds: Iterable[str]) -> int:
    """Collectives of `kinds` in one rank's log queued while an all-to-all was queued or running
    (strictly inside its [start, end]): what Lina's rule forbids for the gradient class."""
    events = list(events)
    a2a = [e for e in events if e.category == sched.A2A]
    wanted = set(kinds)
    return sum(1 for e in events if e.kind in wanted and any(a.start < e.start < a.end for a in a2a))


def in_flight_during(events: Iterable[Event], window: Event, kinds: Iterable[str] | None = None) -> list[Event]:
    """Collectives of one rank's log issued before `window` started and not waited for until it ended
    (optionally only of `kinds`): transfers that overlapped the work of `window` by construction."""
    wanted = None if kinds is None else set(kinds)
    return [e for e in events if e.category != "compute" and (wanted is None or e.kind in wanted)
            and e.start < window.start and e.waited > window.end]


COLORS = {"all_to_all": "tab:red", "all_reduce": "tab:blue", "compute": "tab:green"}


def plot_timeline(events: Iterable[Event], path: str, title: str = "") -> None:
    """One lane per (rank, category); PNG or SVG from the suffix of `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = list(events)
    if not events:
        raise ValueError("plot_timeline: no events to draw")
    t0 = min(e.start for e in events)
    lanes = sorted({(e.rank, e.category) for e in events})
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(lanes) + 1.5))
    for y, (rank, category) in enumerate(lanes):
        spans = [((e.start - t0) * 1e3, max((e.end - e.start) * 1e3, 1e-3)) for e in events
                 if e.rank == rank and e.category == category]
        ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=COLORS.get(category, "gray"), edgecolors="black",
                       linewidth=0.2)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"rank {r} {c}" for r, c in lanes])
    ax.set_xlabel("ms")
    ax.set_title(title or "moepass timeline: all-to-all (red), gradient all-reduce (blue), expert compute (green)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# DDP's register_comm_hook checks the annotations as objects (this module uses postponed annotations)
ddp_logging_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})
