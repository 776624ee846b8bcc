"""The hand-written blocks of the zoo (tests/test_detect_zoo.py), part one: the shared pieces (an FFN expert
module, the loop combine, a softmax top-k) and the blocks whose routers, layouts, activations and selections
vary around known FFN experts. The rest of the blocks and the case table are in tests/zoo_cases.py.

Shape legend: T tokens, D model width, F expert width, E experts, K top-k.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

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


class Routed(nn.Module):
    """The parts many zoo blocks share: a bias-free [E, D] router linear (under `name`), E experts made by
    `expert`, and the reference forward (softmax top-k, each expert on its tokens) unless a block has its own."""

    def __init__(self, expert: Callable[[], nn.Module] = Mlp, name: str = "router"):
        super().__init__()
        setattr(self, name, nn.Linear(D, E, bias=False))
        self.experts = nn.ModuleList(expert() for _ in range(E))

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = softmax_topk(self.router(x))
        return loop_combine(x, w, idx, list(self.experts)).view_as(h)


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


class InterleavedExpertModules(Routed):
    """ModuleList experts, each one linear holding gate and up rows interleaved."""

    def __init__(self):
        super().__init__(FusedGateUpMlp)


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


class InlineScaling(Routed):
    """Sigmoid, top-k, renormalise, then a constant scale written inline (no attribute says it)."""

    def __init__(self):
        super().__init__(name="r")

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


class SharedBeside(Routed):
    """A shared expert (any name) with a sigmoid gate beside the routed ones; softmax top-k, no renorm."""

    def __init__(self):
        super().__init__()
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


class SortSelection(Routed):
    """Experts picked by a descending sort of the softmax scores and slicing (no top-k call), renormalised."""

    def __init__(self):
        super().__init__(name="ranker")

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

