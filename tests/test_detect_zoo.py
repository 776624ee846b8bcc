"""A zoo of hand-written MoE blocks that no recogniser names: detection reads each from its graph.

One case table. Each case is a block written the way people write MoE layers (routers of every
shape, experts at any depth, layouts and activations of every kind), and a near-miss twin: the
accepted spec with one thing changed (renormalisation dropped, a bias forgotten, the activation
swapped, ...), which the semantic check must reject with its reason on the same probes. Every
accepted block must be exact under `Plan(form="single")`: outputs and every gradient against the
original block; the cases marked `ep` also under EP at W=2 on gloo (`test_ep_parity_w2`). A block that
takes token ids after the hidden states (the hash router's) gets them in every run (`_further_inputs`).

Shape legend: T tokens, D model width, F expert width, E experts, K top-k.
"""

from __future__ import annotations

import copy
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moepass
from moepass.detect.check import check_specs
from moepass.spec import MoESpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool, shutdown  # noqa: E402

D, FF, E, K = 16, 24, 6, 2
RTOL, ATOL = 1e-5, 1e-6


# ----------------------------------------------------------------------------------------------
# Shared pieces of the hand-written blocks.
# ----------------------------------------------------------------------------------------------


def loop_combine(x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor,
                 experts: list[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
    """Each expert on its tokens, weighted, accumulated (the reference style)."""
    out_TD = torch.zeros_like(x_TD)
    for e, expert in enumerate(experts):
        token, choice = torch.where(experts_TK == e)
        if token.numel():
            out_TD.index_add_(0, token, expert(x_TD[token]) * weights_TK[token, choice, None].to(x_TD.dtype))
    return out_TD


class Mlp(nn.Module):
    """An expert with names no list holds: `inp` (and `gate_in`) -> act -> `outp`."""

    def __init__(self, gated: bool = True, act: Callable = F.silu, bias: bool = False):
        super().__init__()
        self.inp = nn.Linear(D, FF, bias=bias)
        self.gate_in = nn.Linear(D, FF, bias=bias) if gated else None
        self.outp = nn.Linear(FF, D, bias=bias)
        self.act = act

    def forward(self, x):
        if self.gate_in is None:
            return self.outp(self.act(self.inp(x)))
        return self.outp(self.act(self.gate_in(x)) * self.inp(x))


class FusedGateUpMlp(nn.Module):
    """An expert with gate and up rows interleaved in one linear (rows 0, 2, ... gate; 1, 3, ... up)."""

    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(D, 2 * FF, bias=False)
        self.proj_out = nn.Linear(FF, D, bias=False)

    def forward(self, x):
        h = self.proj_in(x)
        return self.proj_out(F.silu(h[..., 0::2]) * h[..., 1::2])


def softmax_topk(logits_TE, k=K, renorm=True):
    probs = logits_TE.float().softmax(-1)
    w, idx = probs.topk(k, dim=-1)
    return (w / w.sum(-1, keepdim=True) if renorm else w), idx


# ----------------------------------------------------------------------------------------------
# The zoo.
# ----------------------------------------------------------------------------------------------


class LinearRouterAnyName(nn.Module):
    """The router is a plain nn.Linear (with a bias) called `scorer`; experts in a ModuleList `ffns`."""

    def __init__(self):
        super().__init__()
        self.scorer = nn.Linear(D, E)
        self.ffns = nn.ModuleList(Mlp() for _ in range(E))

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = softmax_topk(self.scorer(x))
        return loop_combine(x, w, idx, list(self.ffns)).view_as(h)


class InlineSoftcapRouter(nn.Module):
    """The router written inline in the block's forward, its logits soft-capped by a learnable scale
    (`cap * tanh(logits / cap)`), a rule no known kind describes: run as the block's own traced code."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.softcap = nn.Parameter(torch.tensor(2.0))
        self.ffns = nn.ModuleList(Mlp() for _ in range(E))

    def forward(self, h):
        x = h.reshape(-1, D)
        logits = self.softcap * torch.tanh(self.gate(x) / self.softcap)
        w, idx = softmax_topk(logits)
        return loop_combine(x, w, idx, list(self.ffns)).view_as(h)


class TopKRouter(nn.Module):
    """A router module that returns the top-k weights and indices itself."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, E, bias=False)

    def forward(self, x_TD):
        return softmax_topk(self.proj(x_TD))


class RouterReturnsSelection(nn.Module):
    def __init__(self):
        super().__init__()
        self.route = TopKRouter()
        self.experts = nn.ModuleList(Mlp() for _ in range(E))

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = self.route(x)
        return loop_combine(x, w, idx, list(self.experts)).view_as(h)


class TemperatureRouter(TopKRouter):
    """A router rule no known kind covers: softmax at temperature 0.7, top-k, renormalise."""

    def forward(self, x_TD):
        return softmax_topk(self.proj(x_TD) / 0.7)


class UnknownRouterModule(RouterReturnsSelection):
    def __init__(self):
        super().__init__()
        self.route = TemperatureRouter()


class BiasedRouter(nn.Module):
    """Sigmoid scores; selection on scores + a bias the block passes in; weights the unbiased scores."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(D, E, bias=False)

    def forward(self, x_TD, bias_E):
        scores = torch.sigmoid(self.w(x_TD))
        idx = (scores + bias_E).topk(K, dim=-1).indices
        w = scores.gather(1, idx)
        return idx, w / w.sum(-1, keepdim=True)


class RouterWithExtraArg(nn.Module):
    """The router's forward takes a bias tensor of the block; it returns (indices, weights)."""

    def __init__(self):
        super().__init__()
        self.router = BiasedRouter()
        self.register_buffer("balance_bias", torch.zeros(E))
        self.experts = nn.ModuleList(Mlp(gated=False, act=F.gelu) for _ in range(E))

    def forward(self, h):
        x = h.reshape(-1, D)
        idx, w = self.router(x, self.balance_bias)
        return loop_combine(x, w, idx, list(self.experts)).view_as(h)


class SoftmaxBiasCorrected(nn.Module):
    """Inline softmax router with a bias-corrected top-k; three separate fused weights w1, w3, w2."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(E, D) / math.sqrt(D))
        self.correction = nn.Parameter(torch.zeros(E), requires_grad=False)
        self.w1 = nn.Parameter(torch.randn(E, FF, D) / math.sqrt(D))
        self.w3 = nn.Parameter(torch.randn(E, FF, D) / math.sqrt(D))
        self.w2 = nn.Parameter(torch.randn(E, D, FF) / math.sqrt(FF))

    def forward(self, h):
        x = h.reshape(-1, D)
        scores = F.linear(x, self.gate).softmax(-1)
        idx = (scores + self.correction).topk(K, dim=-1).indices
        w = scores.gather(1, idx)
        w = w / w.sum(-1, keepdim=True)
        experts = [lambda t, e=e: F.linear(F.silu(F.linear(t, self.w1[e])) * F.linear(t, self.w3[e]), self.w2[e])
                   for e in range(E)]
        return loop_combine(x, w, idx, experts).view_as(h)


class ExpertBiases(nn.Module):
    """Non-gated GELU experts with biases in every linear; sigmoid router, no renormalisation."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Mlp(gated=False, act=F.gelu, bias=True) for _ in range(E))

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = torch.sigmoid(self.router(x)).topk(K, dim=-1)
        return loop_combine(x, w, idx, list(self.experts)).view_as(h)


class InterleavedGateUp(nn.Module):
    """Fused expert weights with gate and up rows interleaved: w_gu [E, 2F, D], rows 0::2 gate, 1::2 up."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.w_gu = nn.Parameter(torch.randn(E, 2 * FF, D) / math.sqrt(D))
        self.w_out = nn.Parameter(torch.randn(E, D, FF) / math.sqrt(FF))

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = softmax_topk(self.router(x))
        experts = [lambda t, e=e: F.linear(F.silu(F.linear(t, self.w_gu[e, 0::2])) * F.linear(t, self.w_gu[e, 1::2]),
                                           self.w_out[e]) for e in range(E)]
        return loop_combine(x, w, idx, experts).view_as(h)


class InterleavedExpertModules(nn.Module):
    """ModuleList experts, each one linear holding gate and up rows interleaved."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(FusedGateUpMlp() for _ in range(E))

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = softmax_topk(self.router(x))
        return loop_combine(x, w, idx, list(self.experts)).view_as(h)


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, D, 2 * FF) / math.sqrt(D))  # input-major [E, D, 2F]
        self.w2 = nn.Parameter(torch.randn(E, FF, D) / math.sqrt(FF))  # [E, F, D]


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()


