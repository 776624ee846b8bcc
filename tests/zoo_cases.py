"""The zoo's case table (tests/test_detect_zoo.py): the blocks beyond a plain router feeding FFN experts (a hash
router on token ids, experts run as traced, a shared-expert sink, a placement table), each case's near-miss
twin, and the checks the tests share (`build`, `token_inputs`, `assert_exact`).

Shape legend: T tokens, D model width, F expert width, E experts, K top-k.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from moepass.spec import MoESpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_blocks import (  # noqa: E402
    ATOL,
    FF,
    RTOL,
    ArgmaxTop1,
    ArgsortSelection,
    ClampedInterleavedWithBiases,
    D,
    DenseEinsum,
    E,
    ExpertBiases,
    ExpertScale,
    IdentityExperts,
    InlineScaling,
    InlineSoftcapRouter,
    InterleavedExpertModules,
    InterleavedGateUp,
    K,
    LinearRouterAnyName,
    Mlp,
    NestedTwoLevels,
    Relu2Experts,
    ReturnsLogits,
    Routed,
    RouterModuleLogits,
    RouterReturnsSelection,
    RouterWithExtraArg,
    SharedBeside,
    SoftmaxBiasCorrected,
    SortSelection,
    UnknownRouterModule,
    ZeroExpertsFirst,
    loop_combine,
    softmax_topk,
)

VOCAB = 11


class HashRouter(nn.Module):
    """Hash routing: a token's K experts are a fixed lookup of its token id ([V, K] table); their weights the
    softmax of the router's own logits at them, renormalised."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, E, bias=False)
        self.register_buffer("table", torch.randint(0, E, (VOCAB, K), generator=torch.Generator().manual_seed(9)))

    def forward(self, x_TD, input_ids):
        idx = self.table[input_ids.reshape(-1)]
        w = self.proj(x_TD).softmax(-1).gather(1, idx)
        return w / w.sum(-1, keepdim=True), idx


class HashRouted(nn.Module):
    """The block takes the token ids as a second input and hands them to its hash router."""

    def __init__(self):
        super().__init__()
        self.hasher = HashRouter()
        self.experts = nn.ModuleList(Mlp() for _ in range(E))

    def forward(self, h, input_ids):
        x = h.reshape(-1, D)
        w, idx = self.hasher(x, input_ids)
        return loop_combine(x, w, idx, list(self.experts)).view_as(h)


class NormExpert(nn.Module):
    """Not a known FFN: Linear -> LayerNorm -> GELU -> Linear."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, FF)
        self.norm = nn.LayerNorm(FF)
        self.down = nn.Linear(FF, D)

    def forward(self, x):
        return self.down(F.gelu(self.norm(self.up(x))))


class NormExperts(Routed):
    """Experts with a norm inside: they run as traced (generic experts)."""

    def __init__(self):
        super().__init__(NormExpert)


class ResidualGlu(nn.Module):
    """Not a known FFN: a GLU with an extra elementwise factor, and a residual inside the expert."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, FF, bias=False)
        self.up = nn.Linear(D, FF, bias=False)
        self.down = nn.Linear(FF, D, bias=False)

    def forward(self, x):
        u = self.up(x)
        return x + self.down(F.silu(self.gate(x)) * u * torch.sigmoid(u))


