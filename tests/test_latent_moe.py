"""Multi-Head LatentMoE (moepass.nn.MultiHeadLatentMoE): its forward, its self-description, detection
with the semantic check, the canonical heads graph and `compile(form="single")` parity.

fp32 tolerances: rtol 1e-5, atol 1e-6 (the verifier runs after every pass: MOEPASS_VERIFY=1, conftest).
Shape legend: T tokens, D model width, H heads, h head width, E experts per head, K top-k, m expert width.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _golden import check_golden
from _parity import assert_same_training_step

import moepass
from lowering import gating
from moepass import canonical, dialect
from moepass.detect.check import check_specs
from moepass.errors import PlanError
from moepass.nn import MultiHeadLatentMoE
from moepass.spec import ExpertsSpec, HeadsSpec, MoESpec, RouterSpec, TensorSource
from samples.models import tiny_latent_lm

RTOL, ATOL = 1e-5, 1e-6
GOLDEN = Path(__file__).parent / "golden"

# (H heads, h head width, E experts per head, K top-k, m expert width, activation)
CASES = [
    (2, 4, 3, 1, 5, "gelu"),  # top-1
    (4, 8, 4, 2, 6, "swiglu"),
    (3, 4, 4, 4, 5, "gelu"),  # K = E: every expert of the head
    (1, 8, 2, 2, 4, "swiglu"),  # one head
    (4, 4, 8, 3, 6, "gelu"),
]
D = 12


def make_block(H, h, E, K, m, act, rate=1e-3, seed=0) -> MultiHeadLatentMoE:
    torch.manual_seed(seed)
    block = MultiHeadLatentMoE(D, heads=H, head_dim=h, experts=E, top_k=K, ffn_dim=m, activation=act,
                               bias_update_rate=rate)
    with torch.no_grad():  # a bias that matters for the selection
        block.selection_bias.copy_(torch.randn(H, E) * 0.3)
    return block


def naive(block: MultiHeadLatentMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sub-token at a time, straight from the paper's formulas: (output, loads [H, E])."""
    H, h, E, K = block.heads, block.head_dim, block.num_experts, block.top_k
    x_TD = x.reshape(-1, D)
    load = torch.zeros(H, E)
    rows = []
    for t in range(x_TD.shape[0]):
        z = block.w_in.weight @ x_TD[t]  # [H*h]
        heads = []
        for j in range(H):
            z_j = z[j * h:(j + 1) * h]
            logits = block.router[j] @ z_j  # [E]
            chosen = torch.argsort(logits.detach() + block.selection_bias[j], descending=True)[:K]
            weights = torch.softmax(logits[chosen], dim=0)
            y_j = torch.zeros(h)
            for k in range(K):
                g = j * E + int(chosen[k])  # head j's own experts
                up = block.w_up[g] @ z_j
                a = F.gelu(up) if block.w_gate is None else F.silu(block.w_gate[g] @ z_j) * up
                y_j = y_j + weights[k] * (block.w_down[g] @ a)
                load[j, chosen[k]] += 1
            heads.append(y_j)
        rows.append(block.w_out.weight @ torch.cat(heads))
    return torch.stack(rows).reshape(x.shape), load


def grads_of(block, x, fn):
    block.zero_grad()
    x = x.clone().requires_grad_(True)
    out = fn(block, x)
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in block.named_parameters()}