class Routing(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, E, bias=False)


class NestedTwoLevels(nn.Module):
    """Experts two levels down (block.experts.inner.w1) and the router one (block.routing.proj)."""

    def __init__(self):
        super().__init__()
        self.routing = Routing()
        self.experts = Holder()

    def forward(self, h):
        x = h.reshape(-1, D)
        top, idx = self.routing.proj(x).topk(K, dim=-1)
        w = top.softmax(-1)
        w1, w2 = self.experts.inner.w1, self.experts.inner.w2
        gate, up = torch.einsum("td,tkdf->tkf", x, w1[idx]).chunk(2, dim=-1)
        y = torch.einsum("tkf,tkfd->tkd", F.silu(gate) * up, w2[idx])
        return (y * w[..., None]).sum(1).view_as(h)


class ReturnsLogits(nn.Module):
    """Returns (hidden, router_logits); experts in a ModuleDict keyed by name."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(D, E, bias=False)
        self.bank = nn.ModuleDict({f"e{i}": Mlp() for i in range(E)})

    def forward(self, h):
        x = h.reshape(-1, D)
        logits = self.classifier(x)
        w, idx = softmax_topk(logits)
        return loop_combine(x, w, idx, list(self.bank.values())).view_as(h), logits


class ArgmaxTop1(nn.Module):
    """Top-1 by argmax over softmax probabilities, weight = the chosen probability (not renormalised)."""

    def __init__(self):
        super().__init__()
        self.selector = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Mlp(gated=False, act=F.relu) for _ in range(E))

    def forward(self, h):
        x = h.reshape(-1, D)
        probs = self.selector(x).softmax(-1)
        idx = probs.argmax(-1, keepdim=True)
        w = probs.gather(1, idx)
        return loop_combine(x, w, idx, list(self.experts)).view_as(h)


class InlineScaling(nn.Module):
    """Sigmoid, top-k, renormalise, then a constant scale written inline (no attribute says it)."""

    def __init__(self):
        super().__init__()
        self.r = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Mlp() for _ in range(E))

    def forward(self, h):
        x = h.reshape(-1, D)
        s, idx = torch.sigmoid(self.r(x)).topk(K, dim=-1)
        w = s / s.sum(-1, keepdim=True) * 2.5
        return loop_combine(x, w, idx, list(self.experts)).view_as(h)


class DenseEinsum(nn.Module):
    """Every expert on every token (einsum over input-major weights), combined through a scattered [T, E]
    weight matrix: top-k logits (`x @ w.T + b`, bare parameters), softmax over them."""

    def __init__(self):
        super().__init__()
        self.router_w = nn.Parameter(torch.randn(E, D) / math.sqrt(D))
        self.router_b = nn.Parameter(torch.randn(E) * 0.1)
        self.wi = nn.Parameter(torch.randn(E, D, FF) / math.sqrt(D))
        self.wo = nn.Parameter(torch.randn(E, FF, D) / math.sqrt(FF))

    def forward(self, h):
        x = h.reshape(-1, D)
        top, idx = (x @ self.router_w.t() + self.router_b).topk(K, dim=-1)
        dense_w = torch.zeros(x.shape[0], E).scatter(1, idx, top.softmax(-1))
        y_TED = torch.einsum("tef,efd->ted", F.gelu(torch.einsum("td,edf->tef", x, self.wi)), self.wo)
        return torch.einsum("te,ted->td", dense_w, y_TED).view_as(h)


class SharedBeside(nn.Module):
    """A shared expert (any name) with a sigmoid gate beside the routed ones; softmax top-k, no renorm."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Mlp() for _ in range(E))
        self.always = Mlp()
        self.always_gate = nn.Linear(D, 1, bias=False)

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = softmax_topk(self.router(x), renorm=False)
        out = loop_combine(x, w, idx, list(self.experts))
        return (out + torch.sigmoid(self.always_gate(x)) * self.always(x)).view_as(h)


