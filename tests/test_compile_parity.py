"""moepass.compile(form="single") gives the original model's outputs and gradients.

fp32 tolerances: rtol 1e-5, atol 1e-6. The verifier runs after every pass (MOEPASS_VERIFY=1, conftest).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from _parity import assert_same_training_step
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import moepass
from samples.models import ExpertMLP, FusedMoE, GShardMoE, LoopMoE, SampleConfig, TinyMoELM

RTOL, ATOL = 1e-5, 1e-6
STYLES = ["loop", "fused", "gshard", "mixed"]


@pytest.mark.parametrize("style", STYLES)
def test_lm_parity_outputs_and_every_gradient(style):
    model = TinyMoELM(SampleConfig(style=style, layers=3, dense_layers=1 if style == "mixed" else 0))
    compiled = moepass.compile(model, moepass.Plan(form="single"))
    expected_blocks = 2 if style == "mixed" else 3
    assert len(compiled.moepass_info.rewritten) == expected_blocks
    tokens = torch.randint(0, 256, (3, 21))
    torch.testing.assert_close(compiled(tokens), model(tokens), rtol=RTOL, atol=ATOL)
    assert_same_training_step(model, compiled, tokens)


def test_input_model_is_untouched_unless_inplace():
    model = TinyMoELM(SampleConfig(style="loop", layers=2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compiled = moepass.compile(model)
    assert compiled is not model
    assert all(type(m).__name__ != "MoEGraphModule" for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert list(compiled.state_dict()) == list(model.state_dict())
    same = moepass.compile(model, inplace=True)
    assert same is model and isinstance(model.layers[0].mlp, moepass.MoEGraphModule)


def test_optimizer_steps_match_over_several_steps():
    model = TinyMoELM(SampleConfig(style="mixed", layers=3))
    compiled = moepass.compile(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, compiled)]
    tokens = torch.randint(0, 256, (2, 17))
    for _ in range(3):
        losses = []
        for m, opt in zip((model, compiled), opts):
            opt.zero_grad()
            loss = m.loss(tokens)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=RTOL, atol=ATOL)


def test_one_expert_top1_equals_the_dense_mlp():
    block = LoopMoE(dim=16, ffn_dim=32, num_experts=1, top_k=1)
    dense = block.experts[0]
    compiled = moepass.compile(block)
    assert isinstance(compiled, moepass.MoEGraphModule)
    x = torch.randn(3, 5, 16, requires_grad=True)
    y = compiled(x)
    assert torch.equal(y, dense(x))
    (gx,) = torch.autograd.grad(y.sum(), x)
    (gx_dense,) = torch.autograd.grad(dense(x).sum(), x)
    torch.testing.assert_close(gx, gx_dense, rtol=0, atol=1e-7)


def test_blocks_left_alone_by_the_plan_stay_original():
    model = TinyMoELM(SampleConfig(style="loop", layers=2))
    compiled = moepass.compile(model, moepass.Plan(blocks={"layers.1.mlp": None}))
    assert isinstance(compiled.layers[0].mlp, moepass.MoEGraphModule)
    assert isinstance(compiled.layers[1].mlp, LoopMoE)
    assert compiled.moepass_info.skipped == {"layers.1.mlp": "Plan.blocks leaves it alone"}


# ---- property test against an independent naive per-token loop -------------------------------


class NaiveMoE(nn.Module):
    """A deliberately slow per-token MoE written without any batching: the oracle."""

    def __init__(self, D, F, E, K, score_func, renormalize, softmax_before_topk):
        super().__init__()
        self.top_k, self.renormalize = K, renormalize
        self.score_func, self.before = score_func, softmax_before_topk
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(D, F) for _ in range(E))

    def forward(self, hidden_states):
        rows = []
        for x_D in hidden_states.reshape(-1, hidden_states.shape[-1]):
            logits = self.gate(x_D)
            if self.score_func == "softmax" and not self.before:
                top, idx = logits.topk(self.top_k)
                weights = top.softmax(-1)
            else:
                scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
                weights, idx = scores.topk(self.top_k)
                if self.renormalize:
                    weights = weights / weights.sum()
            rows.append(sum(w * self.experts[int(e)](x_D) for w, e in zip(weights, idx)))
        return torch.stack(rows).reshape(hidden_states.shape)


@given(
    T=st.integers(1, 12), D=st.sampled_from([4, 8, 12]), F=st.sampled_from([4, 8, 16]), E=st.integers(1, 6),
    K=st.integers(1, 3), score_func=st.sampled_from(["softmax", "sigmoid"]), renormalize=st.booleans(),
    before=st.booleans(), seed=st.integers(0, 2**16),
)
def test_property_compiled_equals_naive_per_token_loop(T, D, F, E, K, score_func, renormalize, before, seed):
    K = min(K, E)
    torch.manual_seed(seed)
    block = NaiveMoE(D, F, E, K, score_func, renormalize, before)
    compiled = moepass.compile(block)
    assert isinstance(compiled, moepass.MoEGraphModule), moepass.detect(block).summary()
    x = torch.randn(1, T, D, requires_grad=True)
    y_ref = block(x)
    y = compiled(x)
    torch.testing.assert_close(y, y_ref, rtol=RTOL, atol=ATOL)
    g = torch.randn_like(y)
    inputs_ref, inputs = [x, *block.parameters()], [x, *compiled.parameters()]
    grads_ref = torch.autograd.grad(y_ref, inputs_ref, g, allow_unused=True)
    grads = torch.autograd.grad(y, inputs, g, allow_unused=True)
    for a, b, p in zip(grads, grads_ref, inputs_ref):  # unused experts: None on one side, zeros on the other
        a = torch.zeros_like(p) if a is None else a
        b = torch.zeros_like(p) if b is None else b
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


# ---- bf16 autocast: eager and compiled agree with the original ---------------------------------


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_bf16_autocast_parity(backend):
    torch._dynamo.reset()
    model = TinyMoELM(SampleConfig(style="mixed", layers=3))
    compiled = moepass.compile(model)
    run = compiled if backend is None else torch.compile(compiled, backend=backend)
    tokens = torch.randint(0, 256, (2, 17))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(tokens)
        got = run(tokens)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_ref = F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())
        loss = F.cross_entropy(run(tokens).float().flatten(0, 1), tokens.flatten())
    loss_ref.backward()
    loss.backward()
    for (name, p), q in zip(model.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=5e-2, atol=5e-2, msg=lambda m: f"{name}: {m}")


def test_under_autocast_each_block_returns_the_dtype_its_original_does():
    """A block summing into a buffer of its fp32 input returns fp32 under autocast, one summing its experts'
    bf16 outputs returns bf16: detection observes which, and the compiled block returns the same."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 16)
    for block in (LoopMoE(16, 24, 4, 2), FusedMoE(16, 24, 4, 2, shared_ffn_dim=8),
                  GShardMoE(16, 24, 6, 2, capacity_factor=0.5)):
        compiled = moepass.compile(block, moepass.Plan(form="single", keep_original_if_slower=False))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, got = block(x), compiled(x)
        assert got.dtype == want.dtype, type(block).__name__
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        assert compiled(x).dtype == torch.float32  # outside autocast: the input's dtype