# ----------------------------------------------------------------------------------------------
# (a) the module's forward is the Multi-Head LatentMoE
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: "H{}h{}E{}K{}m{}-{}".format(*c))
def test_forward_and_every_gradient_equal_a_naive_per_subtoken_loop(case):
    block = make_block(*case).eval()
    x = torch.randn(2, 5, D)
    out, gx, grads = grads_of(block, x, lambda b, t: b(t))
    out_ref, gx_ref, grads_ref = grads_of(block, x, lambda b, t: naive(b, t)[0])
    torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(gx, gx_ref, rtol=RTOL, atol=ATOL)
    assert set(grads) == {"w_in.weight", "router", "w_up", "w_down", "w_out.weight"} | (
        {"w_gate"} if case[-1] == "swiglu" else set())
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"H{c[0]}E{c[2]}K{c[3]}")
def test_selection_bias_update_in_train_mode_only(case):
    H, _, E, K, _, _ = case
    block, rate = make_block(*case, rate=0.01), 0.01
    x = torch.randn(3, 4, D)
    before = block.selection_bias.clone()
    block.eval()(x)
    assert torch.equal(block.selection_bias, before), "eval mode must not update the bias"
    _, load = naive(block, x)
    assert load.sum() == 12 * H * K
    block.train()(x)
    expected = before + rate * torch.sign(12 * K / E - load)
    torch.testing.assert_close(block.selection_bias, expected, rtol=0, atol=1e-7)
    # the dialect's reference rule agrees (rows token-major, head-minor)
    experts_GK = torch.stack([torch.argsort(row, descending=True)[:K] for row in
                              (torch.einsum("thc,hec->the", block.w_in(x.reshape(-1, D)).view(-1, H, case[1]),
                                            block.router) + before).reshape(-1, E)])
    torch.testing.assert_close(dialect.update_selection_bias_ref(before, experts_GK, rate), expected, rtol=0, atol=1e-7)


def test_bias_is_selection_only_and_gets_no_gradient():
    block = make_block(2, 4, 4, 2, 5, "gelu").eval()
    x = torch.randn(7, D)
    with torch.no_grad():
        block.selection_bias.zero_()
        block.selection_bias[:, 0] = 100.0  # expert 0 of every head always selected ...
    out = block(x)
    with torch.no_grad():  # ... but weighted by the unbiased logits: the naive loop says the same
        torch.testing.assert_close(out, naive(block, x)[0], rtol=RTOL, atol=ATOL)
    assert "selection_bias" in dict(block.named_buffers()) and "selection_bias" not in dict(block.named_parameters())


def test_constructor_errors_name_the_argument():
    with pytest.raises(ValueError, match="activation='relu'"):
        MultiHeadLatentMoE(8, heads=2, head_dim=4, experts=4, top_k=2, ffn_dim=8, activation="relu")
    with pytest.raises(ValueError, match="top_k=5"):
        MultiHeadLatentMoE(8, heads=2, head_dim=4, experts=4, top_k=5, ffn_dim=8)


# ----------------------------------------------------------------------------------------------
# (b) detection: the block describes itself, the semantic check still runs
# ----------------------------------------------------------------------------------------------


def test_detect_finds_both_blocks_of_a_tiny_latent_lm():
    model = tiny_latent_lm(layers=2, dim=32, heads=4, head_dim=8, experts=4, top_k=2)
    report = moepass.detect(model)
    assert [s.path for s in report.blocks] == ["layers.0.mlp", "layers.1.mlp"]
    assert report.rejected == []
    spec = report.blocks[0]
    assert spec.recogniser == "self-described" and spec.heads == HeadsSpec(4, 8, 32)
    assert spec.router.num_experts == 4 and spec.experts.num_experts == 16 and spec.experts.hidden_dim == 8
    assert spec.model_dim == 32
    detail = report.details[0]
    assert detail.check is not None and detail.check.accepted and detail.check.contract_checked
    assert detail.check.compared_tokens > 0  # the selection was observed and compared, per sub-token
    text = report.summary()
    assert "heads H=4 h=8 D=32, E=4/head (16 in all) K=2/sub-token" in text
    assert "selection-bias(updated, rate 0.001)" in text


class Lying(MultiHeadLatentMoE):
    """A Multi-Head LatentMoE whose self-description is changed by `lie(spec)`."""

    def __init__(self, lie, **kw):
        super().__init__(D, heads=2, head_dim=4, experts=4, top_k=2, ffn_dim=6, **kw)
        self.lie = lie

    def moepass_spec(self, path):
        return self.lie(super().moepass_spec(path))


