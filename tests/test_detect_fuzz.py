"""Fuzzing detection (hypothesis): random module trees, some MoE-like and some hostile; `moepass.detect` and
`moepass.explain` never raise, every rejection says why, and the user's model comes out unchanged.

A tree is 1-3 children under a root, nested up to two levels; a node is a dense MLP, an MoE-like block or a
container of nodes. MoE-like blocks (shape legend: D width, F expert width, E experts, K top-k) are written in
several ways: experts in a ModuleList, a ModuleDict or fused 3-D weights; the router an nn.Linear [E, D] or
a bare [E, D] parameter; softmax then top-k, top-k then softmax, or sigmoid with a selection-only bias.
Hostile features, drawn per node: a buffer named like a parameter (`weight`, `e_score_correction_bias`),
a process group attribute (the fake process group), forward hooks and pre-hooks (on any node), tuple and dict
outputs, an extra positional and a keyword argument, a forward that raises, 0-d and 1-d parameters, a tied
(shared) child, the whole tree on the meta device.

Properties per tree: `detect(model)` and `explain(model, Plan())` return (explain never reports detection
itself failing); every rejected block has a non-empty reason; the model's state_dict (tensor objects and
values, bitwise), module types, training flags and hook counts are the same before and after.

Cases: 200 (every profile; the "ci" profile derandomises them). Of the ci profile's 200 trees, 83 hold an
accepted block, 126 a rejected one, 21 no candidate, 29 are on the meta device; 16-40 s on one thread (the
range: this shared host's load). `explain` is given detect's report (its own detect call is the one above).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import moepass

D, FFN, E, K = 8, 8, 4, 2
OUTPUTS = ("tensor", "tuple", "dict")
EXPERTS = ("modulelist", "moduledict", "fused")
SCORES = ("softmax_topk", "topk_softmax", "sigmoid_bias")


@pytest.fixture(scope="module", autouse=True)
def fake_group():
    """The fake process group some nodes hold (and that stays initialised while the trees are detected); one
    intra-op thread (the probes' tensors are tiny: a second thread only adds contention, 10x on a busy host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    yield dist.group.WORLD
    dist.destroy_process_group()
    torch.set_num_threads(threads)


def tensor_of(out: object) -> torch.Tensor:
    """The hidden states of a node's output (tensor, tuple or dict)."""
    if isinstance(out, tuple):
        return out[0]
    if isinstance(out, dict):
        return out["hidden"]
    return out  # type: ignore[return-value]


def shaped(out: torch.Tensor, extra: torch.Tensor, kind: str) -> object:
    if kind == "tuple":
        return out, extra
    if kind == "dict":
        return {"hidden": out, "aux": extra}
    return out


class Hostile(nn.Module):
    """Base of every node: the drawn hostile extras, applied in `__init__` of the subclass via `decorate`."""

    raises = False
    output = "tensor"

    def decorate(self, flags: dict) -> None:
        self.raises, self.output = flags["raises"], flags["output"]
        if flags["weight_buffer"] and "weight" not in self._parameters:
            self.register_buffer("weight", torch.randn(D))  # a buffer named like a parameter
        if flags["scalars"]:
            self.scale_0d = nn.Parameter(torch.tensor(1.0))
            self.offset_1d = nn.Parameter(torch.zeros(D))
        if flags["group"]:
            self.group = dist.group.WORLD

    def finish(self, x: torch.Tensor, out: torch.Tensor, side: torch.Tensor | None = None) -> object:
        """The node's output as drawn: `out`, with `side` (default: a reduction of the input) beside it."""
        if self.raises:
            raise RuntimeError("hostile forward")
        if hasattr(self, "scale_0d"):
            out = out * self.scale_0d + self.offset_1d
        return shaped(out, x.sum(-1) if side is None else side, self.output)


class Dense(Hostile):
    def __init__(self, flags: dict):
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * FFN), nn.Linear(2 * FFN, D)
        self.decorate(flags)

    def forward(self, x, *rest, scale: float = 1.0):
        return self.finish(x, self.down(F.gelu(self.up(x))) * scale)


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(D, FFN, bias=False), nn.Linear(FFN, D, bias=False)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class MoELike(Hostile):
    """E experts, a router scoring them, top-K selection; written as `experts`, `router` and `score` say."""

    def __init__(self, flags: dict, experts: str, router: str, score: str):
        super().__init__()
        self.experts_kind, self.score = experts, score
        if router == "linear":
            self.gate = nn.Linear(D, E, bias=False)
        else:
            self.router_weight = nn.Parameter(torch.randn(E, D) / D**0.5)
        if experts == "modulelist":
            self.experts = nn.ModuleList(Expert() for _ in range(E))
        elif experts == "moduledict":
            self.experts = nn.ModuleDict({f"expert_{e}": Expert() for e in range(E)})
        else:
            self.w_in = nn.Parameter(torch.randn(E, D, FFN) / D**0.5)  # [E, D, F]
            self.w_out = nn.Parameter(torch.randn(E, FFN, D) / FFN**0.5)  # [E, F, D]
        if score == "sigmoid_bias":  # a selection-only bias, held as a buffer
            self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.decorate(flags)

    def logits(self, x_TD):
        weight = self.gate.weight if hasattr(self, "gate") else self.router_weight
        return x_TD @ weight.t()

    def expert(self, e: int, x):
        if self.experts_kind == "fused":
            return F.gelu(x @ self.w_in[e]) @ self.w_out[e]
        experts = self.experts if self.experts_kind == "modulelist" else list(self.experts.values())
        return experts[e](x)

    def forward(self, hidden_states, *rest, temperature: float = 1.0):
        x_TD = hidden_states.reshape(-1, D)
        logits_TE = self.logits(x_TD) / temperature
        if self.score == "softmax_topk":
            weights_TK, experts_TK = logits_TE.softmax(-1).topk(K, dim=-1)
        elif self.score == "topk_softmax":
            top_TK, experts_TK = logits_TE.topk(K, dim=-1)
            weights_TK = top_TK.softmax(-1)
        else:
            scores_TE = logits_TE.sigmoid()
            experts_TK = (scores_TE + self.e_score_correction_bias).topk(K, dim=-1).indices
            weights_TK = scores_TE.gather(-1, experts_TK)
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        out_TD = torch.zeros_like(x_TD)
        for e in range(E):
            token, slot = torch.where(experts_TK == e)
            if token.numel():
                out_TD.index_add_(0, token, self.expert(e, x_TD[token]) * weights_TK[token, slot, None])
        return self.finish(hidden_states, out_TD.reshape(hidden_states.shape), side=logits_TE)  # + router logits