class ClampedInterleavedWithBiases(nn.Module):
    """Fused input-major gate/up with interleaved columns and a bias, a clamped SwiGLU ((u + 1) * g * sigmoid(1.702 g),
    g clamped above at 7, u to [-7, 7]), a down bias; router: a biased linear, top-k logits, softmax over them."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E)
        self.gate_up = nn.Parameter(torch.randn(E, D, 2 * FF) / math.sqrt(D) * 4)  # large: the clamps bite
        self.gate_up_bias = nn.Parameter(torch.randn(E, 2 * FF) * 0.5)
        self.down = nn.Parameter(torch.randn(E, FF, D) / math.sqrt(FF))
        self.down_bias = nn.Parameter(torch.randn(E, D) * 0.1)

    def forward(self, h):
        x = h.reshape(-1, D)
        top, idx = self.router(x).topk(K, dim=-1)
        w = top.softmax(-1)

        def expert(t, e):
            gu = t @ self.gate_up[e] + self.gate_up_bias[e]
            g, u = gu[..., 0::2].clamp(max=7.0), gu[..., 1::2].clamp(min=-7.0, max=7.0)
            return ((u + 1) * (g * torch.sigmoid(g * 1.702))) @ self.down[e] + self.down_bias[e]

        return loop_combine(x, w, idx, [lambda t, e=e: expert(t, e) for e in range(E)]).view_as(h)


class Scorer(nn.Module):
    """A router module that returns logits (frameworks record them with a hook on it)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, D) / math.sqrt(D))

    def forward(self, x_TD):
        return x_TD @ self.weight.t()


class RouterModuleLogits(nn.Module):
    """A router module returning logits, the selection in the block; ModuleList experts."""

    def __init__(self):
        super().__init__()
        self.scorer = Scorer()
        self.experts = nn.ModuleList(Mlp() for _ in range(E))

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = softmax_topk(self.scorer(x), renorm=False)
        return loop_combine(x, w, idx, list(self.experts)).view_as(h)


class Relu2Experts(nn.Module):
    """Non-gated experts with a squared ReLU, `relu(x) ** 2`."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Mlp(gated=False, act=lambda t: F.relu(t) ** 2) for _ in range(E))

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = softmax_topk(self.router(x))
        return loop_combine(x, w, idx, list(self.experts)).view_as(h)


class IdentityExperts(nn.Module):
    """E - 2 FFN experts and 2 zero-compute experts that return their input."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Mlp() for _ in range(E - 2))

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = softmax_topk(self.router(x))
        fns = list(self.experts) + [lambda t: t, lambda t: t]
        return loop_combine(x, w, idx, fns).view_as(h)