def _router(**changes):
    return lambda s: s.replace(router=replace(s.router, **changes))


NEAR_MISSES = {
    "wrong top_k": (_router(top_k=1), "selects 1 experts per token, block selects 2"),
    "selection bias forgotten": (_router(selection_bias=None, bias_update_rate=0.0), "tokens select different experts"),
    "softmax before top-k": (_router(softmax_before_topk=True), "outputs differ"),
    "bias update forgotten": (_router(bias_update_rate=0.0), "buffer 'selection_bias'"),
    "wrong update rate": (_router(bias_update_rate=0.1), "buffer 'selection_bias'"),
    "activation": (lambda s: s.replace(experts=replace(s.experts, activation="relu")), "outputs differ"),
}


@pytest.mark.parametrize("kind", NEAR_MISSES)
def test_a_lying_self_description_is_rejected_with_the_reason(kind):
    lie, reason = NEAR_MISSES[kind]
    report = moepass.detect(Lying(lie))
    assert report.blocks == []
    ((path, why),) = report.rejected
    assert path == "" and why.startswith("self-described: ") and reason in why, why


def test_an_honest_description_passes_the_same_check():
    report = moepass.detect(Lying(lambda s: s))
    assert len(report.blocks) == 1 and report.rejected == []


@pytest.mark.parametrize("bad, reason", [
    (lambda s: 1 / 0, "moepass_spec('') raised ZeroDivisionError"),
    (lambda s: "moe", "returned str, not a moepass.MoESpec"),
    (lambda s: s.replace(path="elsewhere"), "returned a spec for path 'elsewhere'"),
])
def test_a_broken_self_description_is_declined_never_raised(bad, reason):
    ((_, why),) = moepass.detect(Lying(bad)).rejected
    assert reason in why, why


def test_every_hypothesis_probe_starts_from_the_same_buffers():
    block = make_block(2, 4, 4, 2, 5, "gelu", rate=0.05)
    spec = block.moepass_spec("")
    before = block.selection_bias.clone()
    results = check_specs(block, [spec.replace(router=replace(spec.router, bias_update_rate=0.0)), spec, spec])
    assert [r.accepted for r in results] == [False, True, True]
    assert torch.equal(block.selection_bias, before), "the user's block is never touched"


# ----------------------------------------------------------------------------------------------
# (c) the canonical heads graph and compile(form="single") parity
# ----------------------------------------------------------------------------------------------


def _latent_gm():
    block = make_block(2, 4, 3, 2, 5, "swiglu")
    (spec,) = moepass.detect(block).blocks
    return canonical.build(spec, block)


def test_canonical_heads_graph_is_readable_and_verified():
    gm = _latent_gm()
    names = [n.name for n in gm.graph.nodes]
    for name in ("x_TD", "z_TQ", "z_Gh", "logits_GE", "selection_bias_GE", "route", "experts_GK",
                 "update_selection_bias", "ids_GK", "permute", "y_Nh", "y_GKh", "y_Gh", "y_TQ", "out_TD"):
        assert name in names, name
    assert names.index("z_TQ") < names.index("route") < names.index("y_TQ") < names.index("out_TD")
    assert {n.meta["moepass"]["pass"] for n in gm.graph.nodes} == {"canonical"}
    route = next(n for n in gm.graph.nodes if n.target is dialect.ROUTE)
    assert route.args[2:5] == ("softmax", False, 2)  # post-top-k softmax
    permute = next(n for n in gm.graph.nodes if n.target is dialect.PERMUTE)
    assert permute.args[2] == 6  # H*E experts
    moepass.verify(gm)
    check_golden(GOLDEN / "canonical_latent.txt",
                 lambda: _latent_gm().print_readable(print_output=False, include_stride=False, include_device=False))