class MoEWithIds(MoELike):
    """An MoE-like block with a required extra positional input (probed as token ids) it reads."""

    def forward(self, hidden_states, token_ids, temperature: float = 1.0):
        shift = token_ids.float().mean() * 0.0 if isinstance(token_ids, torch.Tensor) else 0.0
        return super().forward(hidden_states + shift, temperature=temperature)


class Container(Hostile):
    """Children called in turn (their outputs reduced to the hidden states); `tied` registers one child twice."""

    def __init__(self, flags: dict, children: list[nn.Module], tied: bool):
        super().__init__()
        self.order = [f"part_{i}" for i in range(len(children))]
        for name, child in zip(self.order, children):
            self.add_module(name, child)
        if tied:
            self.add_module("again", children[0])  # the same module under a second name
            self.order.append("again")
        self.decorate(flags)

    def forward(self, x, *rest, **kwargs):
        for name in self.order:
            x = tensor_of(getattr(self, name)(x, *rest, **kwargs))
        return self.finish(x, x)


def add_hooks(module: nn.Module, hooks: int) -> None:
    """Forward hooks that leave the output as it is or scale a tensor output; pre-hooks that return None."""
    for i in range(hooks):
        if i % 2:
            module.register_forward_pre_hook(lambda m, args: None)
        else:
            module.register_forward_hook(lambda m, args, out: out * 1.5 if isinstance(out, torch.Tensor) else out)


