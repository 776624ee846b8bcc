"""Generated Triton kernels for the MoE dialect, one file per kernel family.

Each family registers `Lowering` records: which dialect op it replaces, the custom op that replaces
it (same arguments), an eligibility check that declines with a reason, and the generated source for
a given specialisation (shown by `moepass.explain`). The lower pass (`moepass.lower`) reads the
registry; nothing here imports moepass's passes.

Set TRITON_INTERPRET=1 *before* importing these modules to run kernels on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moepass.operands import OpSchema

LOWERED_NAMESPACE = "moe_lowered"  # the namespace of every lowered op
FAMILIES = ("gating", "permute", "grouped_gemm", "combine")  # in graph order; moepass.lower reads this list


@dataclass(frozen=True)
class Lowering:
    family: str  # one of FAMILIES
    dialect_op: Any  # torch.ops.moe.<op>.default it replaces (for fused families: the last op of the pattern)
    lowered_op: Any  # torch.ops.moe_lowered.<op>.default, same arguments as the pattern's inputs
    eligible: Callable[..., str | None]  # (*args as fake tensors / python values) -> None if eligible, else the reason
    source: Callable[..., str]  # (*args) -> generated Triton source specialised to these arguments
    fuses: tuple[Any, ...] = ()  # dialect ops folded in before dialect_op (e.g. unpermute for combine)

    @classmethod
    def define(cls, family: str, dialect_op: Any, schema: OpSchema, impl: Callable[..., Any],
               eligible: Callable[..., str | None], source: Callable[..., str], fuses: tuple[Any, ...] = (),
               **overrides: Any) -> Lowering:
        """The family's op `moe_lowered::<schema.name>`, made from the op's one declaration running `impl`
        (`OpSchema.define`; `overrides`: a fake or autograd of this op's own), and its record replacing
        `dialect_op`."""
        import torch

        schema.define(LOWERED_NAMESPACE, impl, **overrides)
        lowered_op = getattr(getattr(torch.ops, LOWERED_NAMESPACE), schema.name).default
        return cls(family, dialect_op, lowered_op, eligible, source, fuses)


def registry() -> list[Lowering]:
    """The lowerings of every family in FAMILIES, in that order, each family's module's `LOWERING`; built
    here, on each call, from the modules (importing a family registers nothing). A family whose module
    cannot import because Triton is missing is absent: an empty list without Triton."""
    import importlib

    found: list[Lowering] = []
    for family in FAMILIES:
        try:
            module = importlib.import_module(f"lowering.{family}")
        except ImportError as err:  # triton not installed, or the family not written yet
            if "triton" not in str(err) and f"lowering.{family}" not in str(err):
                raise
            continue
        found.append(module.LOWERING)
    return found