@pytest.mark.parametrize("activation, top_k", [("gelu", 2), ("swiglu", 1), ("gelu", 4)])
def test_compile_single_equals_the_original_outputs_gradients_and_bias_updates(activation, top_k):
    model = tiny_latent_lm(layers=2, dim=32, heads=4, head_dim=8, experts=4, top_k=top_k, activation=activation,
                           bias_update_rate=0.01)
    with torch.no_grad():
        for block in (layer.mlp for layer in model.layers):
            block.selection_bias.copy_(torch.randn_like(block.selection_bias) * 0.3)
    compiled = moepass.compile(model, moepass.Plan(form="single"))
    assert len(compiled.moepass_info.rewritten) == 2
    assert all(isinstance(layer.mlp, moepass.MoEGraphModule) for layer in compiled.layers)
    assert list(compiled.state_dict()) == list(model.state_dict())
    tokens = torch.randint(0, 256, (3, 13))

    model.eval(), compiled.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens), model(tokens), rtol=RTOL, atol=ATOL)
    biases = {n: b.clone() for n, b in model.named_buffers()}
    assert all(torch.equal(b, biases[n]) for n, b in compiled.named_buffers()), "eval must not update"

    model.train(), compiled.train()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, compiled)]
    for _ in range(2):  # two steps: the second routes with the updated biases
        for opt in opts:
            opt.zero_grad()
        assert_same_training_step(model, compiled, tokens)
        ours = dict(compiled.named_buffers())
        for name, bias in model.named_buffers():
            if top_k < 4:  # K = E: every expert carries the mean load, the rule leaves the bias as it is
                assert not torch.equal(bias, biases[name]), f"{name} was not updated"
            torch.testing.assert_close(ours[name], bias, rtol=0, atol=1e-7, msg=lambda m: f"{name}: {m}")
            biases[name] = bias.clone()
        for opt in opts:
            opt.step()