class ZeroExpertsFirst(nn.Module):
    """2 zero-compute experts that return zeros, router ids 0 and 1, before E - 2 fused GELU experts."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.w_in = nn.Parameter(torch.randn(E - 2, FF, D) / math.sqrt(D))
        self.w_out = nn.Parameter(torch.randn(E - 2, D, FF) / math.sqrt(FF))

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = softmax_topk(self.router(x))
        ffns = [lambda t, e=e: F.linear(F.gelu(F.linear(t, self.w_in[e])), self.w_out[e]) for e in range(E - 2)]
        return loop_combine(x, w, idx, [torch.zeros_like, torch.zeros_like, *ffns]).view_as(h)


class ExpertScale(nn.Module):
    """A learned per-expert output scale [E] on fused experts."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.w_in = nn.Parameter(torch.randn(E, FF, D) / math.sqrt(D))
        self.w_out = nn.Parameter(torch.randn(E, D, FF) / math.sqrt(FF))
        self.out_scale = nn.Parameter(torch.rand(E) + 0.5)

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = softmax_topk(self.router(x))
        experts = [lambda t, e=e: F.linear(F.gelu(F.linear(t, self.w_in[e])), self.w_out[e]) * self.out_scale[e]
                   for e in range(E)]
        return loop_combine(x, w, idx, experts).view_as(h)


class SortSelection(nn.Module):
    """Experts picked by a descending sort of the softmax scores and slicing (no top-k call), renormalised."""

    def __init__(self):
        super().__init__()
        self.ranker = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Mlp() for _ in range(E))

    def forward(self, h):
        x = h.reshape(-1, D)
        scores, order = torch.sort(self.ranker(x).softmax(-1), dim=-1, descending=True)
        w, idx = scores[:, :K], order[:, :K]
        return loop_combine(x, w / w.sum(-1, keepdim=True), idx, list(self.experts)).view_as(h)


class ArgsortSelection(SortSelection):
    """Sigmoid scores ranked by argsort, the first K kept, their scores gathered (no renormalisation)."""

    def forward(self, h):
        x = h.reshape(-1, D)
        scores = torch.sigmoid(self.ranker(x))
        idx = scores.argsort(dim=-1, descending=True)[..., :K]
        return loop_combine(x, scores.gather(1, idx), idx, list(self.experts)).view_as(h)


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


class NormExperts(nn.Module):
    """Experts with a norm inside: they run as traced (generic experts)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(NormExpert() for _ in range(E))

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = softmax_topk(self.router(x))
        return loop_combine(x, w, idx, list(self.experts)).view_as(h)


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


def _params(name: str) -> list:
    marks = [pytest.mark.xfail(strict=True, reason=NOT_YET[name])] if name in NOT_YET else []
    return [pytest.param(name, marks=marks, id=name)]


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    block = CASES[name].block()
    with torch.no_grad():  # zero-initialised tensors (biases) made non-trivial, as a trained model's are
        for t in [*block.parameters(), *block.buffers()]:
            if t.is_floating_point() and not t.any():
                t.copy_(torch.randn(t.shape) * 0.1)
    return block


@pytest.fixture(scope="module")
def detected():
    cache: dict[str, tuple[nn.Module, moepass.DetectionReport]] = {}

    def get(name: str):
        if name not in cache:
            block = _build(name)
            cache[name] = (block, moepass.detect(block))
        return cache[name]

    return get


@pytest.fixture(scope="module", autouse=True)
def _pools():
    yield
    shutdown()


def _further_inputs(block: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Token ids for a block that takes them after the hidden states (the hash router's)."""
    from moepass.detect.candidates import further_inputs
    from moepass.detect.check import token_ids

    gen = torch.Generator().manual_seed(8)
    return [token_ids(block, x.shape[:-1], gen) for _ in further_inputs(block)]


def _outputs(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


@pytest.mark.parametrize("name", [p for n in CASES for p in _params(n)])
def test_detected_exact_and_twin_rejected(name, detected):
    case = CASES[name]
    block, report = detected(name)
    assert len(report.blocks) == 1, report.summary()
    (spec,) = report.blocks
    assert case.expect(spec), spec
    # the near-miss twin: rejected with its reason, on the same probes the spec passes
    twin = case.twin(spec)
    assert twin != spec
    good, miss = check_specs(block, [spec, twin])
    assert good.accepted, good.reason
    assert not miss.accepted and case.twin_reason in miss.reason, miss.reason
    # exact under form="single": outputs and every gradient
    assert_exact(block, moepass.compile(copy.deepcopy(block), moepass.Plan(form="single"), report=report))


def assert_exact(block: nn.Module, compiled: nn.Module) -> None:
    """The compiled block's outputs, input gradient and every parameter gradient equal the block's."""
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(3))
    weight = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(4))
    further = _further_inputs(block, x)
    runs = []
    for module in (block, compiled):
        module.train()
        module.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        outs = _outputs(module(xi, *further))
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


