"""Every piece of process-wide mutable state in moepass, lowering and cost_model, declared here and nowhere else.

A module that needs state living as long as the process (a cache, a record, a registry, a thread, a queue that
autograd's process-wide backward reaches) takes it from here; nothing else keeps mutable module globals
(tests/test_process_state.py reads every module and fails on one). Each entry says who owns it (the only module
that writes it), what it holds and when it is emptied. An owner may keep its public name for an entry as an
alias (`COUNTERS = process_state.BACKEND.counters`): the same object, never rebound.

`reset()` empties the caches and records a test may want to start from (its doc names them); it leaves alone
what holds a registration outside moepass (optimizer hooks, a log handler, collective listeners: their owners'
undo calls remove them) and what work in flight still needs (pending transfers, deferred reductions, the
completion thread, the deterministic-mode backward). Core layer: no torch.distributed call, importable by every
other layer.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

T = TypeVar("T")


class Slot(Generic[T]):
    """One process-wide object its owner makes on first use (`get(make)`), replaces (`set`) or forgets (`clear`)."""

    def __init__(self) -> None:
        self._value: T | None = None
        self._lock = threading.Lock()

    @property
    def value(self) -> T | None:
        return self._value

    def get(self, make: Callable[[], T]) -> T:
        """The object, made by `make()` the first time (once, under a lock)."""
        value = self._value
        if value is None:
            with self._lock:
                if self._value is None:
                    self._value = make()
                value = self._value
        return value

    def set(self, value: T | None) -> None:
        self._value = value

    def clear(self) -> None:
        self._value = None


@dataclass
class BackendLog:
    """What the torch.compile backend did in this process (moepass.backend.reports reads and writes it)."""

    max_reports: int = 64
    counters: Counter[str] = field(default_factory=Counter)  # graphs, regions_rewritten, ... (backend doc)
    reports: deque[Any] = field(init=False)  # the last `max_reports` BackendReports, oldest first
    graphs: int = 0  # graphs handed to the backend so far: the next report's number
    last_graph: weakref.ref[Any] | None = None  # the last graph handed to the inner compiler

    def __post_init__(self) -> None:
        self.reports = deque(maxlen=self.max_reports)

    def clear(self) -> None:
        """Forget reports and counters (the last graph stays: it is only a weak reference)."""
        self.reports.clear()
        self.counters.clear()
        self.graphs = 0


# ---- runtime ---------------------------------------------------------------------------------------------------
# runtime.collectives: pending all_to_all output tensor -> its Transfer; moe_comm.wait pops it (weak: a tensor
# that dies takes its entry with it)
TRANSFERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# runtime.scheduler: the collective listeners (add_listener / remove_listener empties it)
LISTENERS: list[Any] = []
# runtime.scheduler: the one CompletionWatcher thread polling NCCL works, made on the first; lives with the process
COMPLETION_WATCHER: Slot[Any] = Slot()
# runtime.optim: the optimizer step hook pair enable_mixed_steps registered (disable_mixed_steps removes it)
OPTIM_HOOKS: list[Any] = []
# runtime.optim: the implicit_replication context a step entered (its post hook, or the next step, closes it)
OPTIM_OPEN: list[Any] = []
# runtime.stats: collective kind -> {"intra", "inter", "self", "calls"} counters (reset_comm_stats empties it)
COMM_STATS: dict[str, dict[str, int]] = {}
COMM_STATS_LOCK = threading.Lock()
# runtime.topology: the process groups made for the current default group (a _WorldCache); replaced when the world
# changes, reset_groups forgets it
WORLD_GROUPS: Slot[Any] = Slot()
# runtime.fsep: the queue of FSEP gradient reductions left in flight (DeferredReductions), made on first use;
# emptied by the backward that issued them or the next training forward
FSEP_DEFERRED: Slot[Any] = Slot()
# determinism: the deterministic-mode switch of the backward running now (BackwardMode); its end restores it
DETERMINISTIC_BACKWARD: Slot[Any] = Slot()

# ---- core ------------------------------------------------------------------------------------------------------
# grouped_ffn: weight storage -> {(offset, shape, dtype): (gradient buffer, its storage's use count)}; weak (gone
# with the weight), under its lock
GRAD_BUFFERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
GRAD_BUFFERS_LOCK = threading.Lock()

# ---- lowering --------------------------------------------------------------------------------------------------
# lowering.codegen: (source sha256, interpreted) -> the imported kernel module; kept for the process
KERNEL_MODULES: dict[tuple[str, bool], Any] = {}
# lowering.codegen: this process's own temp kernel directory, made only when the default cannot be (removed at exit)
KERNEL_FALLBACK_DIR: Slot[Path] = Slot()
# lowering.gating / permute / combine: op name -> launches that fell back to the torch reference
KERNEL_FALLBACKS: Counter[str] = Counter()
# lowering.numerics: kernel families whose output `run(faults=...)` offsets on purpose; set by each run
KERNEL_FAULTS: set[str] = set()

# ---- face ------------------------------------------------------------------------------------------------------
# backend.regions: nn.Module -> its DetectionReport (weak: a module that goes away takes its report with it)
DETECTED: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
# backend.reports: reports and counters of the torch.compile backend (backend.reset empties them)
BACKEND = BackendLog()
# inspect: the stderr handler set_debug(True) added to the "moepass" logger (set_debug(False) removes it)
DEBUG_HANDLER: Slot[Any] = Slot()
# inspect: extra labellers of communication nodes in drawn graphs (the cost model's hook); callers append
COMM_ANNOTATORS: list[Callable[..., Any]] = []


def reset() -> None:
    """Empty the caches and records (for tests): detection reports, backend reports and counters,
    communication counters, cached process groups, kernel fallback counts, gradient buffers. Compiled kernel
    modules stay (recompiling is slow and they are keyed by their source). Registrations and work in flight are
    left to their owners (module doc)."""
    DETECTED.clear()
    BACKEND.clear()
    with COMM_STATS_LOCK:
        COMM_STATS.clear()
    WORLD_GROUPS.clear()
    KERNEL_FALLBACKS.clear()
    with GRAD_BUFFERS_LOCK:
        GRAD_BUFFERS.clear()
