"""What the torch.compile backend did: one report per Dynamo graph, and its counters."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from torch import fx

from moepass.process_state import BACKEND

NAME = "moepass"
MAX_REPORTS = BACKEND.max_reports
COUNTERS = BACKEND.counters  # the process's backend counters (moepass.process_state.BACKEND): never rebound


# ----------------------------------------------------------------------------------------------
# What the backend did: one report per Dynamo graph.
# ----------------------------------------------------------------------------------------------


@dataclass
class Region:
    """One MoE block found in a Dynamo graph and what the backend did with it."""

    path: str  # module path from the compiled frame's root (e.g. "model.layers.0.mlp")
    module_type: str
    action: str  # "rewritten" | "kept" (already dialect) | "passthrough"
    reason: str = ""
    nodes_removed: int = 0
    nodes_added: int = 0


@dataclass
class BackendReport:
    graph: int  # running index of the graphs this process handed to the backend
    inner: str
    frame: str = ""  # type of the module whose forward Dynamo compiled (region paths are relative to it)
    nodes_before: int = 0
    nodes_after: int = 0
    regions: list[Region] = field(default_factory=list)
    diagnostics: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def count(self, action: str) -> int:
        return sum(r.action == action for r in self.regions)

    @property
    def rewritten(self) -> int:
        return self.count("rewritten")

    @property
    def changed(self) -> bool:
        return self.rewritten > 0

    def summary(self) -> str:
        frame = f" ({self.frame}.forward)" if self.frame else ""
        lines = [f"moepass backend, graph {self.graph}{frame}: {self.nodes_before} -> {self.nodes_after} nodes, "
                 f"{self.rewritten} region(s) rewritten, {self.count('kept')} kept, "
                 f"{self.count('passthrough')} passed through ({self.seconds * 1e3:.1f} ms, inner={self.inner})"]
        for r in self.regions:
            detail = f" (-{r.nodes_removed} +{r.nodes_added} nodes)" if r.action == "rewritten" else ""
            lines.append(f"  {r.path or '<root>'} ({r.module_type}): {r.action}{detail}"
                         + (f": {r.reason}" if r.reason else ""))
        lines += [f"  note: {d}" for d in self.diagnostics]
        return "\n".join(lines)


def last_report() -> BackendReport | None:
    """What the backend did to the last graph it was given (None before the first)."""
    return BACKEND.reports[-1] if BACKEND.reports else None


def last_graph() -> fx.GraphModule | None:
    """The last graph the backend handed to its inner compiler (after the rewrite)."""
    return BACKEND.last_graph() if BACKEND.last_graph is not None else None


def reports() -> list[BackendReport]:
    """The reports of the last graphs (at most MAX_REPORTS), oldest first."""
    return list(BACKEND.reports)


def reset() -> None:
    """Forget reports and counters (the detection cache is per module and needs no reset)."""
    BACKEND.clear()



def new_report(inner: str) -> BackendReport:
    """A report for the next graph, numbered and kept (the last MAX_REPORTS)."""
    report = BackendReport(graph=BACKEND.graphs, inner=inner)
    BACKEND.graphs += 1
    BACKEND.reports.append(report)
    return report


def set_last_graph(gm: fx.GraphModule) -> None:
    BACKEND.last_graph = weakref.ref(gm)


def count(name: str, n: int = 1) -> None:
    """Bump a counter here and in `torch._dynamo.utils.counters["moepass"]`."""
    COUNTERS[name] += n
    from torch._dynamo.utils import counters

    counters[NAME][name] += n
