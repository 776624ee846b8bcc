"""The plan search's result (`cost_model.search.search`): the ranked candidates, the table and the winner's
expressions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import sympy

from cost_model import symbols as S
from cost_model.ep import dense_allreduce_tail
from cost_model.presets import Hardware
from cost_model.search_forms import fsep_expressions, hp_expressions, table_symbols, winner_expressions
from cost_model.search_types import NOT_MODELLED, BlockShape, Candidate


@dataclass
class SearchResult:
    ranked: list[Candidate]
    hardware: Hardware
    world_size: int
    nodes: int
    ranks_per_node: int
    tokens: int
    allow_math_changes: bool
    shapes: list[BlockShape] = field(default_factory=list)
    imbalance: float = 1.0
    not_modelled: dict[str, str] = field(default_factory=lambda: dict(NOT_MODELLED))
    schedule: str = "fair"  # how EP's all-to-all and gradient all-reduce share a link (`search`)
    links: list[dict[str, Any]] = field(default_factory=list)  # per block: P_d, q, u (`link_figures`)
    routing: str = "uniform"  # the routing priced (`cost_model.model_cases.routing_of`), as the table says it

    @functools.cached_property
    def expression(self) -> sympy.Expr | None:
        """The winner's time per layer in symbols (plan choices fixed), None without an eligible plan."""
        return self._expressions()[0] if self.eligible() else None

    @functools.cached_property
    def expression_substituted(self) -> sympy.Expr | None:
        """The winner's step time with every figure substituted but T (tokens per rank)."""
        return self._expressions()[1] if self.eligible() else None

    def _expressions(self) -> tuple[sympy.Expr, sympy.Expr]:
        if self.best.form in ("fsep", "hp"):
            if self.best.form == "fsep":
                generic, substituted = fsep_expressions(self.best, self.shapes, self.hardware, self.ranks_per_node)
            else:
                generic, substituted = hp_expressions(self.best, self.shapes, self.hardware, self.world_size,
                                                       self.nodes, self.ranks_per_node)
            cross = self.nodes > 1  # plus the dense all-reduce every form pays (`_with_dense_tail`)
            tail = dense_allreduce_tail({**self.hardware.values(), **self.links[0]}, self.world_size, cross_node=cross)
            return (generic + dense_allreduce_tail(table_symbols(), S.W, cross_node=cross),
                    (substituted + sympy.sympify(tail)).evalf(4))
        return winner_expressions(self.best, self.shapes, self.hardware, self.world_size, self.nodes,
                                   self.ranks_per_node, self.imbalance, self.schedule, self.links, self.tokens)

    def eligible(self) -> list[Candidate]:
        """The ranked candidates `best` may pick: feasible, and not math-changing unless allowed."""
        return [c for c in self.ranked if c.feasible and (self.allow_math_changes or not c.math_changing)]

    @property
    def best(self) -> Candidate:
        eligible = self.eligible()
        if not eligible:
            raise ValueError("no feasible plan: every candidate exceeds device memory or cannot run these blocks "
                             "(the table's notes say which); add ranks or shrink the batch")
        return eligible[0]

    @property
    def runner_up(self) -> Candidate | None:
        eligible = self.eligible()
        return eligible[1] if len(eligible) > 1 else None

    def to_plan_kwargs(self) -> dict[str, Any]:
        return self.best.plan_kwargs()

    def __str__(self) -> str:
        """`print(moepass.search(...))`: the ranked table (`table()`), not the dataclass's repr."""
        return self.table()

    def table(self, limit: int = 12) -> str:
        head = (
            f"plans for W={self.world_size} ({self.nodes} node(s) x {self.ranks_per_node}), T={self.tokens} "
            f"tokens/rank, hardware {self.hardware.name} ({self.hardware.flops.source})"
            + ("" if self.hardware.calibrated else " (UNCALIBRATED)") + f", routing {self.routing}; each plan priced "
            f"on the step timeline (cost_model.systems.price, as `python -m cost_model` prices a set-up)"
        )
        rows = [("#", "plan", "step ms", "compute", "exposed a2a", "other comm", "mem GB/rank", "notes")]
        for i, c in enumerate(self.ranked[:limit], 1):
            t = c.terms
            rows.append(
                (
                    str(i),
                    c.label,
                    _ms(c.step),
                    _ms(t.compute),
                    _ms(t.a2a_exposed),
                    _ms(t.other_comm),
                    f"{float(t.memory) / 1e9:.3g}",
                    "; ".join(c.notes),
                )
            )
        widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
        lines = [head] + ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        if len(self.ranked) > limit:
            lines.append(f"... {len(self.ranked) - limit} more")
        if self.eligible():
            lines.append(
                f"best: {self.best.label}" + (f"; runner-up: {self.runner_up.label}" if self.runner_up else "")
            )
        else:
            lines.append("no eligible plan: every candidate exceeds device memory, cannot run these blocks or "
                         "changes the math")
        if self.expression_substituted is not None:
            lines.append(f"best, its MoE layers by the per-layer formulas (the table's step adds the dense layers): "
                         f"time [s] = {self.expression_substituted}")
        hp = next((i for i, c in enumerate(self.ranked, 1) if c.form == "hp"), None)
        if hp is not None:
            c = self.ranked[hp - 1]
            lines.append(f"hp: changes the model: {c.latent[0].summary()}; best {c.label}: {_ms(c.step)} ms/step, "
                         f"#{hp} of {len(self.ranked)}"
                         + ("" if self.allow_math_changes else "; never picked unless math changes are allowed"))
        lines += [f"{form}: {why}" for form, why in self.not_modelled.items()]
        return "\n".join(lines)


def _ms(seconds: Any) -> str:
    return f"{float(seconds) * 1e3:.4g}"

