"""Where a distributed form put a block's experts: the `ExpertLayout` record a rewrite leaves on its
`MoEGraphModule` (`gm.layout`), read by checkpoints, gradient synchronisation, the schedule and `explain`.

Each form extends it with what it places (`EPLayout`, `FSEPLayout`, `HPLayout`, ...). Names are relative
to the block.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from moepass.runtime.topology import EPGroups


@dataclass
class ExpertLayout:
    """Where the expert parameters of one rewritten block live. Names are relative to the block."""

    num_experts: int
    groups: EPGroups
    shard_dim: int  # the dim of the canonical [E, ...] tensors the group shards (EP 0, FSEP 1)
    sharded: list[str] = field(default_factory=list)  # parameters sharded in place (original names)
    stacked: dict[str, tuple[str, ...]] = field(default_factory=dict)  # <form>_<role> -> per-expert paths

    def expert_param_names(self) -> list[str]:
        return [*self.sharded, *self.stacked]

    def describe(self, gm: nn.Module) -> list[str]:
        """Lines for `moepass.explain`: where the experts live (each form adds what it places)."""
        g = self.groups
        return [f"experts: {self.num_experts}, sharded on dim {self.shard_dim} over {g.ep_size} ranks "
                f"(x{g.dp_size} data-parallel replicas); parameters: {self.expert_param_names()}"]


def local_part(t: Tensor) -> Tensor:
    """This rank's part of a (possibly DTensor) parameter or gradient (differentiable; no communication)."""
    return t.to_local() if isinstance(t, DTensor) else t


def expert_layouts(model: nn.Module) -> Iterator[tuple[str, ExpertLayout]]:
    """(block path, layout) of every rewritten block of `model` whose experts a distributed form placed (a
    module's `layout` attribute, which only a `MoEGraphModule` has)."""
    for path, module in model.named_modules():
        layout = getattr(module, "layout", None)
        if isinstance(layout, ExpertLayout):
            yield path, layout


OUTLINED_FROM = "moepass_outlined_from"  # a rewritten block's attribute: the path of the host it was outlined from


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def user_prefix(model: nn.Module, path: str) -> str:
    """The prefix that makes a block's relative names (its layout's `sharded` and `stacked` per-expert paths) the
    user's model's names: the block's path; for a block outlined from its host's forward (`moepass.detect.outline`,
    which sets `OUTLINED_FROM` on the rewritten block) its host's path, as the host registers the modules the block
    shares first (the same relative names) and the block's aliases are dropped from its names and state dict."""
    return getattr(model.get_submodule(path) if path else model, OUTLINED_FROM, path)


def block_expert_parameter_names(model: nn.Module, path: str, layout: ExpertLayout) -> list[str]:
    """Fully qualified names (as `model.named_parameters()` gives them) of one block's expert parameters: the
    sharded ones under `user_prefix`, the stacked ones (the block's own) under the block's path."""
    prefix = user_prefix(model, path)
    return [*(join(prefix, n) for n in layout.sharded), *(join(path, n) for n in layout.stacked)]


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Fully qualified names of every sharded expert parameter in `model`."""
    return [n for path, layout in expert_layouts(model) for n in block_expert_parameter_names(model, path, layout)]