def test_fused_and_gshard_blocks_alone():
    for block in (FusedMoE(16, 24, 4, 2, shared_ffn_dim=8), GShardMoE(16, 24, 6, 2, capacity_factor=0.5)):
        compiled = moepass.compile(block)
        x = torch.randn(2, 9, 16)
        torch.testing.assert_close(compiled(x), block(x), rtol=RTOL, atol=ATOL)
        assert copy.deepcopy(compiled)(x).shape == x.shape


@pytest.mark.parametrize("style", ["loop", "fused"])
def test_a_float64_model_keeps_float64_precision(style):
    """The combine sums in fp32 or wider: a float64 model's rewritten blocks match it to float64 rounding (they
    were 1e-7 apart when the combine summed its expert outputs in fp32)."""
    torch.manual_seed(0)
    model = TinyMoELM(SampleConfig(style=style, layers=2)).double()
    cm = moepass.compile(model, moepass.Plan(form="single", keep_original_if_slower=False))
    assert list(cm.moepass_info.rewritten) == ["layers.0.mlp", "layers.1.mlp"]
    tokens = torch.randint(0, 32, (2, 9))
    out, ref = cm(tokens), model(tokens)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    ref.square().sum().backward()
    grads = dict(model.named_parameters())
    for name, p in cm.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