@pytest.mark.parametrize("name", ["squared-ReLU experts", "per-expert output scale", IDENTITY])
def test_lowered_exact(name, detected):
    """The Triton lowering (interpreted here) of the graphs these variations add: the relu2 kernel, the scale
    folded into the weights, the slot-sorted permute and the zero-compute rows before the fused combine."""
    block, report = detected(name)
    compiled = moepass.compile(copy.deepcopy(block), moepass.Plan(form="single", lowering="triton"), report=report)
    lowered = {n.target for n in compiled.graph.nodes if getattr(n.target, "namespace", None) == "moe_lowered"}
    assert len(lowered) == 4, lowered  # route, permute, expert_ffn, unpermute + combine
    assert_exact(block, compiled)


def test_the_zoo_is_big_enough():
    supported = [n for n in CASES if n not in NOT_YET]
    assert len(supported) >= 12 and sum(CASES[n].ep for n in supported) >= 4


# ----------------------------------------------------------------------------------------------
# EP at W=2 (gloo): every rank's output and the logical gradient of every parameter.
# ----------------------------------------------------------------------------------------------


def case_ep(rank, world, name):
    """A zoo block under EP vs the original on the full batch: this rank's outputs and every gradient."""
    import moepass

    block = _build(name)
    cm = moepass.compile(copy.deepcopy(block), moepass.Plan(form="ep", topology=moepass.Topology(1, world)))
    x = torch.randn(2 * world, 5, D, generator=torch.Generator().manual_seed(5))
    weight = torch.randn(2 * world, 5, D, generator=torch.Generator().manual_seed(6))
    mine = slice(2 * rank, 2 * rank + 2)
    further = _further_inputs(block, x)  # token ids, for a block that takes them
    ref_out = block(x, *further)
    # EP's gradient convention: each rank's loss is its own; the reference is their mean
    (ref_out * weight).sum().div(world).backward()
    out = cm(x[mine], *[t[mine] for t in further])
    (out * weight[mine]).sum().backward()
    torch.testing.assert_close(out, ref_out[mine], rtol=RTOL, atol=ATOL)
    from moepass.runtime.grads import all_reduce_replicated_grads

    all_reduce_replicated_grads(cm)
    ref_grads = {n: p.grad for n, p in block.named_parameters()}
    grads = moepass.logical_grads(cm)
    assert grads, "no gradients"
    for n, (g, rows) in grads.items():
        want = ref_grads[n] if rows is None else ref_grads[n][rows]
        torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")
    return sorted(grads)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].ep and n not in NOT_YET])
def test_ep_parity_w2(name):
    results = pool(2).run(case_ep, name)
    # every parameter's gradient was compared on some rank (experts on their owner, the rest on both)
    assert set(results[0]) | set(results[1]) == {n for n, p in _build(name).named_parameters() if p.requires_grad}


def case_identity_rows_stay_local(rank, world):
    """The zero-compute block under EP: the dispatch sends this rank's FFN assignments and nothing else, and
    the EP graph never reads the FFN row count on the host (the dispatch sends the leading rows)."""
    import moepass
    from moepass.row_ops import ffn_rows

    block = _build(IDENTITY)
    cm = moepass.compile(copy.deepcopy(block), moepass.Plan(form="ep", topology=moepass.Topology(1, world)))
    x = torch.randn(6, 5, D, generator=torch.Generator().manual_seed(7 + rank))
    _, idx_TK = softmax_topk(block.router(x.reshape(-1, D)))
    moepass.reset_comm_stats()
    cm(x).sum().backward()
    sent = moepass.comm_stats()["dispatch"]
    ffn_assignments = int((idx_TK < E - 2).sum())
    host_reads = sum(n.target is ffn_rows for n in cm.graph.nodes)
    try:  # FSEP's buckets are expert slots: zero-compute experts have none
        moepass.compile(copy.deepcopy(block), moepass.Plan(form="fsep", topology=moepass.Topology(1, world)))
        fsep = "compiled"
    except moepass.PlanError as err:
        fsep = str(err)
    return (ffn_assignments, idx_TK.numel() - ffn_assignments, sent["intra"] + sent["self"] + sent["inter"],
            host_reads, fsep)


@pytest.mark.distributed
def test_identity_rows_never_cross_the_all_to_all():
    for ffn, identity, sent, host_reads, fsep in pool(2).run(case_identity_rows_stay_local):
        assert identity > 0 and ffn > 0  # both kinds of rows on every rank's batch: the count can tell them apart
        assert sent == ffn * D * 4 and host_reads == 0
        assert fsep == ("block '<root>' has identity / zero experts, which this form does not support (its buckets "
                        "are not the FFN experts, or it drops by capacity): use form='ep' without capacity, or leave "
                        "the block alone.")


