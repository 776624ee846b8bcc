"""One candidate MoE block: what the module tree shows of it, then what its recorded forward says
(`moepass.detect.candidates` finds and captures them; `moepass.detect.block_outputs` reads the outputs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from moepass.detect.capture import (
    Capture,
    ModuleCall,
    Selection,
)
from moepass.detect.graph_candidates import GraphBlock
from moepass.detect.router import RouterFacts

SPEC_METHOD = "moepass_spec"  # the self-description protocol: module.moepass_spec(path) -> MoESpec
SELF_DESCRIBED = "self-described"  # Candidate.experts_kind of a module implementing it
GRAPH = "graph"  # Candidate.experts_kind of a block only the recorded forward shows (no structural expert group)
PROBE_TOKENS = (2, 6)  # [B, S] of the probe the candidate's graph is captured on


@dataclass
class Candidate:
    path: str
    module: nn.Module
    num_experts: int  # R, the experts the router scores; 0 for a self-described block (its spec says)
    router_path: str  # module holding the [E, D] weight (relative to the block; any depth)
    experts_path: str  # "" when the experts' 3-D weights live on the block itself
    experts_kind: str  # "modulelist", "moduledict", "fused" or SELF_DESCRIBED
    fused_params: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name -> shape, relative to experts
    # name -> n for fused tensors stored flattened [E·n, ...] (`fused_params` holds them as [E, n, ...])
    flattened: dict[str, int] = field(default_factory=dict)
    expert_names: tuple[str, ...] = ()  # keys of the experts container, in expert order (ModuleList/ModuleDict)
    hidden_dim: int = 0  # D: the width of the router weight's input
    graph: Capture | None = None  # filled by `capture_candidate`
    selection: Selection | None = None
    router: RouterFacts | None = None
    outputs: int = 1  # how many values the block returns
    ffn_experts: int = 0  # E, the expert group's size: R - E router ids are zero-compute experts (0: E = R)
    input_names: tuple[str, ...] = ("hidden_states",)  # the hidden states, then further inputs (token ids)
    load_counter: str | None = None  # an [O] buffer a train-mode forward adds each expert's load to (`load_counter`)
    output_bias: str | None = None  # a [D] parameter added to the combined output (`output_bias`)
    output_module: str | None = None  # a submodule called last, on what the block returns (`output_module`)
    input_module: str | None = None  # a submodule called on the input, whose output the experts read (`input_module`)
    input_weighted: bool = False  # the selection's weights reach an expert weight's input (`MoESpec.weights_on`)
    flat_output: bool = False  # it returns [T, D] tokens for [..., T', D] hidden states (`MoESpec.flat_output`)
    side_outputs: list[str] = field(default_factory=list)  # what it returns after the hidden states (`side_outputs`)
    call: ModuleCall | None = None  # the call the model made to it, when its forward was recorded
    # inputs after the hidden states that its selection does not read, by name: their recorded values, passed to
    # every probe as the model passed them (`MoESpec.unused_inputs`); the probe's hidden states then take
    # `probe_shape`, the recorded one (a mask's shape follows the batch's)
    passthrough: dict[str, Any] = field(default_factory=dict)
    probe_shape: tuple[int, ...] = ()
    graph_block: GraphBlock | None = None  # what the model's recorded forward shows of it (`graph_candidates`)
    # no MoE FFN block (its selection drives work that mixes tokens, e.g. attention experts): rejected by design,
    # left as it is (`BlockReport.left_alone`)
    left_alone: bool = False

    @property
    def num_ffn_experts(self) -> int:
        return self.ffn_experts or self.num_experts

    @property
    def experts(self) -> nn.Module:
        return self.module.get_submodule(self.experts_path) if self.experts_path else self.module


def within(path: str, prefix: str) -> bool:
    """`path` is `prefix` or below it (the root "" holds every path)."""
    return prefix == "" or path == prefix or path.startswith(prefix + ".")