flags = st.fixed_dictionaries({
    "raises": st.sampled_from([False] * 7 + [True]),
    "output": st.sampled_from(OUTPUTS[:1] * 2 + OUTPUTS[1:]),
    "weight_buffer": st.booleans(),
    "scalars": st.sampled_from([False] * 3 + [True]),
    "group": st.booleans(),
    "hooks": st.sampled_from([0, 0, 1, 2]),
})  # what changes a block's output (a raise, a side output, scalars, a scaling hook) is drawn less often: a
# rejected block costs every hypothesis's check (~0.1-1 s), an accepted one the first


@st.composite
def nodes(draw, depth: int = 0) -> nn.Module:
    kind = draw(st.sampled_from(["moe", "moe", "dense"] + (["container"] if depth < 2 else [])))
    f = draw(flags)
    if kind == "dense":
        node: nn.Module = Dense(f)
    elif kind == "moe":
        cls = draw(st.sampled_from([MoELike, MoELike, MoEWithIds]))
        node = cls(f, draw(st.sampled_from(EXPERTS)), draw(st.sampled_from(["linear", "parameter"])),
                   draw(st.sampled_from(SCORES)))
    else:
        children = draw(st.lists(nodes(depth + 1), min_size=1, max_size=2))
        node = Container(f, children, tied=draw(st.booleans()))
    add_hooks(node, f["hooks"])
    return node


@st.composite
def trees(draw) -> tuple[nn.Module, bool]:
    on_meta = draw(st.sampled_from([False] * 4 + [True]))
    seed = draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    with torch.device("meta" if on_meta else "cpu"):
        children = draw(st.lists(nodes(), min_size=1, max_size=3))
        model = Container(draw(flags), children, tied=False)
    return model, on_meta


def fingerprint(model: nn.Module) -> tuple:
    """What 'unchanged' means: module types and flags by path, hook counts, each state_dict entry's tensor
    object, shape, dtype, device (and value, bitwise, off the meta device)."""
    modules = tuple((name, type(m), m.training, len(m._forward_hooks), len(m._forward_pre_hooks))
                    for name, m in model.named_modules(remove_duplicate=False))
    tensors = {name: (t, tuple(t.shape), t.dtype, t.device, None if t.is_meta else t.detach().clone())
               for name, t in model.state_dict(keep_vars=True).items()}
    return modules, tensors


def assert_unchanged(before: tuple, after: tuple) -> None:
    assert before[0] == after[0]
    assert before[1].keys() == after[1].keys()
    for name, (t, *facts, value) in before[1].items():
        t2, *facts2, value2 = after[1][name]
        assert t is t2 and facts == facts2, name
        assert (value is None) == (value2 is None) and (value is None or torch.equal(value, value2)), name


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(trees())
def test_detect_and_explain_never_raise_and_leave_the_model_unchanged(tree):
    model, _ = tree
    before = fingerprint(model)
    report = moepass.detect(model)
    assert all(reason for _, reason in report.rejected), report.summary()
    text = moepass.explain(model, moepass.Plan(), graphs=False, report=report)  # its detect: the call above
    assert text.startswith("moepass plan: form='single'") and report.summary() in text
    assert_unchanged(before, fingerprint(model))


@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("router,output,cls,benign", [("linear", "tensor", MoELike, {}),
                                                       ("parameter", "tuple", MoEWithIds, {"weight_buffer": True,
                                                                                           "group": True})])
def test_the_fuzzed_moe_blocks_are_moe_blocks(experts, score, router, output, cls, benign):
    """The generator's MoE-like blocks are accepted, plain and with the extras that keep their semantics (a router
    parameter, the router logits as a second output, a token-id input, a buffer named `weight`, a process group):
    the fuzz exercises real blocks."""
    drawn = {"raises": False, "output": output, "weight_buffer": False, "scalars": False, "group": False, **benign}
    torch.manual_seed(0)
    report = moepass.detect(cls(drawn, experts, router, score))
    assert len(report) == 1, report.summary()