def test_zero_compute_rows_in_the_single_graph():
    """The single form: the expert FFN gets only the FFN rows (one host read of their count, `ffn_rows`); the
    identity rows take their inputs, the zero rows zeros; the output scale is folded into the weights."""
    from moepass.canonical import expert_slots, ffn_rows, zero_compute_rows

    _, report = (lambda b: (b, moepass.detect(b)))(_build(IDENTITY))
    gm = moepass.compile(_build(IDENTITY), moepass.Plan(form="single"), report=report)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(ffn_rows) == targets.count(zero_compute_rows) == targets.count(expert_slots) == 1
    slots_TK = expert_slots(torch.tensor([[0, 5], [4, 1], [3, 2]]), (0, 1, 3), (4,), 6)  # 2, 5 zero; 4 identity
    assert slots_TK.tolist() == [[0, 4], [3, 1], [2, 4]]
    x_ND = torch.arange(12.0).view(6, 2)  # slot-sorted: 3 FFN rows, 1 identity row, 2 zero rows
    counts_J = torch.tensor([1, 1, 1, 1, 2])
    assert ffn_rows(x_ND, counts_J[:3]).shape == (3, 2)
    y = zero_compute_rows(-torch.ones(3, 2), x_ND, counts_J)
    assert y.tolist() == [[-1, -1]] * 3 + [[6, 7]] + [[0, 0]] * 2


def test_zero_compute_and_scale_spec_errors():
    from moepass.errors import PlanError
    from moepass.spec import CapacitySpec, ExpertsSpec, HeadsSpec, TensorSource

    (spec,) = moepass.detect(_build(IDENTITY)).blocks
    with pytest.raises(PlanError) as err:
        spec.replace(experts=replace(spec.experts, zero_experts=(4,), identity_experts=(4,)))
    assert str(err.value) == (
        "MoESpec[<root>].experts.identity_experts=[4], zero_experts=[4] are invalid: they must be distinct router "
        "ids in [0, 6) (R = num_experts=4 FFN experts + the identity and zero experts); list each zero-compute "
        "expert once.")
    with pytest.raises(PlanError, match=r"router.num_experts=6 is invalid: the experts container holds 4 FFN "
                                        r"experts and 1 identity / zero experts; they must agree"):
        spec.replace(experts=replace(spec.experts, identity_experts=(4,)))
    with pytest.raises(PlanError, match=r"capacity is not supported together with identity / zero experts"):
        spec.replace(capacity=CapacitySpec())
    heads = HeadsSpec(num_heads=2, head_dim=D, model_dim=2 * D)
    experts = ExpertsSpec(num_experts=2 * E, hidden_dim=D, ffn_dim=FF, activation="gelu",
                          output_scale=TensorSource.param("out_scale"))
    with pytest.raises(PlanError, match=r"heads is not supported together with experts.output_scale"):
        spec.replace(heads=heads, experts=experts)


# ----------------------------------------------------------------------------------------------
# Detection keys on the graph, never on a model family's or class's name.
# ----------------------------------------------------------------------------------------------

FAMILY_NAMES = ("mixtral", "qwen", "deepseek", "olmoe", "switch", "gpt_oss", "gpt-oss", "gptoss", "dbrx", "jamba",
                "granite", "phimoe", "grok", "arctic", "llama", "hunyuan", "minimax", "ernie", "glm4", "nllb")
REMOVED_NAME_LISTS = ("GATE_NAMES", "UP_NAMES", "DOWN_NAMES", "TOPK_ATTRS", "RENORM_ATTRS", "SELECTION_BIAS_NAMES",
                      "N_GROUP_NAMES", "TOPK_GROUP_NAMES", "SCALING_NAMES", "RENORM_NAMES", "BIAS_NAMES")


def test_no_model_family_names_in_detection():
    import importlib
    from pathlib import Path

    package = importlib.import_module("moepass.detect")  # `moepass.detect` itself is the function
    sources = sorted(Path(package.__file__).parent.glob("*.py"))
    assert len(sources) >= 10
    for source in sources:
        text = source.read_text()
        assert not [n for n in FAMILY_NAMES if n in text.lower()], source.name
        assert not [n for n in REMOVED_NAME_LISTS if n in text], source.name


# ----------------------------------------------------------------------------------------------
# What the captured graph says about a block (moepass.detect.capture / router / experts).
# ----------------------------------------------------------------------------------------------


def _candidate(name: str):
    from moepass.detect.candidates import capture_candidate, find_candidates

    (c,) = find_candidates(_build(name))
    assert capture_candidate(c) is None
    return c


def test_router_facts_come_from_the_graph():
    c = _candidate("bias-corrected top-k inside a softmax router, three fused weights")
    f = c.router
    assert (f.weight, f.bias, f.selection_bias, f.top_k, f.module) == ("gate", None, "correction", 2, None)
    assert c.router_path == "" and c.experts_kind == "fused" and sorted(c.fused_params) == ["w1", "w2", "w3"]
    c = _candidate("router forward takes a bias tensor of the block")
    f = c.router
    assert (f.module, f.selection_outputs, f.module_input, f.module_args) == ("router", (1, 0), "tokens",
                                                                              ("balance_bias",))
    assert f.weight == "router.w.weight"
    c = _candidate("routed scaling written inline")
    assert c.router.scales == [2.5] and c.router.sigmoid and c.router.renormalized
    c = _candidate("top-1 by argmax")
    assert c.router.top_k == 1 and c.selection is not None and c.selection.values is None
    assert not c.router.logits_fp32  # `self.selector(x)`: the input's dtype


def test_router_dtype_comes_from_the_graph():
    """`F.linear(x.float(), w.float())` computes the logits in fp32: a no-op on fp32 probes, yet in the graph."""
    from samples.models import LoopMoE

    (spec,) = moepass.detect(LoopMoE(D, FF, E, K)).blocks
    assert spec.router.dtype == "float32"