class ResidualGluDict(nn.Module):
    """ModuleDict experts with a residual inside, a sigmoid router without renormalisation."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(D, E, bias=False)
        self.bank = nn.ModuleDict({f"expert_{e}": ResidualGlu() for e in range(E)})

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = torch.sigmoid(self.score(x)).topk(K, dim=-1)
        return loop_combine(x, w, idx, list(self.bank.values())).view_as(h)


class SinkRouter(nn.Module):
    """Scores E routed experts and one shared "sink" with one [E + 1, D] weight; selects among the first E
    (sigmoid scores); the K chosen logits and the sink's are normalised together (a softmax over K + 1);
    returns (weights [T, K], experts [T, K], the sink's weight [T, 1])."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E + 1, D) * 0.3)

    def forward(self, x_TD):
        logits = x_TD @ self.w.T
        idx = torch.sigmoid(logits[:, :E]).topk(K, dim=-1).indices
        joint = torch.softmax(torch.cat([logits[:, :E].gather(1, idx), logits[:, E:]], dim=-1), dim=-1)
        return joint[:, :K], idx, joint[:, K:]


class SinkShared(nn.Module):
    """A shared expert weighted by the router's sink output, passed by keyword."""

    def __init__(self):
        super().__init__()
        self.mlp = Mlp()

    def forward(self, x, share):
        return self.mlp(x) * share


class SharedSink(nn.Module):
    """A shared-expert sink: the router scores E + 1 experts, selects among E, and hands the shared expert its
    weight (normalised jointly with the chosen ones)."""

    def __init__(self):
        super().__init__()
        self.pick = SinkRouter()
        self.experts = nn.ModuleList(Mlp() for _ in range(E))
        self.common = SinkShared()

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx, sink = self.pick(x)
        return (loop_combine(x, w, idx, list(self.experts)) + self.common(x, share=sink)).view_as(h)


class PlacementRouter(nn.Module):
    """Softmax top-k, then the chosen (logical) experts mapped through a placement table to the ids the block
    dispatches by: the ids it returns are not its top-k's (no known rule; read as they are)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, E, bias=False)
        self.register_buffer("placement", torch.tensor([3, 0, 5, 1, 4, 2]))

    def forward(self, x_TD):
        w, idx = softmax_topk(self.proj(x_TD))
        return self.placement[idx], w


class PlacedExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = PlacementRouter()
        self.experts = nn.ModuleList(Mlp() for _ in range(E))

    def forward(self, h):
        x = h.reshape(-1, D)
        idx, w = self.router(x)
        return loop_combine(x, w, idx, list(self.experts)).view_as(h)


def _router(**changes):
    return lambda s: s.replace(router=replace(s.router, **changes))


def _experts(**changes):
    return lambda s: s.replace(experts=replace(s.experts, **changes))


def _swap_gate_up(s: MoESpec) -> MoESpec:
    assert s.experts.w_up is not None
    return s.replace(experts=replace(s.experts, w_gate=s.experts.w_up, w_up=s.experts.w_gate))


def _shared_gate_forgotten(s: MoESpec) -> MoESpec:
    assert s.shared is not None
    return s.replace(shared=replace(s.shared, gate_path=None))


def _identity_as_zero(s: MoESpec) -> MoESpec:  # the zero-compute experts read as returning zero
    return s.replace(experts=replace(s.experts, identity_experts=(), zero_experts=s.experts.identity_experts))


def _zero_as_identity(s: MoESpec) -> MoESpec:  # the zero experts read as returning their input
    return s.replace(experts=replace(s.experts, zero_experts=(), identity_experts=s.experts.zero_experts))


def _module_outputs_swapped(s: MoESpec) -> MoESpec:  # the router module's experts read as the weights
    r = s.router
    return s.replace(router=replace(r, module_output_index=r.module_experts_index,
                                    module_experts_index=r.module_output_index))


def _generic_experts_shifted(s: MoESpec) -> MoESpec:  # expert e runs with expert e+1's first tensor
    (name, source), *rest = s.experts.tensors
    shifted = replace(source, paths=source.paths[1:] + source.paths[:1])
    return s.replace(experts=replace(s.experts, tensors=((name, shifted), *rest)))


def _sink_output_misread(s: MoESpec) -> MoESpec:  # the shared expert handed the routed weights, not the sink's
    assert s.shared is not None and s.router.module_output_index is not None
    return s.replace(shared=replace(s.shared, router_outputs=(("share", s.router.module_output_index),)))


@dataclass
class Case:
    block: Callable[[], nn.Module]
    twin: Callable[[MoESpec], MoESpec]  # the near miss: the accepted spec with one thing changed
    twin_reason: str  # words the twin's rejection reason must contain
    expect: Callable[[MoESpec], bool] = lambda s: True  # what the accepted spec must say
    ep: bool = False  # also checked under EP at W=2


OUT, SEL = "outputs differ", "tokens select different experts"

CASES: dict[str, Case] = {
    "plain nn.Linear router at any name (with a bias)": Case(
        LinearRouterAnyName, _router(bias=None), OUT,
        lambda s: s.router.bias is not None and s.router.weight.paths == ("scorer.weight",)
        and s.router.dtype == "input", ep=True),  # the block computes its logits in the input's dtype
    "inline router with soft-capped logits (the block's own code, traced)": Case(
        InlineSoftcapRouter, _router(renormalize=False), OUT,
        lambda s: s.router.logits_from == "traced" and s.router.module_args == ("softcap", "gate.weight")
        and s.router.renormalize, ep=True),
    "router module returns (weights, indices) itself": Case(
        RouterReturnsSelection, _module_outputs_swapped, "fails",
        lambda s: s.router.logits_from == "selection" and s.router.known_kind and s.router.renormalize
        and s.router.score_func == "softmax", ep=True),
    "router module with a rule no known kind covers (softmax at a temperature)": Case(
        UnknownRouterModule, _module_outputs_swapped, "fails",
        lambda s: s.router.logits_from == "selection" and not s.router.known_kind, ep=True),
    "router forward takes a bias tensor of the block": Case(
        RouterWithExtraArg, _experts(activation="relu"), OUT,
        lambda s: s.router.module_args == ("balance_bias",) and s.router.module_input == "tokens"
        and s.router.known_kind and s.router.score_func == "sigmoid" and s.router.selection_bias is not None,
        ep=True),
    "bias-corrected top-k inside a softmax router, three fused weights": Case(
        SoftmaxBiasCorrected, _router(selection_bias=None), SEL,
        lambda s: s.router.selection_bias is not None and s.router.score_func == "softmax" and s.experts.gated,
        ep=True),
    "expert biases, non-gated GELU, sigmoid router without renormalisation": Case(
        ExpertBiases, _experts(b_down=None), OUT,
        lambda s: s.experts.b_gate is not None and s.experts.activation == "gelu" and not s.router.renormalize),
    "gate and up interleaved in one fused tensor": Case(
        InterleavedGateUp, _swap_gate_up, OUT, lambda s: s.experts.w_gate.interleave == (0, 2), ep=True),
    "gate and up interleaved in each expert module's linear": Case(
        InterleavedExpertModules, _swap_gate_up, OUT, lambda s: s.experts.w_gate.interleave == (0, 2)),
    "experts two levels down, router one level down": Case(
        NestedTwoLevels, _router(softmax_before_topk=True), OUT,
        lambda s: s.experts.container == "experts.inner" and s.router.weight.paths == ("routing.proj.weight",)),
    "block returns (hidden, router_logits), ModuleDict experts": Case(
        ReturnsLogits, lambda s: s.replace(side_outputs=()), "returns 1 value(s)",
        lambda s: s.side_outputs == ("router_logits",)),
    "top-1 by argmax": Case(ArgmaxTop1, _router(renormalize=True), OUT, lambda s: s.top_k == 1),
    "routed scaling written inline": Case(
        InlineScaling, _router(routed_scaling_factor=1.0), OUT, lambda s: s.router.routed_scaling_factor == 2.5),
    "dense einsum over every expert, scattered weights": Case(
        DenseEinsum, _experts(activation="relu"), OUT,
        lambda s: s.experts.activation == "gelu" and s.router.bias is not None and s.router.selection_bias is None),
    "gated shared expert beside the routed ones (any names)": Case(
        SharedBeside, _shared_gate_forgotten, OUT,
        lambda s: s.shared is not None and s.shared.gate_path == "always_gate"),
    "interleaved gate/up with biases, clamped SwiGLU": Case(
        ClampedInterleavedWithBiases, _experts(b_up=None), OUT,
        lambda s: s.experts.activation == "clamped_swiglu" and s.experts.b_up is not None
        and s.experts.w_up is not None and s.experts.w_up.interleave == (1, 2), ep=True),
    "router module returning logits (its hooks keep firing)": Case(
        RouterModuleLogits, _router(logits_from="linear"), "is called 0x by the graph",
        lambda s: s.router.logits_from == "module" and s.router.module_path == "scorer"),
    "squared-ReLU experts": Case(Relu2Experts, _experts(activation="relu"), OUT,
                                 lambda s: s.experts.activation == "relu2" and not s.experts.gated),
    "identity (zero-compute) experts beside FFN experts": Case(
        IdentityExperts, _identity_as_zero, OUT,
        lambda s: s.experts.identity_experts == (E - 2, E - 1) and s.experts.num_experts == E - 2
        and s.router.num_experts == E, ep=True),
    "zero experts (returning zeros) before fused FFN experts": Case(
        ZeroExpertsFirst, _zero_as_identity, OUT,
        lambda s: s.experts.zero_experts == (0, 1) and s.experts.ffn_ids == tuple(range(2, E))),
    "per-expert output scale": Case(
        ExpertScale, _experts(output_scale=None), OUT,
        lambda s: s.experts.output_scale is not None and s.experts.output_scale.paths == ("out_scale",), ep=True),
    "selection by a descending sort and slicing": Case(
        SortSelection, _router(renormalize=False), OUT,
        lambda s: s.router.score_func == "softmax" and s.router.renormalize and s.top_k == K, ep=True),
    "selection by argsort and slicing, gathered sigmoid scores": Case(
        ArgsortSelection, _router(score_func="softmax"), OUT,
        lambda s: s.router.score_func == "sigmoid" and not s.router.renormalize and s.top_k == K),
    "hash router keyed by token ids (a second block input)": Case(
        HashRouted, _module_outputs_swapped, "fails",
        lambda s: s.input_names == ("hidden_states", "input_ids") and s.router.logits_from == "selection"
        and s.router.module_args == ("input_ids",) and not s.router.known_kind
        and s.router.weight.paths == ("hasher.proj.weight",), ep=True),
    "experts with a norm inside (not a known FFN: run as traced)": Case(
        NormExperts, _generic_experts_shifted, OUT,
        lambda s: s.experts.kind == "generic" and s.experts.template == "experts.0"
        and s.experts.template_class == "NormExpert" and len(s.experts.tensors) == 6, ep=True),
    "ModuleDict experts with a residual and an extra factor inside (run as traced)": Case(
        ResidualGluDict, _generic_experts_shifted, OUT,
        lambda s: s.experts.kind == "generic" and s.experts.template == "bank.expert_0"
        and s.experts.tensors[0][1].paths == tuple(f"bank.expert_{e}.gate.weight" for e in range(E))
        and not s.router.renormalize and s.router.score_func == "sigmoid", ep=True),
    "shared-expert sink: router over E + 1, selection over E, the sink weight handed to the shared expert": Case(
        SharedSink, _sink_output_misread, "fails",
        lambda s: s.router.logits_from == "selection" and s.router.num_experts == E and s.experts.num_experts == E
        and s.shared is not None and s.shared.module_path == "common" and s.shared.router_outputs == (("share", 2),),
        ep=True),
    "router module returning the ids the block dispatches by, not its top-k's (a placement table)": Case(
        PlacedExperts, _module_outputs_swapped, "fails",
        lambda s: s.router.logits_from == "selection" and not s.router.known_kind
        and (s.router.module_output_index, s.router.module_experts_index) == (1, 0) and s.top_k == K, ep=True),
}
NOT_YET: dict[str, str] = {}
IDENTITY = "identity (zero-compute) experts beside FFN experts"

def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    block = CASES[name].block()
    with torch.no_grad():  # zero-initialised tensors (biases) made non-trivial, as a trained model's are
        for t in [*block.parameters(), *block.buffers()]:
            if t.is_floating_point() and not t.any():
                t.copy_(torch.randn(t.shape) * 0.1)
    return block


def token_inputs(block: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Token ids for a block that takes them after the hidden states (the hash router's)."""
    from moepass.detect.candidates import further_inputs
    from moepass.detect.check import token_ids

    gen = torch.Generator().manual_seed(8)
    return [token_ids(block, x.shape[:-1], gen) for _ in further_inputs(block)]


def outputs_of(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def assert_exact(block: nn.Module, compiled: nn.Module) -> None:
    """The compiled block's outputs, input gradient and every parameter gradient equal the block's."""
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(3))
    weight = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(4))
    further = token_inputs(block, x)
    runs = []
    for module in (block, compiled):
        module.train()
        module.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        outs = outputs_of(module(xi, *further))
        (outs[0] * weight).sum().backward()
        runs.append((outs, xi.grad, {n: p.grad for n, p in module.named_parameters()}))
    (ref_outs, ref_dx, ref_grads), (outs, dx, grads) = runs
    for a, b in zip(outs, ref_outs, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(dx, ref_dx, rtol=RTOL, atol=ATOL)
    assert set(grads) == set(ref_grads)
    for n, g in ref_grads.items():
        if g is None:
            assert grads[n] is None or not grads[n].any(), n
        else:
            torch.testing.assert_close(grads[n], g, rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")
