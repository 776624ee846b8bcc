"""A zoo of hand-written MoE blocks that no recogniser names: detection reads each from its graph.

One case table. Each case is a block written the way people write MoE layers (routers of every
shape, experts at any depth, layouts and activations of every kind), and a near-miss twin: the
accepted spec with one thing changed (renormalisation dropped, a bias forgotten, the activation
swapped, ...), which the semantic check must reject with its reason on the same probes. Every
accepted block must be exact under `Plan(form="single")`: outputs and every gradient against the
original block; the cases marked `ep` also under EP at W=2 on gloo (`test_ep_parity_w2`). A block that
takes token ids after the hidden states (the hash router's) gets them in every run (`zoo_cases.token_inputs`).

Shape legend: T tokens, D model width, F expert width, E experts, K top-k.
"""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moepass
from moepass.detect.check import check_specs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402
from zoo_blocks import ATOL, FF, RTOL, D, E, FusedGateUpMlp, IdentityExperts, K, Mlp, Routed, loop_combine, softmax_topk  # noqa: E402
from zoo_cases import CASES, IDENTITY, NOT_YET, assert_exact, build, token_inputs  # noqa: E402


def _params(name: str) -> list:
    marks = [pytest.mark.xfail(strict=True, reason=NOT_YET[name])] if name in NOT_YET else []
    return [pytest.param(name, marks=marks, id=name)]


@pytest.fixture(scope="module")
def detected():
    cache: dict[str, tuple[nn.Module, moepass.DetectionReport]] = {}

    def get(name: str):
        if name not in cache:
            block = build(name)
            cache[name] = (block, moepass.detect(block))
        return cache[name]

    return get



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

    block = build(name)
    cm = moepass.compile(copy.deepcopy(block), moepass.Plan(form="ep", topology=moepass.Topology(1, world)))
    x = torch.randn(2 * world, 5, D, generator=torch.Generator().manual_seed(5))
    weight = torch.randn(2 * world, 5, D, generator=torch.Generator().manual_seed(6))
    mine = slice(2 * rank, 2 * rank + 2)
    further = token_inputs(block, x)  # token ids, for a block that takes them
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
    assert set(results[0]) | set(results[1]) == {n for n, p in build(name).named_parameters() if p.requires_grad}


def case_identity_rows_stay_local(rank, world):
    """The zero-compute block under EP: the dispatch sends this rank's FFN assignments and nothing else, and
    the EP graph never reads the FFN row count on the host (the dispatch sends the leading rows)."""
    import moepass
    from moepass.row_ops import ffn_rows

    block = build(IDENTITY)
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

    _, report = (lambda b: (b, moepass.detect(b)))(build(IDENTITY))
    gm = moepass.compile(build(IDENTITY), moepass.Plan(form="single"), report=report)
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

    (spec,) = moepass.detect(build(IDENTITY)).blocks
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

    (c,) = find_candidates(build(name))
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

    class NoSelection(Routed):
        def __init__(self):
            super().__init__(name="mix")

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