def test_expert_function_comes_from_the_graph():
    from moepass.detect.experts import read_expert

    fn = read_expert(Mlp(), D)
    assert not isinstance(fn, str)
    assert (fn.activation, fn.gate.weight, fn.up and fn.up.weight, fn.down.weight) == ("swiglu", "gate_in.weight",
                                                                                       "inp.weight", "outp.weight")
    fn = read_expert(FusedGateUpMlp(), D)
    assert not isinstance(fn, str) and fn.gate.interleave == (0, 2) and fn.up and fn.up.interleave == (1, 2)
    fn = read_expert(Mlp(gated=False, act=lambda t: F.relu(t) ** 2), D)
    assert not isinstance(fn, str) and fn.activation == "relu2" and fn.up is None
    assert read_expert(Mlp(gated=False, act=torch.tanh), D) == (
        "no known FFN activation ['swiglu', 'geglu', 'geglu_tanh', 'gelu', 'gelu_tanh', 'relu', 'relu2', 'clamped_swiglu'] "
        "reproduces an expert (not gated, F=24)")


def test_a_wider_router_is_read_only_where_no_exact_one_exists():
    """An [R, D] weight with E < R <= 2E makes a candidate (zero-compute experts beside E FFN experts) only
    when no ancestor holds an [E, D] one; an embedding table or an [R > 2E, D] weight never does."""
    from moepass.detect.candidates import find_candidates

    class Wide(nn.Module):
        def __init__(self, rows: int, embedding: bool = False):
            super().__init__()
            self.scores = nn.Embedding(rows, D) if embedding else nn.Linear(D, rows, bias=False)
            self.experts = nn.ModuleList(Mlp() for _ in range(E))

    assert [(c.num_experts, c.ffn_experts) for c in find_candidates(Wide(E + 3))] == [(E + 3, E)]
    assert find_candidates(Wide(2 * E + 1)) == [] and find_candidates(Wide(E + 3, embedding=True)) == []
    outer = nn.ModuleDict({"lm_head": nn.Linear(D, E + 1, bias=False), "moe": IdentityExperts()})
    assert [(c.path, c.num_experts) for c in find_candidates(outer)] == [("moe", E)]