def test_compiled_block_is_the_module_forward_on_bf16_autocast():
    block = make_block(2, 8, 4, 2, 16, "swiglu").eval()
    compiled = moepass.compile(block)
    x = torch.randn(4, 6, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, theirs = compiled(x), block(x)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------------------------
# the dialect and the lowering: a per-row selection bias
# ----------------------------------------------------------------------------------------------


def test_route_takes_a_bias_per_row_as_well_as_per_expert():
    logits = torch.randn(6, 5, requires_grad=True)
    bias_TE = torch.randn(6, 5)
    args = ("softmax", False, 2, False, 1, 1, "top2_sum", 1.0)
    weights, experts = dialect.route(logits, bias_TE, *args)
    for t in range(6):
        w_t, e_t = dialect.route(logits[t:t + 1], bias_TE[t], *args)
        assert torch.equal(experts[t], e_t[0]) and torch.equal(weights[t], w_t[0])
    weights.sum().backward()  # the autograd formula is the same: selection has no gradient
    assert logits.grad is not None
    with pytest.raises(ValueError, match=r"expected \(E=5,\) or one row per token \(T=6, E=5\)"):
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            dialect.route(torch.empty(6, 5), torch.empty(3, 5), *args)


def test_gating_kernel_takes_a_per_row_bias():
    logits = torch.randn(6, 5)
    assert gating.eligible(logits, torch.randn(6, 5), "softmax", False, 2, False, 1, 1, "top2_sum", 1.0) is None


def test_update_selection_bias_op_is_in_place_in_train_mode_only():
    bias = torch.zeros(2, 3)
    experts_GK = torch.tensor([[0, 1], [2, 1], [0, 2], [2, 1]])  # tokens 0, 1; heads 0, 1
    dialect.update_selection_bias(bias, experts_GK, 0.5, False)
    assert torch.equal(bias, torch.zeros(2, 3))
    dialect.update_selection_bias(bias, experts_GK, 0.5, True)
    # head 0 picked {0, 1}, {0, 2}: loads (2, 1, 1) vs mean 4/3; head 1 picked {2, 1}, {2, 1}: (0, 2, 2)
    assert torch.equal(bias, torch.tensor([[-0.5, 0.5, 0.5], [0.5, -0.5, -0.5]]))


# ----------------------------------------------------------------------------------------------
# (e) spec validation
# ----------------------------------------------------------------------------------------------


def _spec(**changes):
    base = dict(
        path="blk", recogniser="test",
        router=RouterSpec(num_experts=4, top_k=2, softmax_before_topk=False, weight=TensorSource.param("router"),
                          selection_bias=TensorSource.param("selection_bias"), bias_update_rate=1e-3),
        experts=ExpertsSpec(num_experts=8, hidden_dim=4, ffn_dim=6, activation="gelu",
                            w_gate=TensorSource.param("w_up"), w_down=TensorSource.param("w_down")),
        heads=HeadsSpec(num_heads=2, head_dim=4, model_dim=12),
    )
    base.update(changes)
    return MoESpec(**base)


def test_a_valid_heads_spec_and_its_summary():
    spec = _spec()
    assert spec.num_experts == 8 and spec.model_dim == 12
    assert spec.summary().startswith("heads H=2 h=4 D=12, E=4/head (8 in all) K=2/sub-token F=6 gelu")


@pytest.mark.parametrize("changes, message", [
    (dict(experts=ExpertsSpec(num_experts=4, hidden_dim=4, ffn_dim=6, activation="gelu")),
     r"experts.num_experts=4 is invalid with heads: .* must be heads.num_heads \* router.num_experts = 2 \* 4 = 8"),
    (dict(experts=ExpertsSpec(num_experts=8, hidden_dim=12, ffn_dim=6, activation="gelu")),
     r"experts.hidden_dim=12 is invalid with heads: .* set it to 4"),
    (dict(heads=HeadsSpec(num_heads=0, head_dim=4, model_dim=12)), r"heads.num_heads=0 is invalid"),
    (dict(capacity=moepass.CapacitySpec()), r"heads is not supported together with capacity"),
    (dict(router=RouterSpec(num_experts=4, top_k=2, bias=TensorSource.param("b"))),
     r"heads is not supported together with router.bias"),
    (dict(router=RouterSpec(num_experts=4, top_k=2, bias_update_rate=1e-3)),
     r"bias_update_rate=0.001 is invalid without a selection_bias"),
    (dict(router=RouterSpec(num_experts=4, top_k=2, selection_bias=TensorSource.param("b"), bias_update_rate=-1.0)),
     r"bias_update_rate=-1.0 is invalid: use a rate >= 0"),
])
def test_spec_validation_names_the_field_and_the_fix(changes, message):
    with pytest.raises(PlanError, match=message):
        _spec(**changes)


def test_input_model_untouched_and_deepcopy_safe():
    block = make_block(2, 4, 3, 2, 5, "gelu")
    before = copy.deepcopy(block.state_dict())
    moepass.compile(block)
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())


def test_lowered_single_form_lowers_every_family_and_matches():
    block = make_block(2, 8, 4, 2, 16, "swiglu").eval()
    compiled = moepass.compile(block, moepass.Plan(lowering="triton"))  # interpreted on CPU (conftest)
    (lower,) = [h for h in compiled.history if h["pass"] == "lower"]
    assert lower["stats"]["lowered"] == {"gating": 1, "permute": 1, "grouped_gemm": 1, "combine": 1}
    assert lower["stats"]["declined"] == {}  # per-head routing included: the gating kernel takes a [T, E] bias
    x = torch.randn(2, 3, D)
    out, gx, grads = grads_of(compiled, x, lambda b, t: b(t))
    out_ref, gx_ref, grads_ref = grads_of(block, x, lambda b, t: b(t))
    torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(gx, gx_ref, rtol=RTOL, atol=ATOL)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
