"""What every pass returns, and the signature of a pass (see `moepass/pipeline.py` for the order)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moepass.canonical import MoEGraphModule
from moepass.plan import Plan


@dataclass
class PassResult:
    """A pass's output graph module, whether it changed anything, and its counters (tests assert them)."""

    gm: MoEGraphModule
    changed: bool
    stats: dict[str, Any] = field(default_factory=dict)


Pass = Callable[[MoEGraphModule, Plan], PassResult]