def test_not_an_moe_selection_is_reported():
    """Structure alone (E modules and an [E, D] weight) is not enough: the graph must select among them."""

    class NoSelection(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = nn.Linear(D, E, bias=False)
            self.experts = nn.ModuleList(Mlp() for _ in range(E))

        def forward(self, h):
            weights = self.mix(h).softmax(-1)
            return sum(weights[..., e, None] * expert(h) for e, expert in enumerate(self.experts))

    report = moepass.detect(NoSelection())
    assert report.blocks == [] and report.rejected == [
        ("", f"no top-k / argmax over E={E} scores in the block's graph: not an MoE selection")]


def test_square_fused_experts_tie_on_shapes_and_the_check_decides():
    """D == F: the in- and out-projections (and their biases) have the same shapes, so shapes alone cannot
    say which is which; every reading is a hypothesis and the semantic check keeps the right one (this
    GShard sample was rejected while only unambiguous bias shapes were read)."""
    from samples.models import GShardMoE

    torch.manual_seed(0)
    block = GShardMoE(32, 32, 4, 2, capacity_factor=2.0)
    with torch.no_grad():
        for p in (block.bi, block.bo):
            p.normal_()  # zero biases would hide a swap
    report = moepass.detect(block)
    assert [s.path for s in report.blocks] == [""], report.summary()
    spec = report.blocks[0]
    assert (spec.experts.b_gate.paths, spec.experts.b_down.paths) == (("bi",), ("bo",))
    compiled = moepass.compile(block, report=report)
    x = torch.randn(2, 7, 32)
    torch.testing.assert_close(compiled(x), block(x), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Attention experts: a selection driving per-expert projections around an attention is no MoE FFN block.
# ----------------------------------------------------------------------------------------------


class AttentionExperts(nn.Module):
    """A mixture of attention experts: each token's K chosen experts project its query; one attention over the
    sequence; each expert's output projection, weighted, summed. Its experts are not functions of one token."""

    def __init__(self, mix_first: bool = False):
        super().__init__()
        self.mix_first = mix_first  # the twin: attention first, then routed token-wise experts
        self.router = nn.Linear(D, E, bias=False)
        self.q = nn.Parameter(torch.randn(E, D, D) * 0.2)
        self.o = nn.Parameter(torch.randn(E, D, D) * 0.2)
        self.kv = nn.Linear(D, 2 * D, bias=False)

    def attend(self, q_BSD, h):
        k, v = self.kv(h).chunk(2, dim=-1)
        return torch.softmax(q_BSD @ k.transpose(1, 2) / D ** 0.5, dim=-1) @ v

    def forward(self, h):
        B, S, _ = h.shape
        if self.mix_first:
            h = h + self.attend(h, h)
        x = h.reshape(-1, D)
        w, idx = softmax_topk(self.router(x))
        out = torch.zeros_like(x)
        for k in range(K):
            if self.mix_first:  # token-wise experts: [E, D, D] in, [E, D, D] out, between them a GELU
                y = torch.einsum("td,tfd->tf", x, self.q[idx[:, k]])
                y = F.gelu(y)
            else:  # the query of each token's k-th expert, then attention over the sequence
                q = torch.einsum("td,tfd->tf", x, self.q[idx[:, k]]).view(B, S, D)
                y = self.attend(q, h).reshape(-1, D)
            out = out + torch.einsum("tf,tdf->td", y, self.o[idx[:, k]]) * w[:, k, None]
        return out.view_as(h)


def test_attention_experts_are_left_alone_with_the_reason():
    torch.manual_seed(0)
    block = AttentionExperts()
    report = moepass.detect(block, example_inputs=torch.randn(2, 5, D))
    (d,) = report.details
    assert not d.accepted and d.left_alone, report.summary()
    assert "mixture of attention experts" in d.reason and "positions" in d.reason, d.reason
    assert "LEFT ALONE" in report.summary()
    compiled = moepass.compile(copy.deepcopy(block), moepass.Plan(form="single"), report=report)
    x = torch.randn(2, 5, D)
    torch.testing.assert_close(compiled(x), block(x), rtol=0, atol=0)  # left as it is


def test_attention_before_the_experts_is_no_attention_expert():
    """The twin: the same parts with the attention before the selection: the selection drives token-wise work,
    so the block is not left alone (it is read, or rejected, as an MoE block)."""
    torch.manual_seed(0)
    report = moepass.detect(AttentionExperts(mix_first=True), example_inputs=torch.randn(2, 5, D))
    (d,) = report.details
    assert not d.left_alone and "attention experts" not in d.reason, report.summary()


# ----------------------------------------------------------------------------------------------
# A router carrying a state from the previous layer (by keyword), a skip expert, the state returned.
# ----------------------------------------------------------------------------------------------


class CarryRouter(nn.Module):
    """Scores E experts and a skip expert (id E) from the tokens plus the previous layer's router state; a token
    that picks the skip expert gets expert 0 at weight 0 for it. Returns (weights, experts, its own state)."""

    def __init__(self):
        super().__init__()
        self.down = nn.Linear(D, 8)
        self.out = nn.Linear(8, E + 1, bias=False)

    def forward(self, x_TD, carry=None):
        s = self.down(x_TD)
        if carry is not None:
            s = s + carry
        w, idx = torch.softmax(self.out(s), dim=-1).topk(K, dim=-1)
        skip = idx == E
        return w.masked_fill(skip, 0), idx.masked_fill(skip, 0), s


class CarryBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.route = CarryRouter()
        self.experts = nn.ModuleList(Mlp() for _ in range(E))

    def forward(self, h, carry=None):
        x = h.reshape(-1, D)
        w, idx, state = self.route(x, carry=carry)
        return loop_combine(x, w, idx, list(self.experts)).view_as(h), state


def test_router_state_carried_across_layers_and_a_skip_expert():
    """The router module is called by keyword with a block input (the previous layer's state), picks a skip
    expert (masked to expert 0 at weight 0), and the block returns the router's new state: read as it is
    (`ROUTER_OUTPUT` side output), exact under single with the state given (outputs, every gradient, the state's
    gradient); the twin returning another router output is rejected."""
    torch.manual_seed(0)
    block = _build_fn(CarryBlock)
    x, carry = torch.randn(2, 7, D), torch.randn(14, 8)
    report = moepass.detect(block, example_inputs=(x, carry))
    (spec,) = report.blocks
    assert spec.side_outputs == ("router_output.2",) and spec.router.logits_from == "selection", spec
    assert spec.input_names == ("hidden_states", "carry") and spec.router.module_args == ("carry",), spec
    twin = spec.replace(side_outputs=("router_output.0",))
    good, miss = check_specs(block, [spec, twin], passthrough={"carry": carry}, shape=tuple(x.shape))
    assert good.accepted, good.reason
    assert not miss.accepted and "shape" in miss.reason, miss.reason
    compiled = moepass.compile(copy.deepcopy(block), moepass.Plan(form="single"), report=report)
    runs = []
    for module in (block, compiled):
        module.zero_grad(set_to_none=True)
        xi, ci = x.clone().requires_grad_(True), carry.clone().requires_grad_(True)
        out, state = module(xi, ci)
        (out.sum() + (state * 0.5).sum()).backward()
        runs.append((out, state, xi.grad, ci.grad, {n: p.grad for n, p in module.named_parameters()}))
    for a, b in zip(runs[1][:4], runs[0][:4]):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    for n, g in runs[0][4].items():
        got = runs[1][4][n]
        if g is None:
            assert got is None or not got.any(), n
        else:
            torch.testing.assert_close(got, g, rtol=RTOL, atol=ATOL)


def _build_fn(cls) -> nn.Module:
    block = cls()
    with torch.no_grad():
        for t in [*block.parameters(), *block.buffers()]:
            if t.is_floating_point() and not t.any():
                t.copy_(torch.randn(t.shape) * 0.1)
    return block
